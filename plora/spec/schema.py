"""The space file as a whole: `SweepSpec`, its sections together, its validation across
sections, and its expansion into adapter configs.

A sweep is described by one YAML file (see ``sweeps/example-full.yaml``). Everything
downstream (profiler, planner, engine, report) reads the validated :class:`SweepSpec`, so
every mistake a user can make in that file is caught here or in the sections
(`plora.spec.sections`, `plora.spec.model`, `plora.spec.space`), before any GPU time is
spent, and reported as a one-line :class:`SpecError` that names the offending field."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, field_validator, model_validator

from plora.spec.base import _fmt, _Issue, _Model
from plora.spec.adapter import _norm_dim, AdapterConfig, HYPERPARAMETERS, TRAINING_DIMS
from plora.spec.model import ModelConfig
from plora.spec.space import Range, SpaceConfig
from plora.spec.sections import (
    DataConfig,
    EvalConfig,
    HardwareConfig,
    LoggingConfig,
    LoraConfig,
    OptunaConfig,
    OutputConfig,
    PlannerConfig,
    TrainingConfig,
    warmup_steps_for,
)


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
        from plora.data.accumulation import steps_for

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


class _SpecDumper(yaml.SafeDumper):
    """Block mappings, one-line lists of scalars: reads like a hand-written space file."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_SpecDumper.add_representer(list, _represent_list)
