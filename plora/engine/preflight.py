"""Checks a command makes before anything runs: can the run directory be written, does it
hold this sweep (or nothing yet), and what hardware a sweep will really use.

A sweep that cannot write its results should say so in one line before it profiles,
plans or trains anything, not with a traceback from deep inside the engine minutes later.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from plora.job.config import NEUTRAL_EVAL, NEUTRAL_TRAINING

#: the space file's sections that say what an adapter's result is (the space itself says
#: which adapters there are); the others say how and where the sweep runs
RESULT_SECTIONS = ("model", "data", "lora", "training", "eval")


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


class RunDirError(ValueError):
    """The run directory holds a sweep of another space; the message is one line saying what
    differs."""


def check_resumable(run_dir: Path | str, spec: Any, adapter_ids: Iterable[str]) -> None:
    """Raise :class:`RunDirError` when ``run_dir`` holds a sweep that this one cannot resume:
    other configurations (``adapter_ids``: this sweep's), or other settings of what a result
    is (model, data, LoRA, training, eval; `RESULT_SECTIONS`).

    Resuming one space in a run directory of another would count, report and record the
    adapters of both as one sweep, and keep finished adapters whose settings are not this
    space's. The same configurations in another order, another plan or other hardware
    resume; a directory where nothing has run yet (no journal) is any sweep's.
    """
    import yaml

    run_dir = Path(run_dir)
    if not (run_dir / "journal.sqlite").is_file():
        return
    try:
        before = yaml.safe_load((run_dir / "spec.yaml").read_text())
        ran = set(_configured_ids(run_dir / "configs.parquet"))
    except (OSError, ValueError, KeyError, yaml.YAMLError):
        return  # nothing to compare with: a run directory of another plora version resumes as before
    if not isinstance(before, dict):
        return
    now = yaml.safe_load(spec.to_yaml())
    for section in RESULT_SECTIONS:
        skip = {"training": NEUTRAL_TRAINING, "eval": NEUTRAL_EVAL}.get(section, ())
        diff = _first_difference(before.get(section), now.get(section), section, skip)
        if diff is not None:
            raise RunDirError(f"{run_dir} holds a sweep of another space ({diff})")
    ids = set(adapter_ids)
    if ids != ran:
        diff = (_first_difference(before.get("space"), now.get("space"), "space", ())
                or f"space: {len(ran)} configurations there, {len(ids)} here, {len(ran & ids)} in both")
        raise RunDirError(f"{run_dir} holds a sweep of another space ({diff})")


def _configured_ids(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return [str(i) for i in pq.read_table(path, columns=["id"]).column("id").to_pylist()]


def _first_difference(before: Any, now: Any, where: str, skip: Iterable[str]) -> str | None:
    """The first setting under ``where`` that differs, as "where.key: X there, Y here"."""
    if isinstance(before, Mapping) and isinstance(now, Mapping):
        for key in [*now, *(k for k in before if k not in now)]:
            if key in skip:
                continue
            diff = _first_difference(before.get(key), now.get(key), f"{where}.{key}", ())
            if diff is not None:
                return diff
        return None
    if before == now:
        return None
    return f"{where}: {_shown(before)} there, {_shown(now)} here"


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) or value is None else str(value)


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
