"""One adapter's configuration (`AdapterConfig`): what a space expands into, one per trial.

Its hyperparameters (rank, alpha, learning rate, batch size, seed), the training settings a
space may vary per adapter (`TRAINING_DIMS`), its stable id, and its LoRA scale
(`lora_scale`: ``alpha / rank``, or rsLoRA's ``alpha / sqrt(rank)``: computed here only).
The rule for integer hyperparameters (`INTEGER_HYPERPARAMETERS`) and the rank limit
(`MAX_RANK`) live here too."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional


from plora.models.families.targets import ALL_LINEAR


HYPERPARAMETERS: tuple[str, ...] = ("rank", "alpha", "learning_rate", "batch_size")
#: the hyperparameters that take whole numbers only: grids are rounded, draws and values checked
INTEGER_HYPERPARAMETERS: frozenset[str] = frozenset({"rank", "batch_size"})
#: the largest LoRA rank: the packed kernels' limit (`plora.kernels.MAX_RANK`, which imports
#: torch; `tests/test_spec.py` checks the two agree), refused here rather than at a kernel launch
MAX_RANK = 256
#: What else a space may vary per adapter. Each has a sweep-wide value (``lora`` or
#: ``training``); an `AdapterConfig` holds one only where it differs from that value (None:
#: the sweep's), so a configuration's id stays what it was before the dimension existed.
TRAINING_DIMS: tuple[str, ...] = ("dropout", "weight_decay", "warmup_ratio", "scheduler", "rslora", "targets", "epochs")
SCHEDULERS: tuple[str, ...] = ("constant", "linear", "cosine")


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
