"""A job process's imports without the torchtune package `__init__`s it never uses.

``import torchtune`` runs ``torchtune/__init__.py``, which imports every dataset builder
(Hugging Face ``datasets``, pandas, pyarrow), the generation utilities and every model
family's package, and each family's ``__init__`` imports its tokenizers and, through
``torchtune.data``, more of the same. A job uses none of it: plora tokenizes and batches its
own rows (`plora.data`), and builds models from the families' component builders and
`torchtune.modules` (`plora.models.families`). Measured in a fresh interpreter on an H100
machine, a job's imports took 21 s, 1.7 s of it ``datasets`` alone.

`skip_package_inits` registers those packages as bare packages (their folder on the module
path, their ``__init__`` not run) before anything imports them; any submodule still imports
as usual, with its own imports. torchtune 0.6.1 is its last release, so what its
``__init__``s hold cannot change under us; torchao is still imported where torchtune's
modules need it (``torchtune.modules`` for NF4). Only processes plora starts ahead of their
job (`plora.train.spare`) use it; ``PLORA_LEAN_IMPORTS=0`` turns it off (`plora.settings`).
"""

from __future__ import annotations

import importlib.util
import sys

from plora.settings import settings

__all__ = ["JOB_MODULES", "LEAN_PACKAGES", "import_job_modules", "skip_package_inits"]

#: the packages whose ``__init__`` a job does not need (parents before children); the model
#: families are those `plora.models.families` builds from
LEAN_PACKAGES = (
    "torchtune",
    "torchtune.models",
    "torchtune.models.llama3",
    "torchtune.models.llama3_1",
    "torchtune.models.mistral",
    "torchtune.models.qwen2",
    "torchtune.models.gemma",
    "torchtune.models.gemma2",
)
#: what a job imports of torchtune, whatever its model's family: imported by a process started
#: ahead before it says ready, so that its job finds them loaded (with the ``__init__``s run,
#: `torchtune.modules` came in with ``import torchtune``)
JOB_MODULES = (
    "torchtune.config",
    "torchtune.config._errors",
    "torchtune.modules",
    "torchtune.training",
    "torchtune.models.llama3._component_builders",
    "torchtune.models.llama3_1._position_embeddings",
    "torchtune.models.mistral._component_builders",
    "torchtune.models.qwen2._component_builders",
    "torchtune.models.qwen2._positional_embeddings",
    "torchtune.models.gemma._component_builders",
    "torchtune.models.gemma.gemma_norm_embedding",
    "torchtune.models.gemma.rms_norm",
    "torchtune.models.gemma2._attention",
)


def skip_package_inits() -> bool:
    """Register `LEAN_PACKAGES` without running their ``__init__``. Whether it did: not
    where it is switched off, where torchtune is already imported, or where a package is
    missing (then nothing is registered and imports run as usual)."""
    if not settings().lean_imports:
        return False
    if any(name in sys.modules for name in LEAN_PACKAGES):
        return False
    added: list[str] = []
    try:
        for name in LEAN_PACKAGES:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.submodule_search_locations is None:
                raise ImportError(name)
            module = importlib.util.module_from_spec(spec)  # not executed: its __init__ never runs
            sys.modules[name] = module
            added.append(name)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, module)
    except (ImportError, ValueError):
        for name in added:
            sys.modules.pop(name, None)
        return False
    return True


def import_job_modules() -> None:
    """Import `JOB_MODULES` now (a spare, before it says ready)."""
    for name in JOB_MODULES:
        importlib.import_module(name)
