"""The modules a sweep imports, compiled to bytecode ahead and in parallel on a machine's first
sweep, where the packages carry none (`plora.bytecode_cache`).

On such a machine a first sweep's processes (the sweep itself, the first job's process started
ahead, the kernel warmer) each compile what they import from source, one module after another,
and their imports are the start of the sweep's critical path. On an H200 machine whose image
ships torch without bytecode (`scripts/time_first_imports.py`: the sweep's imports and a job
process's, in fresh processes started together), the job process was ready after 3.7-4.9 s
compiling against 1.6-1.7 s reading its bytecode back, and the sweep's imports took 10.0 s
against 4.9-5.5 s. With the same modules compiled meanwhile by six processes: 1.7-2.1 s and 5.0 s. In
first sweeps of SmolLM2 there (this code, and the code before it), the first job's process was
ready at 3.7 s instead of 6.9 s, and the sweep's data was checked at 4.6 s instead of 8.0 s.

Which modules: those a sweep's processes imported on a GPU machine and a CPU one, in the order
they first imported them (``assets/bytecode_modules.txt``, written by
``scripts/record_bytecode_modules.py``), each a path relative to the import path entry holding
it. A name this machine does not have is skipped; a module not on the list is compiled by its
importer as before. The pool is started by the `plora` command as its first act, once per list
and Python: a mark in the bytecode folder says it has been done, so a warm sweep starts nothing.
Each worker runs at a lower priority than the sweep's processes, which it only ever spares work.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["LIST", "compile_share", "lead", "listed_sources", "pool_size", "set_up", "start"]

#: the modules a sweep imports, one path per line relative to its import path entry
LIST = Path(__file__).resolve().parent / "assets" / "bytecode_modules.txt"
#: the most worker processes: six compiled a first sweep's imports in about 1.3 s on 16 cores
MOST_WORKERS = 6
#: how much lower the workers' priority is than the sweep's
NICENESS = 10


def pool_size(cpus: int | None = None) -> int:
    """Workers for a machine of ``cpus`` usable cores: about half of them, leaving the sweep's own
    processes (itself, a job process, a kernel warmer) theirs; none below four cores, where a
    worker could only take time from them."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(MOST_WORKERS, cpus // 2 - 1))


def _mark(where: Path, listed: Path) -> Path:
    """The file saying this list was compiled into ``where`` by this Python, with these
    packages: an install or removal in a package folder changes its time, and the pool then
    runs again (compiling only what changed)."""
    try:
        text = listed.read_bytes()
    except OSError:
        text = b""
    digest = hashlib.sha256(text + sys.version.encode() + sys.executable.encode())
    for entry in sys.path:
        if entry.rstrip(os.sep).endswith(("site-packages", "dist-packages")):
            try:
                digest.update(f"{entry}:{os.stat(entry).st_mtime_ns}".encode())
            except OSError:
                pass
    return where / f"ahead-{digest.hexdigest()[:16]}.done"


def set_up() -> None:
    """What a plora program (`plora.command`, ``python -m plora.cli``) does before its imports:
    its bytecode kept (`plora.bytecode_cache.use_here`), and a first sweep's modules compiled
    meanwhile (`start`)."""
    from plora.bytecode_cache import use_here

    start(use_here())


def start(where: Path | None, listed: Path = LIST, workers: int | None = None) -> subprocess.Popen | None:
    """Start compiling ``listed``'s modules into the bytecode folder ``where`` (the one
    `plora.bytecode_cache.use_here` answered: None, nothing to do), unless that was done
    already or ``PLORA_BYTECODE_AHEAD=0``; the pool's leading process, or None where nothing
    started. Never waited for, and never raises: without it each import compiles its own."""
    try:
        from plora.settings import settings

        if where is None or not settings().bytecode_ahead or not listed.is_file() or _mark(where, listed).exists():
            return None
        n = pool_size() if workers is None else workers
        if n < 1:
            return None
        code = f"from plora.bytecode_ahead import lead; lead({str(where)!r}, {str(listed)!r}, {n})"
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
    except Exception:  # noqa: BLE001 - an unreadable list or cache, no process to spare: as before
        return None


def lead(where: str, listed: str, workers: int) -> None:
    """The pool: ``workers - 1`` processes and this one each compile their share; the mark is
    written once all have finished well. Its priority is lowered once, here: the others
    inherit it."""
    _lower_priority()
    code = ("from plora.bytecode_ahead import compile_share; "
            "raise SystemExit(0 if compile_share({!r}, {!r}, {}, {}) else 1)")
    others = [subprocess.Popen([sys.executable, "-c", code.format(where, listed, i, workers)],
                               stdin=subprocess.DEVNULL, close_fds=True) for i in range(1, workers)]
    ok = compile_share(where, listed, 0, workers)
    ok = all(p.wait() == 0 for p in others) and ok
    if ok:
        try:
            _mark(Path(where), Path(listed)).touch()
        except OSError:
            pass


def listed_sources(listed: Path, path: list[str] | None = None, share: int = 0, workers: int = 1) -> list[str]:
    """The sources of ``listed``'s modules on this machine, in its order: each relative path
    under the first import path entry where it exists, as an import would find it. With
    ``workers``, only every ``workers``-th line from the ``share``-th (a worker's part)."""
    entries = [os.path.abspath(p) for p in (sys.path if path is None else path) if p]
    out = []
    try:
        lines = listed.read_text().splitlines()
    except OSError:
        return out
    for rel in lines[share::workers]:
        if not rel or rel.startswith("#") or os.path.isabs(rel) or ".." in rel.split("/"):
            continue
        for entry in entries:
            source = os.path.join(entry, rel)
            if os.path.isfile(source):
                out.append(source)
                break
    return out


def compile_share(where: str, listed: str, share: int, workers: int) -> bool:
    """Every ``workers``-th of ``listed``'s modules from the ``share``-th, compiled to where this
    process's imports would read it (its fresh ``__pycache__`` file, else ``where``) unless a
    file is there; whether every one that could be compiled was."""
    from importlib import _bootstrap_external

    from plora.bytecode_cache import use_here

    if use_here() != Path(where):  # (its environment is the sweep's: the same folder)
        return False
    import py_compile

    for source in listed_sources(Path(listed), share=share, workers=workers):
        target = _bootstrap_external.cache_from_source(source)
        if os.path.exists(target):
            continue
        try:
            py_compile.compile(source, cfile=target, doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
        except (py_compile.PyCompileError, OSError, ValueError, SyntaxError):
            continue  # its importer says what is wrong with it, as before
    return True


def _lower_priority() -> None:
    try:
        os.nice(NICENESS)
    except (AttributeError, OSError):
        pass
