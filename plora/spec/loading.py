"""Reading a space file: YAML (duplicate keys refused), ``key=value`` overrides, the
validation errors of pydantic turned into one-line `SpecError`s."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, get_args

import yaml
from pydantic import BaseModel, ValidationError

from plora.spec.base import _dotted, _fmt, _Issue, SpecError
from plora.spec.model import ModelConfig
from plora.spec.space import _TAG_MODELS
from plora.spec.schema import SweepSpec


# --------------------------------------------------------------------------- loading


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The model class that holds the last key of ``loc`` (to list its allowed fields)."""
    cls: Optional[type[BaseModel]] = SweepSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if part in _TAG_MODELS:
            cls = _TAG_MODELS[part]
            continue
        if cls is None or part not in cls.model_fields:
            return None
        cls = _find_model(cls.model_fields[part].annotation)
    return cls


def _find_model(tp: Any) -> Optional[type[BaseModel]]:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in get_args(tp):
        found = _find_model(arg)
        if found is not None:
            return found
    return None


def _from_validation_error(err: ValidationError) -> SpecError:
    errors = err.errors()
    # A typo'd key explains the errors that follow from it: report it first.
    e = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    raw_loc = tuple(e["loc"])
    loc = tuple(p for p in raw_loc if not (isinstance(p, str) and p.startswith("<")))
    exc = (e.get("ctx") or {}).get("error")
    if e["type"] == "value_error" and isinstance(exc, _Issue):
        return SpecError(_dotted(loc + exc.path), exc.message)
    if e["type"] == "missing":
        return SpecError(_dotted(loc), "required")
    if e["type"] == "extra_forbidden":
        cls = _model_at(raw_loc)
        allowed = list(cls.model_fields) if cls is not None else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        if close:
            msg = f"unknown field (did you mean {close[0]!r}?)"
        elif allowed:
            msg = f"unknown field; expected one of: {', '.join(allowed)}"
        else:
            msg = "unknown field"
        return SpecError(_dotted(loc), msg)
    msg = e["msg"].removeprefix("Value error, ")
    msg = re.sub(r" or instance of \w+", "", msg)
    msg = msg[:1].lower() + msg[1:]
    inp = e.get("input")
    if not isinstance(inp, (dict, BaseModel)) and len(repr(inp)) <= 80:
        msg += f", got {_fmt(inp)}"
    return SpecError(_dotted(loc) or "spec", msg)


def parse_spec(data: dict, base_dir: Path | None = None, *, sampled: bool = False) -> SweepSpec:
    """Validate a space given as a dict; relative paths are resolved against ``base_dir``
    (the current directory when None). Raises :class:`SpecError`. ``sampled``: the space is
    searched by an Optuna sampler (``plora tune``), which draws from ranges whatever the
    strategy, so a grid's ranges need no ``num``."""
    if not isinstance(data, dict):
        raise SpecError("spec", f"top level must be a mapping, got {type(data).__name__}")
    base = Path(base_dir).expanduser().resolve() if base_dir is not None else Path.cwd()
    try:
        return SweepSpec.model_validate(data, context={"base_dir": base, "sampled": sampled})
    except ValidationError as err:
        raise _from_validation_error(err) from None


def parse_model_section(data: Any, base_dir: Path | None = None) -> ModelConfig:
    """A space's ``model`` section alone, validated as in the whole file (errors named
    ``model.<field>``): what reads a run's base model back (`plora.results.export`) needs it
    without the rest of the spec, whose data files may have moved since the run."""
    base = Path(base_dir).expanduser().resolve() if base_dir is not None else Path.cwd()
    try:
        return ModelConfig.model_validate({} if data is None else data, context={"base_dir": base})
    except ValidationError as err:
        e = _from_validation_error(err)
        raise SpecError(f"model.{e.field}" if e.field != "spec" else "model", e.message) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys; in a space file that is always a mistake."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_spec(path: str | Path, *, sampled: bool = False, overrides: Sequence[str] = ()) -> SweepSpec:
    """Read and validate a space file. Raises :class:`SpecError` (missing file, bad YAML,
    bad field), with relative paths resolved against the file's folder; ``sampled`` as in
    :func:`parse_spec`. ``overrides`` (``key=value``, `plora.spec.overrides`) change the file's
    values before validation, so they are checked as if written in it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpecError(str(path), "file not found" if not path.exists() else "not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(str(path), f"cannot read: {e}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecError(str(path), f"invalid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise SpecError(str(path), f"top level must be a mapping, got {got}")
    if overrides:
        from plora.spec.overrides import OverrideError, apply_overrides

        try:
            data = apply_overrides(data, overrides)
        except OverrideError as e:
            raise SpecError(e.field, e.message) from None
    return parse_spec(data, base_dir=path.resolve().parent, sampled=sampled)
