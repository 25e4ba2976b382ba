"""plora: packed LoRA hyperparameter sweeps."""

__version__ = "0.1.0"
