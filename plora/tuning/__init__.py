"""Optuna integration: every sweep is a study, and any Optuna sampler can drive packed training.

People who tune hyperparameters already have Optuna's samplers, pruners, storages and
dashboard; plora should be the fastest way to run that search on LoRA adapters, not a
second island. Two directions:

* **Record** (`plora.tuning.study`). A finished ``plora sweep`` is written into an Optuna
  study (SQLite in the run directory unless ``optuna.storage`` names another storage): one
  trial per adapter, with its hyperparameters as params, the eval objective as value, the
  state and user attrs. ``optuna-dashboard <storage>`` opens it.
* **Drive** (`plora.tuning.loop`). `run_tune` asks a batch of K trials from any sampler
  (`plora.tuning.samplers`, over the space of `plora.tuning.space`), trains them as packed
  jobs, tells the results, and repeats; an adapter the pruner stops leaves its pack
  (`plora.tuning.prune`). Asynchronously (`plora.tuning.asynchronous`), trials stream
  into long-lived jobs instead: each is told as its adapter finishes or is pruned, and the
  next one joins the slot it freed.

A pruner compares adapters at fixed fractions of their own training budget, whatever their
batch size (`plora.tuning.fidelity`); a tune can stop at a GPU-time budget and records the
best value found against the GPU time spent (`plora.tuning.budget`).

The package imports nothing on its own: the sweep records its study through
`plora.tuning.study`, which never imports the sweep back.
"""
