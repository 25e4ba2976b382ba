"""Experiment tracking: each adapter's training curve, eval metrics and hyperparameters sent
to TensorBoard and Weights & Biases (the space file's ``logging`` section), one tracker run
per adapter. `forward` decides when, `records` reads what, the loggers write it."""
