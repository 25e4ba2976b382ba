"""`Profile`: a fitted cost model with the measurements behind it, as profile.json holds it.

The measurements are kept next to the coefficients so that a profile can be fitted again
without probing (for other TP degrees or another memory size: `profile_sweep`) and its
errors shown again (`plora.cost.profiling.validate`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plora.cost.model import CostModel
from plora.cost.profiling.errors import ProfileError
from plora.cost.profiling.probes import Measurement
from plora.cost.profiling.validate import prediction_errors, summarize_errors

PROFILE_KIND = "plora.profile/v1"


@dataclass
class Profile:
    """A fitted cost model with the measurements behind it: what profile.json holds."""

    cost_model: CostModel
    measurements: list[Measurement]  # the probes the model is fitted on
    holdout: list[Measurement]  # validation packs, not used in the fit
    key: dict[str, Any]
    load_factor: float = 0.9
    timings: dict[str, float] = field(default_factory=dict)
    reused: bool = False
    cache_path: str | None = None
    #: raw phases of real job runs (the job probe's, then finished sweeps'): the job terms' data
    job_runs: list[dict[str, Any]] = field(default_factory=list)

    def errors(self) -> list[dict[str, Any]]:
        return prediction_errors(self.cost_model, self.holdout, self.load_factor)

    def fit_errors(self) -> list[dict[str, Any]]:
        return prediction_errors(self.cost_model, self.measurements, self.load_factor)

    def summary(self) -> dict[str, Any]:
        return summarize_errors(self.errors())

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PROFILE_KIND,
            "key": self.key,
            "cost_model": self.cost_model.to_dict(),
            "load_factor": self.load_factor,
            "timings": self.timings,
            "reused": self.reused,
            "cache_path": self.cache_path,
            "summary": self.summary(),
            "errors": self.errors(),
            "measurements": [m.to_dict() for m in self.measurements],
            "holdout": [m.to_dict() for m in self.holdout],
            **({"job_runs": self.job_runs} if self.job_runs else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        if d.get("kind") != PROFILE_KIND:
            raise ProfileError(f"not a plora profile (kind {d.get('kind')!r}, expected {PROFILE_KIND!r})")
        return cls(
            cost_model=CostModel.from_dict(d["cost_model"]),
            measurements=[Measurement.from_dict(m) for m in d.get("measurements", [])],
            holdout=[Measurement.from_dict(m) for m in d.get("holdout", [])],
            key=dict(d.get("key", {})),
            load_factor=float(d.get("load_factor", 0.9)),
            timings={k: float(v) for k, v in d.get("timings", {}).items()},
            reused=bool(d.get("reused", False)),
            cache_path=d.get("cache_path"),
            job_runs=list(d.get("job_runs", [])),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ProfileError(f"{path}: cannot read the profile ({e})") from e


def load_profile(path: str | Path) -> Profile:
    return Profile.load(path)
