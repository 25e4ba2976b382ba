"""Python's compiled bytecode kept in plora's cache where the environment forbids writing it
beside the sources.

Container images commonly set ``PYTHONDONTWRITEBYTECODE=1``, and some ship their packages
without ``__pycache__``: every Python process then compiles those packages from source at each
import. A sweep starts several processes (itself, the job process started ahead of its first
job, the kernel warmer, a GGUF file's converter, every job started the ordinary way), and each
paid it. On an H200 image set up so (torch and Triton without bytecode), ``import torch`` took
3.9-5.4 s in a fresh process and 1.7-2.0 s with its bytecode kept; a job process's imports
after torch, 1.0 s against 0.5 s.

So in a plora process where ``PYTHONDONTWRITEBYTECODE`` is set (and ``PYTHONPYCACHEPREFIX`` is
not), a module's bytecode is read from its ``__pycache__`` where a fresh one is there, as
Python does, and otherwise read from, and written to, plora's cache (its ``bytecode`` folder, a
mirror of the source tree laid out as ``PYTHONPYCACHEPREFIX`` would). Nothing is ever written
beside a source, which is what the setting is for. (Python's own ``PYTHONPYCACHEPREFIX`` would
not do: it ignores every ``__pycache__``, so an image whose packages were compiled at install
would compile them all again, 15 s of imports where they took 6 s.)

A ``__pycache__`` file counts as fresh where Python itself would take it: its header names this
Python and the source's size and modification time (or it is a hash-based file Python does not
check). Any other is left where it is, untouched, and the module's bytecode goes to the cache.

A plora process asks for it first thing (`use_here`): the command as a program (not a test
importing it: pytest's own bytecode follows ``sys.dont_write_bytecode``), and the processes it
starts (`PREAMBLE`). ``PLORA_BYTECODE_CACHE=0`` leaves Python's behaviour as it is, and so does
a prefix of the user's own (``PYTHONPYCACHEPREFIX`` or ``-X pycache_prefix``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from importlib.util import MAGIC_NUMBER
from pathlib import Path

from plora.settings import settings

__all__ = ["DONT_WRITE", "PREAMBLE", "PREFIX", "bytecode_dir", "use_here"]

DONT_WRITE = "PYTHONDONTWRITEBYTECODE"
PREFIX = "PYTHONPYCACHEPREFIX"
#: the first statements of a plora child process started with ``python -c``
PREAMBLE = "from plora.bytecode_cache import use_here; use_here(); "

_INSTALLED: list[Path] = []  # this process's folder, once installed
_LOCK = threading.Lock()


def bytecode_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where a plora process of environment ``environ`` (this one's by default) keeps the
    bytecode Python may not write beside its sources; None where Python writes it, or may not
    write it at all, as it would anyway."""
    env = os.environ if environ is None else environ
    if not env.get(DONT_WRITE) or env.get(PREFIX) or (environ is None and sys.pycache_prefix):
        return None
    s = settings(env)
    if not s.bytecode_cache:
        return None
    return Path(os.path.abspath(s.cache_dir / "bytecode"))  # a relative cache follows no later chdir


def use_here() -> Path | None:
    """From now on this process reads a module's bytecode from its ``__pycache__`` where a fresh
    one is there, else from plora's cache, where it also writes what it compiles; the folder,
    or None where nothing changed (`bytecode_dir`). Call it before the heavy imports: modules
    already imported stay as they are."""
    with _LOCK:
        if _INSTALLED:
            return _INSTALLED[0]
        where = bytecode_dir()
        if where is None:
            return None
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError:  # no cache to write to: Python goes on compiling, as before
            return None
        from importlib import _bootstrap_external  # the import system's own module: its loaders look names up there

        _bootstrap_external.cache_from_source = _beside_else_in(str(where), _bootstrap_external.cache_from_source)
        sys.dont_write_bytecode = False  # written only where `_beside_else_in` says: in the cache
        _INSTALLED.append(where)
        return where


def _beside_else_in(prefix: str, beside_of: Callable[..., str]) -> Callable[..., str]:
    """Python's ``cache_from_source`` that answers the ``__pycache__`` file where Python would
    take it as it is (`_fresh`), else the file's place under ``prefix``: the source's absolute
    folder below ``prefix``, as Python's own prefix lays it out."""

    def cache_from_source(path: str, debug_override: bool | None = None, *, optimization=None) -> str:
        beside = beside_of(path, debug_override, optimization=optimization)
        if _fresh(beside, path):
            return beside
        source_dir = os.path.dirname(os.path.abspath(path))
        return os.path.join(prefix, source_dir.lstrip(os.sep), os.path.basename(beside))

    return cache_from_source


def _fresh(pyc: str, source: str) -> bool:
    """Whether Python takes ``pyc`` for ``source`` without compiling again: this Python's magic
    number, and the source's modification time and size in its header, or a hash-based file
    whose source Python does not check. (A checked hash-based file is not read here: where
    it no longer matches, Python would write its new bytecode beside the source.)"""
    try:
        with open(pyc, "rb") as f:
            head = f.read(16)
        st = os.stat(source)
    except OSError:
        return False
    if len(head) < 16 or head[:4] != MAGIC_NUMBER:
        return False
    flags = int.from_bytes(head[4:8], "little")
    if flags & 0b1:  # hash-based
        return not flags & 0b10
    return (int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF)
