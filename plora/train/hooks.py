"""Named points in a job where other code may look in: empty, and free, in production.

The recipe fires its events (``after_step``: after each optimizer step, before adapters
that finished leave the pack) with keyword arguments; every function registered for an
event is called in turn. Nothing is registered unless a test installs it: in-process with
`installed`, or in a job process the engine launches through the environment variable
``PLORA_TEST_HOOKS``, which names modules (``tests.fault_hooks``) or files
(``/path/fault_hooks.py``: absolute, since a job runs in its own folder), comma-separated,
that the job imports at start (`load_env_hooks`) and that register their hooks when
imported. That is how tests make a job run out of memory, crash or be killed at a given
step without a branch for it in the recipe.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from plora.settings import TEST_HOOKS, settings

__all__ = ["ENV", "fire", "installed", "load_env_hooks", "register", "unregister"]

#: modules or .py files a job imports at start to install hooks (tests only)
ENV = TEST_HOOKS

Hook = Callable[..., Any]
_hooks: dict[str, list[Hook]] = {}
_loaded: set[str] = set()


def register(event: str, fn: Hook) -> Hook:
    """Call ``fn(**kwargs)`` whenever ``event`` fires; returns ``fn``."""
    _hooks.setdefault(event, []).append(fn)
    return fn


def unregister(event: str, fn: Hook) -> None:
    fns = _hooks.get(event, [])
    if fn in fns:
        fns.remove(fn)


@contextmanager
def installed(event: str, fn: Hook) -> Iterator[Hook]:
    """``fn`` registered for ``event`` inside the block only."""
    register(event, fn)
    try:
        yield fn
    finally:
        unregister(event, fn)


def fire(event: str, **kwargs: Any) -> None:
    for fn in tuple(_hooks.get(event, ())):
        fn(**kwargs)


def load_env_hooks() -> None:
    """Import what ``PLORA_TEST_HOOKS`` names (once per name and process)."""
    for name in settings().test_hooks:
        if name in _loaded:
            continue
        _loaded.add(name)
        if name.endswith(".py"):
            path = Path(name)
            spec = importlib.util.spec_from_file_location(f"_plora_hooks_{path.stem}", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"{ENV}: cannot load {name}")
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        else:
            importlib.import_module(name)
