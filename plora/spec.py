"""The space file: its schema, its validation, and its expansion into adapter configs.

A sweep is described by one YAML file (see ``sweeps/example-full.yaml``). Everything
downstream (profiler, planner, engine, report) reads the validated :class:`SweepSpec`, so
every mistake a user can make in that file is caught here, before any GPU time is spent,
and reported as a one-line :class:`SpecError` that names the offending field.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "ALL_LINEAR",
    "SCHEDULERS",
    "TRAINING_DIMS",
    "KNOWN_TARGETS",
    "AdapterConfig",
    "SpecError",
    "SweepSpec",
    "available_models",
    "load_spec",
    "parse_model_section",
    "parse_spec",
    "lora_scale",
    "resolve_targets",
    "target_key",
    "target_names",
]

#: Folder of the models shipped with plora (``model.path: builtin:<name>``).
#: A module attribute so that tests can point it elsewhere.
ASSETS_DIR: Path = Path(__file__).parent / "assets"

#: Linear layers of a llama-style decoder that LoRA can adapt (Hugging Face names).
KNOWN_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"
DATA_SUFFIXES: tuple[str, ...] = (".json", ".jsonl", ".csv", ".parquet")
HYPERPARAMETERS: tuple[str, ...] = ("rank", "alpha", "learning_rate", "batch_size")
#: What else a space may vary per adapter. Each has a sweep-wide value (``lora`` or
#: ``training``); an `AdapterConfig` holds one only where it differs from that value (None:
#: the sweep's), so a configuration's id stays what it was before the dimension existed.
TRAINING_DIMS: tuple[str, ...] = ("dropout", "weight_decay", "warmup_ratio", "scheduler", "rslora", "targets", "epochs")
SCHEDULERS: tuple[str, ...] = ("constant", "linear", "cosine")
#: A sweep larger than this is almost certainly a typo (a grid with one axis too many).
MAX_ADAPTERS = 100_000
#: Continuous values drawn at random are rounded to this many significant digits, so that
#: tables and ids stay readable; it changes nothing that matters for a sweep.
RANDOM_SIGNIFICANT_DIGITS = 4


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


# --------------------------------------------------------------------------- adapter config


def _norm_float(x: float, digits: int = 12) -> float:
    """Round to ``digits`` significant digits: 10**-3 computed by geomspace becomes 0.001,
    so that ids do not depend on float noise."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


def target_key(targets: str | Sequence[str]) -> str:
    """One target set as one string, the same for the same set: ``all-linear``, or the layer
    names sorted and joined by commas (``q_proj,v_proj``). Ids, tables and Optuna's
    categorical choices hold it; `target_names` reads it back."""
    if isinstance(targets, str):
        targets = [t for t in targets.split(",")]
    names = [str(t).strip() for t in targets if str(t).strip()]
    if ALL_LINEAR in names:
        return ALL_LINEAR
    return ",".join(sorted(dict.fromkeys(names)))


def target_names(key: str) -> list[str]:
    """The layer names (or ``all-linear``) of a `target_key`."""
    return key.split(",")


def _is_missing(v: Any) -> bool:
    """None, or NaN (what a table holds where a column has no value)."""
    return v is None or (isinstance(v, float) and math.isnan(v))


def _norm_dim(name: str, value: Any) -> Any:
    """A per-adapter dimension's value in the form ids and tables hold."""
    if _is_missing(value):
        return None
    if name == "targets":
        return target_key(value)
    if name == "scheduler":
        return str(value)
    if name == "rslora":
        return bool(value)
    return _norm_float(value)


@dataclass(frozen=True)
class AdapterConfig:
    """One trial of the sweep. Frozen and hashable; ``id`` is stable across runs.

    The `TRAINING_DIMS` (dropout, weight decay, warm-up ratio, scheduler, rsLoRA, target
    set, epochs) are None where the adapter takes the sweep's value: build configs of a
    space with `SweepSpec.make_config`, which leaves a value equal to the sweep's out, and
    read an adapter's effective values with `SweepSpec.settings`."""

    id: str
    rank: int
    alpha: float
    learning_rate: float
    batch_size: int
    seed: int
    dropout: Optional[float] = None
    weight_decay: Optional[float] = None
    warmup_ratio: Optional[float] = None
    scheduler: Optional[str] = None
    rslora: Optional[bool] = None
    targets: Optional[str] = None  # a `target_key`
    epochs: Optional[float] = None

    @property
    def scale(self) -> float:
        """The LoRA output scale: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA
        (where the adapter's own ``rslora`` says so; `SweepSpec.settings` has the sweep's)."""
        return lora_scale(self.alpha, self.rank, bool(self.rslora))

    def dims(self) -> dict[str, Any]:
        """The per-adapter dimensions this config sets (the others are the sweep's)."""
        return {n: getattr(self, n) for n in TRAINING_DIMS if getattr(self, n) is not None}

    def to_dict(self) -> dict:
        """The id and hyperparameters, with the dimensions this config sets (no None)."""
        return {k: v for k, v in asdict(self).items() if not (k in TRAINING_DIMS and v is None)}

    @staticmethod
    def make_id(rank: int, alpha: float, learning_rate: float, batch_size: int, seed: int, **dims: Any) -> str:
        """``a-`` + sha1 of the canonical JSON of the hyperparameters (first 10 hex digits).
        A dimension of `TRAINING_DIMS` enters the hash only where it is set (not None), so a
        configuration that sets none has the id it had before those dimensions existed."""
        payload = {
            "alpha": float(alpha),
            "batch_size": int(batch_size),
            "learning_rate": float(learning_rate),
            "rank": int(rank),
            "seed": int(seed),
        }
        for name in TRAINING_DIMS:
            value = _norm_dim(name, dims.get(name))
            if value is not None:
                payload[name] = value
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return "a-" + hashlib.sha1(text.encode()).hexdigest()[:10]

    @classmethod
    def make(cls, rank: int, alpha: float, learning_rate: float, batch_size: int, seed: int,
             **dims: Any) -> "AdapterConfig":
        """Build a config with normalised values and its id (the way to make one). ``dims``:
        values of `TRAINING_DIMS` the adapter sets itself (None: the sweep's)."""
        unknown = set(dims) - set(TRAINING_DIMS)
        if unknown:
            raise TypeError(f"unknown adapter dimension(s): {', '.join(sorted(unknown))}")
        rank, batch_size, seed = int(rank), int(batch_size), int(seed)
        alpha, learning_rate = _norm_float(alpha), _norm_float(learning_rate)
        values = {n: _norm_dim(n, dims.get(n)) for n in TRAINING_DIMS}
        cid = cls.make_id(rank, alpha, learning_rate, batch_size, seed, **values)
        return cls(cid, rank, alpha, learning_rate, batch_size, seed, **values)

    @classmethod
    def from_dict(cls, d: dict) -> "AdapterConfig":
        """Inverse of :meth:`to_dict` (a missing or NaN dimension is the sweep's); an ``id``
        that does not match the values is an error."""
        cfg = cls.make(d["rank"], d["alpha"], d["learning_rate"], d["batch_size"], d["seed"],
                       **{n: d.get(n) for n in TRAINING_DIMS})
        if "id" in d and d["id"] != cfg.id:
            raise ValueError(f"adapter id {d['id']!r} does not match its hyperparameters (expected {cfg.id!r})")
        return cfg


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """LoRA's output scale: ``alpha / rank``, or rsLoRA's ``alpha / sqrt(rank)`` (PEFT's
    ``use_rslora``)."""
    return float(alpha) / (math.sqrt(rank) if rslora else rank)


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


