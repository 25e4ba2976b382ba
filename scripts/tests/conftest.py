"""Tests of the benchmarks and experiments in scripts/ (the library's own tests, in tests/,
import only the library). Run them with ``python -m pytest scripts/tests``."""

from __future__ import annotations

import os

# Triton decides at import how it builds kernels: without a GPU, on its interpreter.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a dependency
    pass
