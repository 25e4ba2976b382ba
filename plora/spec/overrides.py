"""``key=value`` overrides of a space file, given on the command line.

``plora sweep space.yaml training.epochs=2 space.rank=[8,16]`` changes the loaded file
before it is validated, as torchtune's ``tune run ... key=value`` changes a recipe config:
a quick variation of a sweep needs no copy of its file. Each value is read as YAML (so
``[8,16]`` is a list, ``true`` a boolean, ``1e-3`` a number), exactly as it would be read in
the file, and the result is validated like the file: a bad value or an unknown key gets the
same one-line error naming the field.

No plora imports: `plora.spec.schema` applies these while it loads a file and turns an
`OverrideError` into its own one-line error.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

import yaml

__all__ = ["OverrideError", "apply_overrides", "parse_override"]

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class OverrideError(ValueError):
    """An override that cannot be applied; ``field`` is what the error names."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=value"`` as its key path and its value read as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise OverrideError("override", f"{text!r} is not key=value (e.g. training.epochs=2)")
    if not _KEY.fullmatch(key):
        raise OverrideError("override", f"{key!r} is not a field path (dotted names, e.g. space.rank)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise OverrideError(key, f"invalid YAML value {raw!r}: {problem}") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the loaded space ``data`` with each override set, in order (a later one
    wins). A section left empty in the file (YAML null) is filled in; a key under a value
    that is not a section is refused by name."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(path[: i + 1])
                raise OverrideError(".".join(path), f"{where} is a value, not a section, in the space file")
            node = child
        node[path[-1]] = value
    return out
