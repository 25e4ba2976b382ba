"""plora: packed LoRA hyperparameter sweeps."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

_SOURCE_KERNELS = Path(__file__).resolve().parent.parent / "kernels"


class _SourceTreeKernels(importlib.abc.MetaPathFinder):
    """``plora.kernels`` is the top-level ``kernels/`` folder of the repository, which an
    install maps into the package. Used from a source checkout through ``PYTHONPATH``
    (no install: e.g. on an offline GPU machine), nothing maps it; this finder, last on
    ``sys.meta_path``, does, so that jobs and scripts import the same kernels either way."""

    def find_spec(self, name, path=None, target=None):
        if name != "plora.kernels":
            return None
        return importlib.util.spec_from_file_location(
            name, _SOURCE_KERNELS / "__init__.py", submodule_search_locations=[str(_SOURCE_KERNELS)]
        )


if (_SOURCE_KERNELS / "__init__.py").is_file() and not (Path(__file__).parent / "kernels").exists():
    if not any(isinstance(f, _SourceTreeKernels) for f in sys.meta_path):
        sys.meta_path.append(_SourceTreeKernels())
