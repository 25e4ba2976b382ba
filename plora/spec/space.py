"""The ``space`` section and its sampling: the values, ranges and relative alphas a space
searches, and how it expands into configurations (a grid, random draws, or a list).

`Range` draws (and grids) values, rounded for integer hyperparameters; `SpaceConfig`
validates the axes and yields the hyperparameter sets that `plora.spec.schema.SweepSpec`
makes into `AdapterConfig`s."""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Any, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from plora.spec.base import _fmt, _Issue, _Model
from plora.spec.adapter import (
    _norm_dim,
    _norm_float,
    HYPERPARAMETERS,
    INTEGER_HYPERPARAMETERS,
    MAX_RANK,
    target_key,
    TRAINING_DIMS,
)
from plora.spec.model import _check_targets


#: A sweep larger than this is almost certainly a typo (a grid with one axis too many).
MAX_ADAPTERS = 100_000
#: Continuous values drawn at random are rounded to this many significant digits, so that
#: tables and ids stay readable; it changes nothing that matters for a sweep.
RANDOM_SIGNIFICANT_DIGITS = 4


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


def _check_rank_limit(rank: float, where: str | None) -> None:
    if rank > MAX_RANK:
        raise _Issue(f"must be at most {MAX_RANK} (the packed kernels' largest rank), got {_fmt(rank)}",
                     *(() if where is None else (where,)))


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
        _check_rank_limit(self.rank, "rank")
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
        integer = name in INTEGER_HYPERPARAMETERS
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
        if name == "rank" and isinstance(v, list):
            for x in v:
                _check_rank_limit(x, None)
        elif name == "rank" and isinstance(v, Range):
            _check_rank_limit(v.high, "high")
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
            return v.grid(integer=name in INTEGER_HYPERPARAMETERS)
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
        integer = name in INTEGER_HYPERPARAMETERS
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
