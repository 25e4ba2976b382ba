"""What every part of the space file's schema shares: the one-line error a user sees
(`SpecError`, raised inside validators as `_Issue` with the field's path), and the strict
pydantic base of every section (`_Model`), whose input paths are read from the space
file's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo


# --------------------------------------------------------------------------- errors


class SpecError(ValueError):
    """A space file is wrong. ``str()`` is one line: ``<dotted.field.path>: <what is wrong>``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = " ".join(str(message).split())
        super().__init__(f"{field}: {self.message}" if field else self.message)


class _Issue(ValueError):
    """Raised inside validators; ``path`` extends the field location pydantic knows.

    Pydantic reports a validator's error at the field (or model) it validates. A range's
    ``low`` or a list entry is deeper than that, so the extra steps travel with the error.
    """

    def __init__(self, message: str, *path: str | int) -> None:
        super().__init__(message)
        self.message = message
        self.path = path


def _fmt(value: Any) -> str:
    """Show a value as the user wrote it: ``-1`` rather than ``-1.0``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


# --------------------------------------------------------------------------- schema helpers


class _Model(BaseModel):
    # Unknown keys are errors (a typo must not silently fall back to a default), NaN/inf
    # are never valid, and defaults go through the same validators as given values.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_default=True)


def _base_dir(info: ValidationInfo) -> Path:
    ctx = info.context or {}
    return Path(ctx.get("base_dir") or Path.cwd())


def _resolve(path: Path | str, info: ValidationInfo) -> Path:
    """An input path: a relative one is read from the space file's folder (wherever plora
    runs from), so that a space file and the data beside it travel together."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = _base_dir(info) / p
    return Path(p).resolve()


def _where_relative(path: Path | str, info: ValidationInfo) -> str:
    """What to add to "not found" for a relative path: where it was looked for, and why."""
    if Path(path).expanduser().is_absolute():
        return ""
    return f" (a relative path is read from the space file's folder, {_base_dir(info)})"
