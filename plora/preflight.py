"""Checks a command makes before anything runs: can the run directory be written, and what
hardware a sweep will really use.

A sweep that cannot write its results should say so in one line before it profiles,
plans or trains anything, not with a traceback from deep inside the engine minutes later.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import Any


class OutputDirError(ValueError):
    """The run directory cannot be written; the message is one line naming it."""


def _deepest_existing(path: Path) -> tuple[Path, list[Path]]:
    """The deepest part of ``path`` that exists, and the folders below it still to create
    (outermost first)."""
    missing: list[Path] = []
    probe = path
    while True:
        try:
            if probe.exists() or probe == probe.parent:
                return probe, missing[::-1]
        except OSError:  # e.g. a folder on the way that cannot be searched
            pass
        missing.append(probe)
        probe = probe.parent


def check_output_dir(path: Path | str) -> None:
    """Raise :class:`OutputDirError` unless files can be created in ``path``.

    Folders that do not exist yet are created to find out, then removed again, so the
    check leaves nothing behind (a dry run still writes nothing).
    """
    path = Path(path).expanduser().absolute()
    base, missing = _deepest_existing(path)
    if not base.is_dir():
        raise OutputDirError(f"run directory {path} cannot be written: {base} is a file, not a folder")
    created: list[Path] = []
    try:
        for folder in missing:
            try:
                folder.mkdir()
            except FileExistsError:
                continue
            except OSError as e:
                raise OutputDirError(f"run directory {path} cannot be written: cannot create {folder} "
                                     f"({_reason(e)})") from None
            created.append(folder)
        try:
            fd, probe = tempfile.mkstemp(dir=path, prefix=".plora-write-check-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise OutputDirError(f"run directory {path} cannot be written ({_reason(e)})") from None
    finally:
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _reason(e: OSError) -> str:
    if e.errno == errno.EROFS:
        return "read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return (e.strerror or type(e).__name__).lower()


def hardware_note(spec: Any, hardware: Any) -> str | None:
    """One line when the space file asks for GPUs this sweep will not use (``device: cpu``,
    or ``auto`` on a machine without CUDA), saying what it uses instead; None otherwise."""
    hw = spec.hardware
    if hardware is None or hardware.gpu or not hardware.local or "gpus" not in hw.model_fields_set:
        return None
    why = "device is cpu" if hw.device == "cpu" else f"no CUDA device on this machine (device: {hw.device})"
    return f"hardware.gpus: {hw.gpus} is not used: {why}; running on {hardware.describe()}"