def _gguf_builtins() -> tuple[str, ...]:
    from plora.gguf import BUILTIN_GGUF

    return tuple(BUILTIN_GGUF)


def available_models() -> list[str]:
    """Names usable as ``model.path: builtin:<name>``."""
    if not ASSETS_DIR.is_dir():
        return []
    return sorted(p.name for p in ASSETS_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def _check_targets(targets: str | list[str], family: str | None = None) -> list[str]:
    """The layer names `targets` stands for. Without a family, any layer some family has is
    accepted and ``all-linear`` is the llama-style set; with one, ``all-linear`` is that
    family's set and a layer it lacks is refused by name."""
    from plora.families.targets import ALL_TARGET_NAMES, family_targets

    if isinstance(targets, str):
        targets = [targets]
    if not targets:
        raise _Issue("must name at least one layer")
    if family is not None:
        try:
            known = family_targets(family)
        except KeyError as e:
            raise _Issue(str(e.args[0])) from None
    else:
        known = ALL_TARGET_NAMES
    out: list[str] = []
    for t in targets:
        if t == ALL_LINEAR:
            names = list(KNOWN_TARGETS if family is None else known)
        elif t in known:
            names = [t]
        elif family is not None and t in ALL_TARGET_NAMES:
            raise _Issue(f"the {family} family has no {t!r} layer; its linear layers: {', '.join(known)} (or {ALL_LINEAR!r})")
        else:
            raise _Issue(f"unknown target {t!r}; expected {ALL_LINEAR!r} or some of: {', '.join(known)}")
        out += [n for n in names if n not in out]
    return out


def resolve_targets(targets: str | list[str], family: str | None = None) -> list[str]:
    """Hugging Face layer names to adapt; ``"all-linear"`` expands to every linear layer of
    a decoder block of `family` (llama-style when no family is given)."""
    try:
        return _check_targets(targets, family)
    except _Issue as e:
        raise SpecError("lora.targets", e.message) from None


# --------------------------------------------------------------------------- sections


class ModelConfig(_Model):
    path: str = "builtin:tiny-llama"
    family: Literal["auto", "llama", "qwen2", "mistral"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_seq_len: int = Field(64, ge=8)
    #: the frozen block linears held 4-bit (QLoRA's NF4, `plora.quantize`); None: in ``dtype``
    quantize: Optional[str] = None

    @field_validator("quantize")
    @classmethod
    def _check_quantize(cls, v: Optional[str]) -> Optional[str]:
        from plora.quantize.cost import check_quantize

        try:
            return check_quantize(v)
        except ValueError as e:
            raise _Issue(str(e)) from None

    @field_validator("path")
    @classmethod
    def _check_path(cls, v: str, info: ValidationInfo) -> str:
        if v.startswith("builtin:"):
            name = v.removeprefix("builtin:")
            if name in _gguf_builtins():
                return v
            if name not in available_models():
                avail = ", ".join(available_models()) or "none installed"
                raise _Issue(f"unknown built-in model {name!r}; available: {avail}")
            return v
        if v.startswith("shape:"):
            from plora.costmodel import ModelShape

            name = v.removeprefix("shape:")
            if name not in ModelShape.presets():
                raise _Issue(f"unknown model shape {name!r}; known: {', '.join(ModelShape.presets())}")
            return v
        p = _resolve(v, info)
        if p.suffix.lower() == ".gguf":
            if not p.is_file():
                raise _Issue(f"GGUF file not found: {p}{_where_relative(v, info)}")
            return str(p)
        if not p.exists():
            from plora.hub_cache import HubCacheError, cached_model, looks_like_repo_id

            if looks_like_repo_id(v):  # a Hub id, where no folder of that name is beside the space file
                try:
                    return str(cached_model(v))
                except HubCacheError as e:
                    raise _Issue(f"no folder {p}, and {e}") from None
        if not p.is_dir():
            raise _Issue(f"directory not found: {p}{_where_relative(v, info)}")
        if not (p / "config.json").is_file():
            raise _Issue(f"no config.json in {p} (expected a Hugging Face model folder)")
        return str(p)

    def resolved_path(self) -> Path:
        """The model folder on disk (``builtin:<name>`` mapped into plora/assets;
        ``shape:<preset>`` to a config-only folder in plora's cache, see `random_init`)."""
        if self.path.endswith(".gguf") or self.path.removeprefix("builtin:") in _gguf_builtins():
            from plora.models import resolve_model_path

            return resolve_model_path(self.path, self.dtype)  # converted once (per dtype) into plora's cache
        if self.path.startswith("builtin:"):
            return ASSETS_DIR / self.path.removeprefix("builtin:")
        if self.path.startswith("shape:"):
            from plora.costmodel import ModelShape
            from plora.models import shape_folder

            return shape_folder(ModelShape.preset(self.path.removeprefix("shape:")))
        return Path(self.path)

    @property
    def random_init(self) -> bool:
        """``shape:<preset>``: a randomly initialised model of a known architecture. Planning
        and timing need the shape only; the weights are not on disk."""
        return self.path.startswith("shape:")


class DataConfig(_Model):
    task: Optional[str] = None  # defaults to builtin:shift when no train file is given
    train: Optional[Path] = None  # a file, or a folder written by datasets' save_to_disk
    eval: Optional[Path] = None
    train_split: Optional[str] = Field(None, min_length=1)  # a folder of splits: the one to read
    eval_split: Optional[str] = Field(None, min_length=1)
    format: Literal["auto", "plain", "instruction", "chat", "sharegpt"] = "auto"  # auto: from the columns
    input_column: str = Field("input", min_length=1)
    output_column: str = Field("output", min_length=1)
    instruction_column: str = Field("instruction", min_length=1)
    messages_column: str = Field("messages", min_length=1)
    conversations_column: str = Field("conversations", min_length=1)  # ShareGPT rows
    prompt_template: Optional[str] = None  # e.g. "Question: {input}\nAnswer:" (plain and instruction rows)
    on_bad_rows: Literal["error", "drop"] = "error"  # rows without an answer (or cut away by max_seq_len)
    num_train: Optional[int] = Field(None, ge=1)
    num_eval: Optional[int] = Field(None, ge=1)
    max_eval_samples: int = Field(256, ge=1)

    @field_validator("task")
    @classmethod
    def _check_task(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        if not v.startswith("builtin:") or not v.removeprefix("builtin:"):
            raise _Issue(f"must be builtin:<name> (give data.train for your own files), got {v!r}")
        name = v.removeprefix("builtin:")
        try:  # imported here: the tasks module is heavier and optional for validation
            from plora.tasks import BUILTIN_TASKS
        except ImportError:
            return v
        if name not in BUILTIN_TASKS:
            raise _Issue(f"unknown built-in task {name!r}; available: {', '.join(sorted(BUILTIN_TASKS))}")
        return v

    @field_validator("train", "eval")
    @classmethod
    def _check_file(cls, v: Optional[Path], info: ValidationInfo) -> Optional[Path]:
        if v is None:
            return v
        p = _resolve(v, info)
        if p.is_dir():
            from plora.dataset_folders import DatasetFolderError, splits_of

            try:
                splits_of(p)
            except DatasetFolderError as e:
                raise _Issue(str(e)) from None
            return p
        if p.suffix.lower() not in DATA_SUFFIXES:
            kind = p.suffix or "(none)"
            raise _Issue(f"unsupported file type {kind!r} in {p}; use one of {', '.join(DATA_SUFFIXES)}")
        if not p.is_file():
            raise _Issue(f"file not found: {p}{_where_relative(v, info)}")
        return p

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        from plora.formats import template_fields

        try:
            template_fields(v)
        except ValueError as e:
            raise _Issue(str(e)) from None
        return v

    @model_validator(mode="after")
    def _check_source(self) -> "DataConfig":
        if self.format in ("chat", "sharegpt") and self.prompt_template is not None:
            raise _Issue(f"not used with format {self.format} (the model's chat template renders its rows)",
                         "prompt_template")
        if self.task is not None and self.format not in ("auto", "plain"):
            raise _Issue(f"a built-in task has plain rows, not {self.format}", "format")
        if self.task is not None and self.train is not None:
            raise _Issue("give either task or train (+ eval) files, not both")
        if self.train is None:
            if self.eval is not None:
                raise _Issue("needs data.train (a built-in task makes its own eval set)", "eval")
            if self.task is None:
                self.task = "builtin:shift"
        else:
            for name in ("num_train", "num_eval"):
                if getattr(self, name) is not None:
                    raise _Issue("only used with a built-in task, not with train files", name)
        self._pick_splits()
        return self

    def _pick_splits(self) -> None:
        """The split each saved-dataset folder is read from (`plora.dataset_folders`)."""
        from plora.dataset_folders import DatasetFolderError, pick_split

        for role in ("train", "eval"):
            path, field = getattr(self, role), f"{role}_split"
            wanted = getattr(self, field)
            if path is None or not path.is_dir():
                if wanted is not None:
                    raise _Issue(f"only for a folder of splits written by datasets' save_to_disk "
                                 f"(data.{role} is {path or 'not given'})", field)
                continue
            try:
                setattr(self, field, pick_split(path, role, wanted))
            except DatasetFolderError as e:
                raise _Issue(str(e), field) from None

    @property
    def task_name(self) -> Optional[str]:
        """The built-in task's name without ``builtin:``, or None for files."""
        return self.task.removeprefix("builtin:") if self.task else None


class LoraConfig(_Model):
    targets: Union[str, list[str]] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    dropout: float = 0.0
    rslora: bool = False  # scale alpha/sqrt(rank) instead of alpha/rank (PEFT's use_rslora)

    @field_validator("targets")
    @classmethod
    def _check(cls, v: Union[str, list[str]]) -> Union[str, list[str]]:
        _check_targets(v)
        if isinstance(v, str) and v != ALL_LINEAR:  # a single name is a one-item list
            return [v]
        return v

    @field_validator("dropout")
    @classmethod
    def _check_dropout(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise _Issue(f"must be in [0, 1), got {_fmt(v)}")
        return v

    def resolved_targets(self) -> list[str]:
        return resolve_targets(self.targets)


class Range(_Model):
    """A continuous range of a hyperparameter: sampled (random) or spaced with ``num`` points (grid)."""

    low: float
    high: float
    log: bool = False
    num: Optional[int] = None

    @model_validator(mode="after")
    def _check(self) -> "Range":
        if self.high < self.low:
            raise _Issue(f"must be >= low ({_fmt(self.low)}), got {_fmt(self.high)}", "high")
        if self.log and self.low <= 0:
            raise _Issue(f"a log range needs low > 0, got {_fmt(self.low)}", "low")
        if self.num is not None and self.num < 1:
            raise _Issue(f"must be >= 1, got {self.num}", "num")
        return self

    def grid(self, integer: bool) -> list[float]:
        """``num`` points, evenly spaced (geometrically when ``log``), rounded for integers."""
        num = self.num or 1
        pts = np.geomspace(self.low, self.high, num) if self.log else np.linspace(self.low, self.high, num)
        if integer:
            vals = [int(math.floor(p + 0.5)) for p in pts]
        else:
            vals = [_norm_float(p) for p in pts]
        return list(dict.fromkeys(vals))

    def sample(self, rng: np.random.Generator, integer: bool) -> float:
        """One draw: uniform or log-uniform; a range with ``num`` draws among its grid points."""
        if self.num is not None:
            pts = self.grid(integer)
            return pts[int(rng.integers(len(pts)))]
        if integer:
            lo, hi = int(self.low), int(self.high)
            if not self.log:
                return int(rng.integers(lo, hi + 1))
            # Discrete log-uniform: each integer gets the log-measure of [k, k+1).
            return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))
        if self.log:
            x = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            x = rng.uniform(self.low, self.high)
        return _norm_float(min(max(x, self.low), self.high), RANDOM_SIGNIFICANT_DIGITS)


class RelativeAlpha(_Model):
    """``alpha = factor * rank`` for each factor (the usual way to keep the LoRA scale fixed)."""

    relative: list[float] = Field(min_length=1)

    @field_validator("relative")
    @classmethod
    def _check(cls, v: list[float]) -> list[float]:
        if any(f <= 0 for f in v):
            raise _Issue(f"factors must be > 0, got {_fmt(v)}")
        return v


def _values_or_range(v: Any) -> str:
    return "<range>" if isinstance(v, (dict, Range)) else "<values>"


def _alpha_kind(v: Any) -> str:
    if isinstance(v, RelativeAlpha) or (isinstance(v, dict) and "relative" in v):
        return "<relative>"
    return _values_or_range(v)


# Tags ("<...>") are stripped from error locations: users never wrote them.
IntValues = Annotated[
    Union[Annotated[list[int], Tag("<values>")], Annotated[Range, Tag("<range>")]],
    Discriminator(_values_or_range),
]
FloatValues = Annotated[
    Union[Annotated[list[float], Tag("<values>")], Annotated[Range, Tag("<range>")]],
    Discriminator(_values_or_range),
]
AlphaValues = Annotated[
    Union[
        Annotated[list[float], Tag("<values>")],
        Annotated[Range, Tag("<range>")],
        Annotated[RelativeAlpha, Tag("<relative>")],
    ],
    Discriminator(_alpha_kind),
]
_TAG_MODELS: dict[str, Optional[type[BaseModel]]] = {"<values>": None, "<range>": Range, "<relative>": RelativeAlpha}


class ConfigEntry(_Model):
    """One configuration of a ``strategy: list`` space: rank, alpha, learning rate and batch
    size are required; a `TRAINING_DIMS` value left out is the sweep's."""

    rank: int
    alpha: float
    learning_rate: float
    batch_size: int
    dropout: Optional[float] = None
    weight_decay: Optional[float] = None
    warmup_ratio: Optional[float] = None
    scheduler: Optional[Literal["constant", "linear", "cosine"]] = None
    rslora: Optional[bool] = None
    targets: Optional[Union[str, list[str]]] = None
    epochs: Optional[float] = None

    @field_validator("targets")
    @classmethod
    def _check_targets(cls, v: Optional[Union[str, list[str]]]) -> Optional[str]:
        return None if v is None else _one_target_set(v)

    @model_validator(mode="after")
    def _check(self) -> "ConfigEntry":
        for name in HYPERPARAMETERS:
            if getattr(self, name) <= 0:
                raise _Issue(f"must be > 0, got {_fmt(getattr(self, name))}", name)
        for name in _FLOAT_DIMS:
            v = getattr(self, name)
            if v is not None:
                _check_dim_value(name, v, name)
        return self

    def dims(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in TRAINING_DIMS if getattr(self, n) is not None}


#: the float dimensions of `TRAINING_DIMS` and the values each takes: (low, high, low
#: included, high included); the words say it in messages
_FLOAT_DIMS: dict[str, tuple[float, float, bool, bool, str]] = {
    "dropout": (0.0, 1.0, True, False, "in [0, 1)"),
    "weight_decay": (0.0, math.inf, True, False, ">= 0"),
    "warmup_ratio": (0.0, 1.0, True, True, "in [0, 1]"),
    "epochs": (0.0, math.inf, False, False, "> 0"),
}


def _check_dim_value(name: str, v: float, *path: str | int) -> None:
    lo, hi, lo_in, hi_in, words = _FLOAT_DIMS[name]
    ok = (v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi)
    if not ok:
        raise _Issue(f"must be {words}, got {_fmt(v)}", *path)


def _one_target_set(v: Union[str, list[str]], *path: str | int) -> str:
    """A target set as the space gives it (a name, ``all-linear``, a list of names or
    ``q_proj,v_proj``), checked, as its `target_key`."""
    names = [t.strip() for t in v.split(",")] if isinstance(v, str) else list(v)
    try:
        _check_targets(names)
    except _Issue as e:
        raise _Issue(e.message, *path) from None
    return target_key(names)


class SpaceConfig(_Model):
    strategy: Literal["grid", "random", "list"] = "grid"
    num_samples: Optional[int] = None
    seed: int = Field(0, ge=0)
    rank: IntValues = Field(default_factory=lambda: [8])
    alpha: AlphaValues = Field(default_factory=lambda: [16.0])
    learning_rate: FloatValues = Field(default_factory=lambda: [1.0e-3])
    batch_size: IntValues = Field(default_factory=lambda: [4])
    # searched per adapter where given (`TRAINING_DIMS`); not given: the sweep-wide value
    # of lora.* / training.*
    dropout: Optional[FloatValues] = None
    weight_decay: Optional[FloatValues] = None
    warmup_ratio: Optional[FloatValues] = None
    scheduler: Optional[list[Literal["constant", "linear", "cosine"]]] = None
    rslora: Optional[list[bool]] = None
    targets: Optional[list[Union[str, list[str]]]] = None  # each entry one target set
    epochs: Optional[FloatValues] = None
    configs: Optional[list[ConfigEntry]] = None
    seeds_per_config: int = Field(1, ge=1)

    @field_validator(*HYPERPARAMETERS, *_FLOAT_DIMS, mode="before")
    @classmethod
    def _scalar_is_one_value(cls, v: Any) -> Any:
        if isinstance(v, tuple):
            return list(v)
        if v is not None and not isinstance(v, (list, dict, BaseModel)):
            v = [v]
        if isinstance(v, list) and any(isinstance(x, bool) for x in v):
            raise _Issue(f"must be numbers, got {_fmt(v)}")
        return v

    @field_validator("scheduler", "rslora", "targets", mode="before")
    @classmethod
    def _scalar_is_one_choice(cls, v: Any) -> Any:
        if isinstance(v, tuple):
            return list(v)
        if v is not None and not isinstance(v, list):
            v = [v]
        if isinstance(v, list) and not v:
            raise _Issue("must not be empty")
        return v

    @field_validator("targets")
    @classmethod
    def _check_target_sets(cls, v: Optional[list]) -> Optional[list[str]]:
        if v is None:
            return v
        return list(dict.fromkeys(_one_target_set(t, i) for i, t in enumerate(v)))

    @field_validator("scheduler", "rslora")
    @classmethod
    def _unique_choices(cls, v: Optional[list]) -> Optional[list]:
        return None if v is None else list(dict.fromkeys(v))

    @field_validator(*_FLOAT_DIMS)
    @classmethod
    def _check_dim_values(cls, v: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if isinstance(v, list):
            if not v:
                raise _Issue("must not be empty")
            for i, x in enumerate(v):
                _check_dim_value(name, x, i)
        elif isinstance(v, Range):
            for end in ("low", "high"):
                _check_dim_value(name, getattr(v, end), end)
        return v

    @field_validator(*HYPERPARAMETERS)
    @classmethod
    def _check_values(cls, v: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        integer = name in ("rank", "batch_size")
        if isinstance(v, list):
            if not v:
                raise _Issue("must not be empty")
            if any(x <= 0 for x in v):
                kind = "positive integers" if integer else "> 0"
                raise _Issue(f"must be {kind}, got {_fmt(v)}")
        elif isinstance(v, Range):
            for end in ("low", "high"):
                x = getattr(v, end)
                if x <= 0:
                    raise _Issue(f"must be > 0, got {_fmt(x)}", end)
                if integer and not float(x).is_integer():
                    raise _Issue(f"must be an integer, got {_fmt(x)}", end)
        return v

    @model_validator(mode="after")
    def _check_strategy(self, info: ValidationInfo) -> "SpaceConfig":
        s = self.strategy
        if s == "random":
            if self.num_samples is None:
                raise _Issue("required with strategy random", "num_samples")
            if self.num_samples < 1:
                raise _Issue(f"must be >= 1, got {self.num_samples}", "num_samples")
        elif self.num_samples is not None:
            raise _Issue(f"only used with strategy random (strategy is {s})", "num_samples")
        if s == "list":
            if self.configs is None:
                raise _Issue("required with strategy list", "configs")
            if not self.configs:
                raise _Issue("must list at least one configuration", "configs")
            for name in HYPERPARAMETERS:
                if name in self.model_fields_set:
                    raise _Issue("not used with strategy list (each entry of space.configs gives it)", name)
            for name in TRAINING_DIMS:
                if getattr(self, name) is not None:
                    raise _Issue("not used with strategy list (an entry of space.configs may give it)", name)
        elif self.configs is not None:
            raise _Issue(f"only used with strategy list (strategy is {s})", "configs")
        if s == "grid" and not (info.context or {}).get("sampled"):  # a sampler draws from ranges itself
            for name in (*HYPERPARAMETERS, *_FLOAT_DIMS):
                v = getattr(self, name)
                if isinstance(v, Range) and v.num is None:
                    raise _Issue("required when a range is used with strategy grid", name, "num")
        n = self.num_configs() * self.seeds_per_config
        if n > MAX_ADAPTERS:
            raise _Issue(f"{n} adapters is more than the limit of {MAX_ADAPTERS}; shrink the space")
        return self

    def searched(self) -> list[str]:
        """The `TRAINING_DIMS` this space varies per adapter (a list space: those some entry gives)."""
        if self.strategy == "list":
            given = {n for c in self.configs or [] for n in c.dims()}
            return [n for n in TRAINING_DIMS if n in given]
        return [n for n in TRAINING_DIMS if getattr(self, n) is not None]

    def values(self, name: str) -> list:
        """The grid values of one hyperparameter (alpha factors for a relative alpha)."""
        v = getattr(self, name)
        if isinstance(v, RelativeAlpha):
            return list(v.relative)
        if isinstance(v, Range):
            return v.grid(integer=name in ("rank", "batch_size"))
        return list(dict.fromkeys(v))

    def _axes(self) -> list[str]:
        """The names a grid or a random draw runs over, in order."""
        return [*HYPERPARAMETERS, *(n for n in TRAINING_DIMS if getattr(self, n) is not None)]

    def num_configs(self) -> int:
        """Configurations before seed replication and de-duplication (an upper bound)."""
        if self.strategy == "list":
            return len(self.configs or [])
        if self.strategy == "random":
            return self.num_samples or 0
        return math.prod(len(self.values(n)) for n in self._axes())

    def _alpha(self, value: float, rank: int) -> float:
        return value * rank if isinstance(self.alpha, RelativeAlpha) else value

    def _base_configs(self) -> list[dict[str, Any]]:
        """Each configuration before seeds: rank, alpha, learning_rate, batch_size and the
        dimensions it gives (`TRAINING_DIMS`)."""
        if self.strategy == "list":
            return [{"rank": c.rank, "alpha": c.alpha, "learning_rate": c.learning_rate, "batch_size": c.batch_size,
                     **c.dims()} for c in self.configs or []]
        if self.strategy == "grid":
            axes = self._axes()
            out = []
            for point in itertools.product(*(self.values(n) for n in axes)):
                d = dict(zip(axes, point))
                d["alpha"] = self._alpha(d["alpha"], d["rank"])
                out.append(d)
            return out
        return self._random_configs()

    def _draw(self, name: str, rng: np.random.Generator) -> Any:
        v = getattr(self, name)
        integer = name in ("rank", "batch_size")
        if isinstance(v, Range):
            return v.sample(rng, integer)
        vals = self.values(name)
        return vals[int(rng.integers(len(vals)))]

    def _random_configs(self) -> list[dict[str, Any]]:
        # Draw until num_samples distinct configurations, so that a space with short lists
        # still yields what was asked; a space smaller than that yields all it has. The
        # per-adapter dimensions are drawn after the four, so a space without them draws
        # what it always drew.
        rng = np.random.default_rng(self.seed)
        target = self.num_samples or 0
        extra = [n for n in TRAINING_DIMS if getattr(self, n) is not None]
        out: dict[tuple, dict[str, Any]] = {}
        for _ in range(50 * target + 100):
            if len(out) >= target:
                break
            r = int(self._draw("rank", rng))
            a = self._alpha(self._draw("alpha", rng), r)
            lr = self._draw("learning_rate", rng)
            bs = int(self._draw("batch_size", rng))
            d = {"rank": r, "alpha": _norm_float(a), "learning_rate": _norm_float(lr), "batch_size": bs}
            d.update({n: _norm_dim(n, self._draw(n, rng)) for n in extra})
            out.setdefault(tuple(d.values()), d)
        return list(out.values())


def cuda_graphs_setting(value: Any) -> Union[str, bool]:
    """``training.cuda_graphs`` (or ``PLORA_CUDA_GRAPHS``) as "auto", True or False; YAML's
    on/off arrive as booleans, the environment's as text."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"expected auto, on or off, got {value!r}")


def warmup_steps_for(total_steps: int, warmup_steps: Optional[int], warmup_ratio: Optional[float]) -> int:
    """An adapter's warm-up in its own steps: ``warmup_steps``, or ``warmup_ratio`` of its
    ``total_steps`` rounded up (as transformers does). The one place it is computed: the
    space file's validation and the job both call it."""
    if warmup_ratio:
        return int(math.ceil(float(warmup_ratio) * int(total_steps)))
    return int(warmup_steps or 0)


class TrainingConfig(_Model):
    epochs: Optional[float] = Field(None, gt=0)  # defaults to 1 when steps is not given
    steps: Optional[int] = Field(None, ge=1)
    warmup_steps: Optional[int] = Field(None, ge=0)  # defaults to 0 when warmup_ratio is not given
    warmup_ratio: Optional[float] = Field(None, ge=0, le=1)
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    grad_clip: Optional[float] = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    divergence_loss: Optional[float] = Field(None, gt=0)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward: far less memory
    # steps replayed from CUDA graphs: "auto" = on one GPU without activation checkpointing
    cuda_graphs: Any = "auto"
    # rows of a packed step: "flat" (no padding: one token stream, attention confined to each
    # row), "padded" (each row padded to the pack's widest), "balanced" (flat, each adapter's
    # rows dealt into batches of nearly equal tokens, so one segment size holds every step of
    # a CUDA graph: `plora.balanced_stream`), or "auto": flat, except in steps replayed from
    # CUDA graphs, where it is padded, or balanced where rows vary so much in length that
    # padding them would cost 8% or more (H100, 16 adapters of varied rows: 57 ms padded
    # against 427 ms plain flat, whose per-adapter sizes keep growing and recapturing)
    row_layout: Literal["auto", "flat", "padded", "balanced"] = "auto"
    # padded rows: each adapter draws its rows from this many length buckets in turn (the
    # same bucket at the same step for every batch size), so a step pads to the longest row
    # of one bucket, not of the whole data; "auto": where rows are padded in CUDA-graph
    # steps (one GPU), the count (1-8) that costs the sweep's jobs least for its rows and step
    # budgets (`plora.row_layout.auto_length_buckets`; more buckets pad less, each is one more
    # graph to capture), else 1 (a plain shuffle)
    length_buckets: Union[Literal["auto"], int] = "auto"
    # mid-job checkpoints (weights, AdamW state, schedule and data position of every adapter
    # in the pack), whichever comes first; null turns that trigger off
    checkpoint_every_steps: Optional[int] = Field(500, ge=1)
    checkpoint_every_minutes: Optional[float] = Field(10.0, gt=0)
    # the most rows an adapter puts in one packed step: a larger batch_size (still the
    # effective batch, an optimizer step's rows) accumulates its gradient over
    # ceil(batch_size / micro_batch_size) packed steps in near-equal parts, and trains as
    # it would in one pass (`plora.accumulation`); null: every batch in one pass
    micro_batch_size: Optional[int] = Field(None, ge=1)

    @field_validator("cuda_graphs", mode="before")
    @classmethod
    def _graphs(cls, v: Any) -> Union[str, bool]:
        return cuda_graphs_setting(v)

    @field_validator("length_buckets")
    @classmethod
    def _buckets(cls, v: Union[str, int]) -> Union[str, int]:
        if v != "auto" and (isinstance(v, bool) or int(v) < 1):
            raise ValueError("must be auto or a whole number of at least 1")
        return v

    @model_validator(mode="after")
    def _check(self) -> "TrainingConfig":
        if self.epochs is not None and self.steps is not None:
            raise _Issue("give exactly one of epochs or steps")
        if self.epochs is None and self.steps is None:
            self.epochs = 1.0
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise _Issue("give at most one of warmup_steps or warmup_ratio")
        if self.warmup_steps is None and self.warmup_ratio is None:
            self.warmup_steps = 0
        return self

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps of an adapter that trains ``total_steps`` steps."""
        return warmup_steps_for(total_steps, self.warmup_steps, self.warmup_ratio)


class EvalConfig(_Model):
    # plora.metrics.BUILTIN_METRICS, or a user metric "module:function"
    metrics: list[str] = Field(default_factory=lambda: ["loss", "exact_match"])
    max_new_tokens: int = Field(16, ge=1)
    objective: Optional[str] = None  # exact_match if measured, else the first metric
    greater_is_better: Optional[bool] = None  # default: false for loss and perplexity, true for every other metric
    every_steps: Optional[int] = Field(None, ge=1)  # intermediate eval loss every N adapter steps (pruning, curves)
    # eval rows on which intermediate evals also score the objective where it is not the loss
    # (generation is costly): the same rows each time, for every adapter; clipped to the eval set
    intermediate_samples: int = Field(32, ge=1)
    choices: Optional[list[str]] = None  # choice_accuracy: the label choices of every row
    choices_column: Optional[str] = Field(None, min_length=1)  # or: a column with each row's own choices

    @field_validator("metrics")
    @classmethod
    def _check_metrics(cls, v: list[str], info: ValidationInfo) -> list[str]:
        from plora.metrics import MetricError, check_metric

        for i, name in enumerate(v):
            try:
                check_metric(name, _base_dir(info))
            except MetricError as e:
                raise _Issue(str(e), i) from None
        return v

    @field_validator("choices")
    @classmethod
    def _check_choices(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is None:
            return v
        if len(v) < 2:
            raise _Issue(f"needs at least two choices, got {_fmt(v)}")
        if any(not c.strip() for c in v):
            raise _Issue("a choice is empty")
        if len(set(v)) != len(v):
            raise _Issue(f"duplicate choice in {_fmt(v)}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        from plora.metrics import metric_name

        if not self.metrics:
            raise _Issue("must name at least one metric", "metrics")
        names = [metric_name(m) for m in self.metrics]
        if len(set(names)) != len(names):
            raise _Issue(f"duplicate metric in {_fmt(self.metrics)}", "metrics")
        if "choice_accuracy" in names:
            if (self.choices is None) == (self.choices_column is None):
                raise _Issue("choice_accuracy needs exactly one of eval.choices or eval.choices_column", "metrics")
        else:
            for name in ("choices", "choices_column"):
                if getattr(self, name) is not None:
                    raise _Issue("only used with the choice_accuracy metric", name)
        if self.objective is None:
            self.objective = "exact_match" if "exact_match" in names else names[0]
        elif self.objective in self.metrics:
            self.objective = metric_name(self.objective)
        elif self.objective not in names:
            raise _Issue(f"{self.objective!r} is not in eval.metrics {_fmt(self.metrics)}", "objective")
        return self

    @property
    def metric_names(self) -> list[str]:
        """What each metric is called in results (``eval_<name>``)."""
        from plora.metrics import metric_name

        return [metric_name(m) for m in self.metrics]

    @property
    def minimize(self) -> bool:
        """Whether a lower objective is better (loss, perplexity, or ``greater_is_better: false``)."""
        from plora.metrics import minimize

        return minimize(self.objective, self.greater_is_better)


class RayConfig(_Model):
    address: Optional[str] = None  # a running cluster ("auto", "ray://host:10001", "host:6379"); default: start one here
    cpus_per_gpu: float = Field(1.0, ge=0)  # CPUs reserved beside each GPU of a job


class HardwareConfig(_Model):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpus: int = Field(1, ge=1)
    gpu_memory_gb: float = Field(80, gt=0)
    backend: Literal["local", "ray"] = "local"  # ray: jobs run as Ray tasks on a cluster (pip install "plora[ray]")
    nodes: int = Field(1, ge=1)  # ray: the planner plans for nodes x gpus_per_node
    gpus_per_node: Optional[int] = Field(None, ge=1)  # default: gpus; CPU slots per node on a CPU cluster
    ray: RayConfig = Field(default_factory=dict)

    @property
    def per_node(self) -> int:
        """GPUs (or CPU slots) of one node: the largest TP degree a job may have."""
        return self.gpus_per_node or self.gpus


class PlannerConfig(_Model):
    max_adapters_per_job: int = Field(8, ge=1)
    solver: Literal["auto", "gurobi", "highs"] = "auto"
    memory_load_factor: float = Field(0.9, gt=0, le=1)
    objective: Literal["makespan", "paper"] = "makespan"
    #: adapters of jobs not started yet join running one-GPU jobs that have room for them (by
    #: the cost model's memory and max_adapters_per_job) instead of waiting for a job of their
    #: own: the longest first, each where the cost model predicts the pack ends soonest
    #: (`plora.engine.join_choice`). "auto": on a GPU (a job process, its imports and its
    #: model are then paid once per GPU, and packs never drain while adapters wait), off on
    #: a CPU (the demo's one-core jobs gain nothing from it)
    streaming: Union[bool, Literal["auto"]] = "auto"
    #: run a baseline instead of the packed plan, on the same engine, to measure what packing
    #: saves: ``min_gpu`` (one adapter per job on the fewest GPUs that hold it, jobs side by
    #: side), ``max_gpu`` (one adapter per job on as many GPUs as it can use) or
    #: ``sequential`` (one adapter at a time); nothing is streamed into their jobs
    baseline: Optional[Literal["min_gpu", "max_gpu", "sequential"]] = None

    def streams(self, gpu: bool) -> bool:
        """Whether a sweep on a GPU (``gpu``) or CPU slots streams adapters into running jobs."""
        if self.baseline is not None:
            return False
        return self.streaming is True or (self.streaming == "auto" and gpu)


class PrunerConfig(_Model):
    """Where ``plora tune``'s pruner looks: rungs at fixed fractions of each adapter's own
    training budget, ``min_fraction × reduction_factor^k`` (`plora.tuning.fidelity`)."""

    min_fraction: float = Field(1 / 9, gt=0, lt=1)  # the first rung: the share of its budget an adapter has seen
    reduction_factor: int = Field(3, ge=2)  # rungs' spacing, and the share (1/η) a rung keeps
    #: a rung stops no trial until this many trials have been scored at it (default: the
    #: reduction factor): the first ones to reach it are not judged against one another alone
    min_trials_per_rung: Optional[int] = Field(None, ge=1)

    @property
    def min_peers(self) -> int:
        return self.min_trials_per_rung or self.reduction_factor


class OptunaConfig(_Model):
    storage: Optional[str] = None  # any Optuna storage URL; default: sqlite in the run directory
    study_name: Optional[str] = None  # default: the sweep's name
    pruner: PrunerConfig = Field(default_factory=dict)
    #: ``plora tune`` stops asking trials once its jobs have spent this many GPU-seconds
    #: (``--budget``); running trials then finish (``finish``) or are pruned (``stop``)
    budget_gpu_seconds: Optional[float] = Field(None, gt=0)
    on_budget: Literal["finish", "stop"] = "finish"


class WandbConfig(_Model):
    """A Weights & Biases run per adapter (`plora.tracking`)."""

    project: str = Field("plora", min_length=1)
    entity: Optional[str] = None  # default: the account's own
    mode: Optional[Literal["online", "offline", "disabled"]] = None  # default: WANDB_MODE, else online
    group: Optional[str] = None  # default: the sweep's name
    tags: list[str] = Field(default_factory=list)


class LoggingConfig(_Model):
    """Experiment trackers each adapter's curves, eval metrics and hyperparameters go to
    (`plora.tracking`); each needs its optional extra, checked here."""

    tensorboard: bool = False  # event files under <run>/tensorboard/<adapter-id>/
    wandb: Optional[WandbConfig] = None  # true: every default; a mapping: its settings

    @field_validator("wandb", mode="before")
    @classmethod
    def _switch(cls, v: Any) -> Any:
        if v is True:
            return {}
        return None if v is False else v

    @field_validator("tensorboard", "wandb")
    @classmethod
    def _package(cls, v: Any, info: ValidationInfo) -> Any:
        from plora.tracking.packages import missing_package

        if v:
            problem = missing_package(info.field_name)
            if problem:
                raise _Issue(problem)
        return v


class OutputConfig(_Model):
    dir: Path = Path("runs")

    @field_validator("dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        # An output, unlike the inputs: runs land where the user runs plora (`plora sweep
        # sweeps/demo.yaml` writes runs/demo here), not next to the space file.
        return Path(v).expanduser().resolve()


_SECTIONS = ("model", "data", "lora", "space", "training", "eval", "hardware", "planner", "optuna", "logging", "output")


class SweepSpec(_Model):
    """A validated space file. Build it with :func:`load_spec` or :func:`parse_spec`."""

    # Section defaults are empty mappings validated like given ones, so that their paths
    # resolve against the space file's folder and their errors carry the section's name.

    name: str
    model: ModelConfig = Field(default_factory=dict)
    data: DataConfig = Field(default_factory=dict)
    lora: LoraConfig = Field(default_factory=dict)
    space: SpaceConfig = Field(default_factory=dict)
    training: TrainingConfig = Field(default_factory=dict)
    eval: EvalConfig = Field(default_factory=dict)
    hardware: HardwareConfig = Field(default_factory=dict)
    planner: PlannerConfig = Field(default_factory=dict)
    optuna: OptunaConfig = Field(default_factory=dict)
    logging: LoggingConfig = Field(default_factory=dict)
    output: OutputConfig = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # `model:` with only comments under it is YAML null: read it as "all defaults".
        if isinstance(data, dict):
            data = {k: ({} if k in _SECTIONS and v is None else v) for k, v in data.items()}
        return data

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", v):
            raise _Issue(f"must be a folder name (letters, digits, '.', '_', '-'), got {v!r}")
        return v

    @model_validator(mode="after")
    def _check_dims(self) -> "SweepSpec":
        """What the space varies per adapter must agree with the sweep-wide sections, and a
        list space must not give one adapter twice (an entry that gives a dimension at the
        sweep's value is the entry that leaves it out)."""
        sp = self.space
        if self.training.steps is not None and "epochs" in sp.searched():
            where = ("epochs",) if sp.strategy != "list" else ("configs", next(
                i for i, c in enumerate(sp.configs or []) if c.epochs is not None), "epochs")
            raise _Issue("needs an epoch budget, but training.steps fixes every adapter's steps", "space", *where)
        if sp.strategy == "list":
            first: dict[str, int] = {}
            for i, c in enumerate(sp.configs or []):
                cfg = self.make_config(c.rank, c.alpha, c.learning_rate, c.batch_size, sp.seed, **c.dims())
                if cfg.id in first:
                    raise _Issue(
                        f"same configuration as space.configs[{first[cfg.id]}] (rank {c.rank}, alpha {_fmt(c.alpha)}, "
                        f"learning_rate {_fmt(c.learning_rate)}, batch_size {c.batch_size}); list each configuration "
                        "once (space.seeds_per_config trains every one with several seeds)", "space", "configs", i)
                first[cfg.id] = i
        return self

    def sweep_values(self) -> dict[str, Any]:
        """The sweep-wide value of each of `TRAINING_DIMS` (what an adapter that does not set
        it trains with), in the form an `AdapterConfig` holds: epochs None under
        ``training.steps``, warm-up ratio None under ``training.warmup_steps``."""
        t, lo = self.training, self.lora
        # no warm-up at all is a ratio of 0: an adapter that gives 0 trains as the sweep does
        ratio = 0.0 if t.warmup_ratio is None and not t.warmup_steps else t.warmup_ratio
        values = {"dropout": lo.dropout, "weight_decay": t.weight_decay, "warmup_ratio": ratio,
                  "scheduler": t.scheduler, "rslora": lo.rslora, "targets": lo.targets,
                  "epochs": t.epochs if t.steps is None else None}
        return {n: _norm_dim(n, v) for n, v in values.items()}

    def make_config(self, rank: int, alpha: float, learning_rate: float, batch_size: int, seed: int,
                    **dims: Any) -> AdapterConfig:
        """The adapter config of this sweep: a dimension given at the sweep's own value is
        left out (None), so the same training is one id however the space spells it."""
        sweep = self.sweep_values()
        own = {n: v for n, v in ((n, _norm_dim(n, dims.get(n))) for n in dims) if v is not None and v != sweep[n]}
        return AdapterConfig.make(rank, alpha, learning_rate, batch_size, seed, **own)

    def settings(self, cfg: AdapterConfig) -> dict[str, Any]:
        """What ``cfg`` trains with for each of `TRAINING_DIMS`: its own value, else the sweep's."""
        sweep = self.sweep_values()
        return {n: getattr(cfg, n) if getattr(cfg, n) is not None else sweep[n] for n in TRAINING_DIMS}

    def expand(self) -> list[AdapterConfig]:
        """Every adapter of the sweep, in a deterministic order (config-major, then seed);
        duplicates (same id) are dropped, keeping the first."""
        out: dict[str, AdapterConfig] = {}
        for d in self.space._base_configs():
            for i in range(self.space.seeds_per_config):
                cfg = self.make_config(seed=self.space.seed + i, **d)
                out.setdefault(cfg.id, cfg)
        return list(out.values())

    @property
    def scored_epochs(self) -> int:
        """How many epoch ends the sweep's adapters are scored at: those of the most epochs
        any adapter trains (its own from the space, else ``training.epochs``: a partial last
        one counts), or 1 where none trains more than one epoch or the budget is in steps."""
        t, sp = self.training, self.space
        if t.steps is not None:
            return 1
        most = [float(t.epochs or 1.0)]
        if sp.strategy == "list":
            most += [float(c.epochs) for c in sp.configs or [] if c.epochs is not None]
        elif isinstance(sp.epochs, Range):
            most.append(float(sp.epochs.high))
        elif sp.epochs:
            most += [float(e) for e in sp.epochs]
        top = max(most)
        return int(math.ceil(top)) if top > 1 else 1

    def steps_for(self, cfg: AdapterConfig, num_train: int) -> int:
        """Optimizer steps of one adapter: ``ceil(epochs * num_train / batch_size)`` with its
        own epochs (else the sweep's), or ``training.steps``."""
        if self.training.steps is not None:
            return self.training.steps
        from plora.costmodel import steps_for

        epochs = cfg.epochs if cfg.epochs is not None else self.training.epochs
        return steps_for(num_train, cfg.batch_size, epochs or 1.0)

    def warmup_for(self, cfg: AdapterConfig, total_steps: int) -> int:
        """Warm-up steps of an adapter that trains ``total_steps`` steps: its own warm-up
        ratio where it has one, else the sweep's warm-up."""
        if cfg.warmup_ratio is not None:
            return warmup_steps_for(total_steps, None, cfg.warmup_ratio)
        return self.training.warmup_for(total_steps)

    def target_sets(self, configs: Sequence[AdapterConfig] | None = None) -> list[str]:
        """The distinct target sets (`target_key`) of ``configs`` (default: the sweep's), in
        order of first use."""
        sweep = self.sweep_values()["targets"]
        return list(dict.fromkeys(c.targets or sweep for c in (self.expand() if configs is None else configs)))

    def run_dir(self, override: Path | None = None) -> Path:
        """The run directory: ``override`` itself when given, else ``<output.dir>/<name>``."""
        if override is not None:
            return Path(override).expanduser().resolve()
        return self.output.dir / self.name

    def to_yaml(self) -> str:
        """The resolved spec (defaults filled in, absolute paths); :func:`parse_spec` reads it back equal.
        Per-adapter dimensions the space does not search and ``lora.rslora`` off are left out:
        a space that uses neither reads as it did before they existed."""
        data = self.model_dump(mode="json")
        if self.space.strategy == "list":
            for name in HYPERPARAMETERS:
                del data["space"][name]
            for entry in data["space"]["configs"]:
                for name in TRAINING_DIMS:
                    if entry.get(name) is None:
                        entry.pop(name, None)
        for name in TRAINING_DIMS:
            if data["space"].get(name) is None:
                data["space"].pop(name, None)
        if not data["lora"].get("rslora"):
            data["lora"].pop("rslora", None)
        return yaml.dump(data, Dumper=_SpecDumper, sort_keys=False, width=100)

    def summary(self) -> dict:
        """Counts of the expanded sweep: adapters, and adapters per value of each hyperparameter
        (and of each dimension the space searches, at each adapter's effective value)."""
        cfgs = self.expand()
        out: dict[str, Any] = {"strategy": self.space.strategy, "adapters": len(cfgs)}
        out["configs"] = len({(c.rank, c.alpha, c.learning_rate, c.batch_size, *(getattr(c, n) for n in TRAINING_DIMS))
                              for c in cfgs})
        for name in (*HYPERPARAMETERS, "seed"):
            counts: dict[Any, int] = {}
            for c in cfgs:
                key = getattr(c, name)
                counts[key] = counts.get(key, 0) + 1
            out[name] = dict(sorted(counts.items()))
        for name in self.space.searched():
            counts = {}
            for c in cfgs:
                key = self.settings(c)[name]
                counts[key] = counts.get(key, 0) + 1
            out[name] = dict(sorted(counts.items(), key=lambda kv: str(kv[0])))
        return out


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
    ``model.<field>``): what reads a run's base model back (`plora.export`) needs it
    without the rest of the spec, whose data files may have moved since the run."""
    base = Path(base_dir).expanduser().resolve() if base_dir is not None else Path.cwd()
    try:
        return ModelConfig.model_validate({} if data is None else data, context={"base_dir": base})
    except ValidationError as err:
        e = _from_validation_error(err)
        raise SpecError(f"model.{e.field}" if e.field != "spec" else "model", e.message) from None


class _SpecDumper(yaml.SafeDumper):
    """Block mappings, one-line lists of scalars: reads like a hand-written space file."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_SpecDumper.add_representer(list, _represent_list)


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
    :func:`parse_spec`. ``overrides`` (``key=value``, `plora.overrides`) change the file's
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
        from plora.overrides import OverrideError, apply_overrides

        try:
            data = apply_overrides(data, overrides)
        except OverrideError as e:
            raise SpecError(e.field, e.message) from None
    return parse_spec(data, base_dir=path.resolve().parent, sampled=sampled)
