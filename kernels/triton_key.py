"""Triton's own version key, remembered across processes.

Every Triton cache key starts with ``triton.runtime.cache.triton_key()``: a SHA-256 over
Triton's compiler, backend and language sources and its ``libtriton`` library (about 400 MB),
computed once per process. On an H200 it took 0.38 s of each process that loads a kernel: the
job process started ahead of a sweep's first job, the kernel warmer, a job started the
ordinary way. Triton's own warm-up pool hands the value to its workers the same way
(``triton._compile_warmup_pool`` sets ``triton.runtime.cache.triton_key``).

Here it is kept in plora's cache under a fingerprint of the sizes and modification times of
the files it hashes, as Python checks its bytecode against its sources: a changed, added or
removed file gives a new fingerprint, and the key is computed afresh.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

__all__ = ["fingerprint", "remember_triton_key"]

#: the folders of the Triton package whose files the key hashes
HASHED_FOLDERS = ("compiler", "backends", "language")

_REMEMBERED: list[str] = []  # this process's key, once remembered
_LOCK = threading.Lock()  # a job's threads compile ahead side by side


def fingerprint(triton_root: Path, version: str) -> str:
    """A digest of what the key depends on: Triton's version, and the path, size and
    modification time of every file it hashes under ``triton_root``."""
    digest = hashlib.sha256(version.encode())
    ext = (sysconfig.get_config_var("EXT_SUFFIX") or ".so").split(".")[-1]
    files = [triton_root / "runtime" / "cache.py", triton_root / "_C" / f"libtriton.{ext}"]
    for folder in HASHED_FOLDERS:
        for here, dirs, names in os.walk(triton_root / folder, followlinks=True):  # as pkgutil walks them
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files.extend(Path(here) / n for n in sorted(names) if n.endswith(".py"))
    for path in files:
        try:
            st = path.stat()
            digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            digest.update(f"{path}\0missing\n".encode())
    return digest.hexdigest()


def remember_triton_key(cache_dir: Path) -> str | None:
    """Make this process's ``triton_key()`` the one kept under ``cache_dir`` for this Triton,
    computing and keeping it first where there is none (or none well formed); the key, or None
    where Triton has no such function (another release: it computes its own, as before)."""
    with _LOCK:
        if _REMEMBERED:
            return _REMEMBERED[0]
        try:
            import triton
            from triton.runtime import cache as triton_cache
        except ImportError:
            return None
        compute = getattr(triton_cache, "triton_key", None)
        if compute is None:
            return None
        kept = Path(cache_dir) / "triton-key" / fingerprint(Path(triton.__file__).parent, triton.__version__)
        try:
            key = kept.read_text()
        except OSError:
            key = ""
        if not well_formed(key, triton.__version__):
            key = compute()
            _keep(kept, key)

        def triton_key() -> str:
            return key

        for name, module in list(sys.modules.items()):  # and where a module imported the name itself
            if name.startswith("triton.") and getattr(module, "triton_key", None) is compute:
                module.triton_key = triton_key
        _REMEMBERED.append(key)
        return key


def well_formed(key: str, version: str) -> bool:
    """Whether ``key`` reads as Triton's: its version, then SHA-256 digests joined by ``-``."""
    return key.startswith(version) and bool(re.fullmatch(r"[0-9a-f]{64}(-[0-9a-f]{64})*", key[len(version):]))


def _keep(kept: Path, key: str) -> None:
    """Write ``key`` to ``kept`` whole or not at all (a file of its own first, then renamed)."""
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=kept.parent, prefix=f".{kept.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(key)
            os.replace(part, kept)
        except OSError:
            Path(part).unlink(missing_ok=True)
    except OSError:  # no cache to keep it in: the next process computes it again
        pass
