"""plora: packed LoRA hyperparameter sweeps.

``plora.kernels`` is the repository's top-level ``kernels/`` folder, reached through the
``plora/kernels`` link: one mapping for an install, an editable install and a source tree on
``PYTHONPATH`` alike.
"""

from __future__ import annotations

__version__ = "0.1.0"
