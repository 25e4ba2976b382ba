"""A cost model corrected by what a sweep's own training measured.

A full profile (`plora profile`) runs minutes of probes; a sweep does not wait for one. It
plans with what is known: a cached profile, else a cached calibration of this model on this
machine, else the analytic prior (`plora.cost.model.CostModel.analytic`). While its jobs run,
every pack composition a job steps through reports its steady step time, the tokens those
steps ran and the job's device footprint (progress.json ``phases``, `plora.job.phases`).
From those samples this module fits

* two time scales: one for the prior's per-step part (``c0``, per adapter, per rank
  bucket: launches and weights read once a step) and one for its per-token part (base
  FLOPs, the LoRA path), fitted on relative error; a single scale where the samples cannot
  tell the two apart;
* one memory scale for the adapters' part of a pack's footprint (the base model's weights
  are what they are), taken from the largest measured ratio, so the correction stays on the
  safe side;
* the job terms (start, load, captures, evals, saves) from finished jobs' phases
  (`plora.cost.job.fit_overheads`).

The jobs not started yet are re-planned with the corrected model and streaming joins fit by
it (`plora.engine.runner`); the samples are kept in plora's cache
(`plora.cost.profiling.cache.remember_calibration`), so that the next sweep of this model here
starts calibrated.

Before any measurement, the prior's memory counts the adapters' part `MEMORY_MARGIN` times
(`conservative`): a plan made on it must not run out of memory. Where that would make the
plan smaller than the prior's own, the sweep first measures two short packs
(`quick_calibration`, a few seconds) and plans on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from plora.cost.model import AdapterLoad, CostModel, MemoryCoeffs, TimeCoeffs, num_buckets
from plora.cost.job import fit_overheads

__all__ = [
    "CALIBRATED_SOURCE",
    "MEMORY_MARGIN",
    "Calibration",
    "PackFootprint",
    "PackTiming",
    "SweepCalibrator",
    "conservative",
    "is_analytic",
    "samples_from_phases",
]

#: how many times an uncalibrated plan counts the prior's memory per adapter (activations,
#: LoRA state): on Qwen2.5 shapes on an H200, measured footprints were 0.6-2.7x the analytic
#: prior's (the allocator's reserved blocks, the step graphs' pool, transient buffers)
MEMORY_MARGIN = 3.0
#: a phase needs this many steady steps (after its first, which compiles or captures) to time it
MIN_STEADY_STEPS = 2
#: scales are kept within these bounds (a sample far outside is a measurement gone wrong)
SCALE_RANGE = (0.05, 20.0)
#: the two time scales are fitted apart only where the samples' per-step and per-token shares
#: differ by at least this factor; otherwise one scale for both
DISTINCT_SHARES = 1.5
#: a footprint tells the memory per adapter only where the model puts the adapters at this
#: share of it or more (`fit_memory_scale`): below, the base's slack (context, allocator,
#: the prior's 3 GiB overhead) decides the ratio
TELLING_SHARE = 0.5
#: the memory scale never goes below this (on an H100, 16 adapters of the 0.5B shape measured
#: 0.9-1.0x the prior)
MIN_MEMORY_SCALE = 0.75
#: at most this many samples of each kind are kept (the newest)
MAX_SAMPLES = 256
#: where a calibrated model came from, as `plora.cost.sweep_model.cost_model_for` reports it
CALIBRATED_SOURCE = "a calibration of the analytic model measured on this machine"


def pack_loads(ranks: Sequence[int], rows: Sequence[int]) -> list[AdapterLoad]:
    """A measured pack as the cost model prices it: one load an adapter (its steps do not
    matter to a step's time or memory)."""
    return [AdapterLoad(f"k{i}", int(r), int(b), 1) for i, (r, b) in enumerate(zip(ranks, rows))]


@dataclass(frozen=True)
class PackTiming:
    """One pack composition's steady steps: adapters of these ranks and rows, each row costing
    ``row_tokens`` tokens (padding included), ``step_s`` seconds a step over ``steps`` steps."""

    ranks: tuple[int, ...]
    rows: tuple[int, ...]
    row_tokens: float
    step_s: float
    steps: int

    def loads(self) -> list[AdapterLoad]:
        return pack_loads(self.ranks, self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "rows": list(self.rows), "row_tokens": self.row_tokens,
                "step_s": self.step_s, "steps": self.steps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PackTiming":
        return cls(tuple(int(r) for r in d["ranks"]), tuple(int(b) for b in d["rows"]), float(d["row_tokens"]),
                   float(d["step_s"]), int(d["steps"]))


@dataclass(frozen=True)
class PackFootprint:
    """A job's device footprint (bytes) while it trained adapters of these ranks and rows, each
    row at most ``row_tokens`` tokens."""

    ranks: tuple[int, ...]
    rows: tuple[int, ...]
    row_tokens: float
    device_bytes: float

    def loads(self) -> list[AdapterLoad]:
        return pack_loads(self.ranks, self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "rows": list(self.rows), "row_tokens": self.row_tokens,
                "device_bytes": self.device_bytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PackFootprint":
        return cls(tuple(int(r) for r in d["ranks"]), tuple(int(b) for b in d["rows"]), float(d["row_tokens"]),
                   float(d["device_bytes"]))


def samples_from_phases(phases: Iterable[dict[str, Any]], seq_len: int) -> tuple[list[PackTiming], list[PackFootprint]]:
    """The timings and footprints in a job's ``phases`` (progress.json or summary.json): each
    composition with its pack and at least `MIN_STEADY_STEPS` steady steps is a timing; each
    with a device footprint is a footprint, priced at its widest rows (``seq_len`` where the
    job did not say)."""
    timings: list[PackTiming] = []
    footprints: list[PackFootprint] = []
    largest = 0.0  # the most tokens a step of the job has held so far
    for p in phases:
        if not isinstance(p, dict) or "ranks" not in p or "rows" not in p:
            continue
        ranks, rows = tuple(int(r) for r in p["ranks"]), tuple(int(b) for b in p["rows"])
        if not ranks or len(ranks) != len(rows) or sum(rows) <= 0:
            continue
        steady = int(p.get("steps", 0)) - 1
        tokens = float(p.get("rest_tokens", 0))
        row_tokens = tokens / steady / sum(rows) if steady > 0 and tokens > 0 else float(seq_len)
        if steady >= MIN_STEADY_STEPS and float(p.get("rest_s", 0.0)) > 0:
            timings.append(PackTiming(ranks, rows, row_tokens, float(p["rest_s"]) / steady, steady))
        widest = min(float(p.get("max_row_tokens") or seq_len), float(seq_len))
        held = widest * sum(rows)
        # a job's reserved memory only grows (the allocator keeps its blocks, the graphs their
        # pool): a footprint tells of the largest pack so far, not of a smaller one after it
        if p.get("device_bytes") and held >= largest:
            footprints.append(PackFootprint(ranks, rows, widest, float(p["device_bytes"])))
        largest = max(largest, held)
    return timings, footprints


def is_analytic(model: CostModel) -> bool:
    """Whether a model is the analytic prior (no measurement behind it)."""
    return model.meta.get("source") == "analytic"


def conservative(prior: CostModel, margin: float = MEMORY_MARGIN, loads: Sequence[AdapterLoad] = (),
                 load_factor: float = 0.9) -> CostModel:
    """The prior with each adapter's memory counted ``margin`` times: what a plan made before
    any measurement may rely on. Given the sweep's ``loads``, the margin is cut (never below
    1) where it alone would leave one of them fitting no GPU: the plan must place every
    adapter, and the job's own footprint corrects the rest."""
    if loads:
        margin = min(margin, max(1.0, _largest_margin(prior, loads, load_factor)))
    return adapter_memory_scaled(prior, margin).with_meta(memory_margin=float(margin))


def adapter_memory_scaled(model: CostModel, factor: float) -> CostModel:
    """The model with every adapter's memory (not the base's) ``factor`` times as large."""
    memory = {d: MemoryCoeffs(m.base, m.adapter * factor, m.rank * factor, m.tok * factor, m.rank_tok * factor)
              for d, m in model.memory_coeffs.items()}
    return replace(model, memory_coeffs=memory)


def _largest_margin(prior: CostModel, loads: Sequence[AdapterLoad], load_factor: float) -> float:
    """The largest margin at which every one of ``loads`` alone still fits some TP degree."""
    worst = float("inf")
    for a in loads:
        best = 0.0
        for d, m in prior.memory_coeffs.items():
            adapter = prior.memory_per_adapter(a, d)
            room = load_factor * prior.gpu_memory_bytes - m.base
            if adapter > 0:
                best = max(best, room / adapter)
            elif room >= 0:
                best = float("inf")
        worst = min(worst, best)
    return worst


def _clamp(x: float) -> float:
    lo, hi = SCALE_RANGE
    return min(hi, max(lo, x))


def _split_step(model: CostModel, t: PackTiming, d: int) -> tuple[float, float]:
    """(per-step part, per-token part) of the model's GPU step time for a timed pack."""
    c = model.time[d]
    priced = model.for_rows(t.row_tokens)
    loads = t.loads()
    fixed = c.c0 + c.c_bkt * num_buckets(t.ranks) + c.c_ad * len(loads)
    variable = sum(priced.piece_per_adapter(TimeCoeffs(0.0, c.c_tok, c.c_rtok, 0.0, 0.0), a) for a in loads)
    return fixed, variable


def fit_time_scales(model: CostModel, timings: Sequence[PackTiming], d: int = 1) -> tuple[float, float] | None:
    """Scales (per-step part, per-token part) that bring the model's GPU step time to the
    measured one, least squares on relative error weighted by steps; None without timings."""
    rows = []
    for t in timings:
        fixed, variable = _split_step(model, t, d)
        if t.step_s > 0 and fixed + variable > 0:
            rows.append((fixed / t.step_s, variable / t.step_s, math.sqrt(min(t.steps, 64))))
    if not rows:
        return None
    shares = [f / (f + v) for f, v, _ in rows if f + v > 0]
    distinct = len(rows) >= 2 and min(shares) > 0 and max(shares) / min(shares) >= DISTINCT_SHARES
    if distinct:
        import numpy as np
        from scipy.optimize import nnls

        A = np.array([[f * w, v * w] for f, v, w in rows])
        b = np.array([w for _, _, w in rows])
        (a, c), _ = nnls(A, b)
        if a > 0 and c > 0:
            return _clamp(float(a)), _clamp(float(c))
    # one scale s minimizing sum w^2 (s p - 1)^2, p = predicted / measured
    num = sum(w * w * (f + v) for f, v, w in rows)
    den = sum(w * w * (f + v) ** 2 for f, v, w in rows)
    s = _clamp(num / den) if den > 0 else 1.0
    return s, s


def fit_memory_scale(model: CostModel, footprints: Sequence[PackFootprint], d: int = 1) -> float | None:
    """The scale of the model's per-adapter memory that covers every measured footprint (the
    largest ratio of measured to predicted over the base); None without a footprint that can
    tell. A footprint of which less than `TELLING_SHARE` lies beyond the prior's base says
    more of the base (weights, context, allocator slack) than of the adapters: a small pack
    under an overestimated base would read as almost no memory per adapter, and plan packs
    that do not fit. The scale stays at least `MIN_MEMORY_SCALE`."""
    ratios = []
    m = model.memory_coeffs[d]
    for f in footprints:
        priced = replace(model, memory_row_tokens=float(f.row_tokens), eval_load=None)
        adapters = priced.memory(f.loads(), d) - m.base
        beyond = f.device_bytes - m.base  # what the footprint holds beyond the prior's base
        if adapters > 0 and beyond >= TELLING_SHARE * f.device_bytes:
            ratios.append(beyond / adapters)
    if not ratios:
        return None
    return min(SCALE_RANGE[1], max(MIN_MEMORY_SCALE, max(ratios)))


def job_terms_runs(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job runs to fit the job terms from: the warm ones where there are any; else the cold
    ones (a model's first sweep on a machine, ``cold``) without what only a first sweep pays:
    its first step's kernel compilation (the first step counts as long as a later pack's
    first step) and its first eval's (left out where the job has another)."""
    warm = [r for r in runs if not r.get("cold")]
    if warm:
        return warm
    out = []
    for r in runs:
        phases = [dict(p) for p in r.get("phases", [])]
        if phases and int(phases[0].get("steps", 0)) >= 2:
            first = phases[0]
            steady = float(first["rest_s"]) / (int(first["steps"]) - 1)
            later = [float(p["first_s"]) - float(p["rest_s"]) / (int(p["steps"]) - 1)
                     for p in phases[1:] if int(p.get("steps", 0)) >= 2 and not p.get("reused")]
            first["first_s"] = steady + (max(0.0, max(later)) if later else 0.0)
        evals = list(r.get("evals", []))
        out.append({**r, "phases": phases, "evals": evals[1:] if len(evals) > 1 else evals})
    return out


@dataclass
class Calibration:
    """A sweep's measurements of its model on this machine, and the cost model they make."""

    timings: list[PackTiming] = field(default_factory=list)
    footprints: list[PackFootprint] = field(default_factory=list)
    #: finished jobs' phases (summary.json), for the job terms
    job_runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.timings or self.footprints or self.job_runs)

    def add(self, timings: Iterable[PackTiming] = (), footprints: Iterable[PackFootprint] = (),
            job_runs: Iterable[dict[str, Any]] = ()) -> None:
        self.timings = (self.timings + list(timings))[-MAX_SAMPLES:]
        self.footprints = (self.footprints + list(footprints))[-MAX_SAMPLES:]
        self.job_runs = (self.job_runs + [r for r in job_runs if r])[-64:]

    def merged(self, other: "Calibration") -> "Calibration":
        out = Calibration(list(self.timings), list(self.footprints), list(self.job_runs))
        out.add(other.timings, other.footprints, other.job_runs)
        return out

    def apply(self, prior: CostModel, d: int = 1, loads: Sequence[AdapterLoad] = ()) -> CostModel:
        """The prior corrected by these measurements (see the module docstring); where a kind of
        measurement is missing, that part of the prior is left as it is (its memory, then, counted
        `MEMORY_MARGIN` times, or less where the sweep's ``loads`` need it: `conservative`)."""
        model = prior
        info: dict[str, Any] = {"timings": len(self.timings), "footprints": len(self.footprints),
                                "jobs": len(self.job_runs)}
        if d in prior.time and not prior.host_time:
            scales = fit_time_scales(prior, self.timings, d)
            if scales is not None:
                a, b = scales

                def scale(c: TimeCoeffs) -> TimeCoeffs:
                    return TimeCoeffs(c.c0 * a, c.c_tok * b, c.c_rtok * b, c.c_ad * a, c.c_bkt * a)

                model = replace(model, time={k: scale(c) for k, c in model.time.items()})
                info["time_scales"] = [a, b]
        elif self.timings:  # a measured model (host and GPU pieces): one scale for all
            predicted = sum(prior.for_rows(t.row_tokens).step_time(t.loads(), d) * t.steps for t in self.timings)
            measured = sum(t.step_s * t.steps for t in self.timings)
            if predicted > 0:
                s = _clamp(measured / predicted)
                model = prior.scaled(s)
                info["time_scales"] = [s, s]
        mem = fit_memory_scale(prior, self.footprints, d) if d in prior.memory_coeffs else None
        if mem is not None:
            model = adapter_memory_scaled(model, mem)
            info["memory_scale"] = mem
        elif is_analytic(prior):
            model = conservative(model, loads=loads)  # (the planner's load factor: the default)
        if self.job_runs:
            try:
                model = model.with_overheads(fit_overheads(job_terms_runs(self.job_runs)))
            except ValueError:
                pass
        return model.with_meta(calibration=info)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "plora.calibration/v1", "timings": [t.to_dict() for t in self.timings],
                "footprints": [f.to_dict() for f in self.footprints], "job_runs": self.job_runs}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Calibration":
        if d.get("kind") != "plora.calibration/v1":
            raise ValueError("not a plora calibration")
        return cls([PackTiming.from_dict(t) for t in d.get("timings", [])],
                   [PackFootprint.from_dict(f) for f in d.get("footprints", [])],
                   [r for r in d.get("job_runs", []) if isinstance(r, dict)])



class SweepCalibrator:
    """A running sweep's calibration: the samples it started with (cached, or a quick
    calibration's) and those its jobs report as they train, the cost model they make, and
    whether the plan of the jobs not started yet has drifted from it.

    ``prior``: the model the measurements correct (the analytic prior, or a profile: then
    only its time is rescaled); ``planned``: the model the current plan was made with."""

    def __init__(self, prior: CostModel, base: Calibration | None = None, *, planned: CostModel | None = None,
                 load: Callable[[str], AdapterLoad] | None = None, loads: Sequence[AdapterLoad] = (),
                 seq_len: int | None = None, threshold: float = 0.25, load_factor: float = 0.9, d: int = 1):
        self.prior = prior
        self.load = load
        self.loads = list(loads)  # the sweep's adapters: an uncalibrated margin still places each
        self.base = base or Calibration()
        self.seq_len = int(seq_len if seq_len is not None else prior.seq_len)
        self.threshold = float(threshold)
        self.load_factor = float(load_factor)
        self.d = d
        self._running: dict[str, tuple[list[PackTiming], list[PackFootprint]]] = {}
        self._finished = Calibration()
        self._model: CostModel | None = None
        self.planned = planned if planned is not None else self.model()

    @property
    def measured(self) -> bool:
        """Whether any of this sweep's own jobs has reported a sample yet."""
        return any(t or f for t, f in self._running.values()) or not self._finished.empty

    def observe(self, job_id: str, phases: Any, tp: int = 1) -> bool:
        """A running job's phases so far (its progress.json); True when they added samples.
        Only jobs at the degree the samples are fitted at (``d``) count: a TP job's footprint
        per GPU is another model's."""
        if not isinstance(phases, list) or int(tp) != self.d:
            return False
        samples = samples_from_phases(phases, self.seq_len)
        if samples == self._running.get(job_id, ([], [])):
            return False
        self._running[job_id] = samples
        self._model = None
        return True

    def job_finished(self, job_id: str, run: dict[str, Any] | None, tp: int = 1) -> None:
        """A job's summary phases (`plora.job.phases.read_phases`): its samples, final, and its
        job terms (a job at another TP degree than ``d``: none)."""
        self._running.pop(job_id, None)
        if run and int(tp) == self.d:
            timings, footprints = samples_from_phases(run.get("phases", []), self.seq_len)
            if not self.base.job_runs:  # the first sweep of the model here: its kernels compiled then
                run = {**run, "cold": True}
            self._finished.add(timings, footprints, [run])
        self._model = None

    def calibration(self) -> Calibration:
        """Every sample: the base's, finished jobs' and running jobs' (what the cache keeps)."""
        out = self.base.merged(self._finished)
        for timings, footprints in self._running.values():
            out.add(timings, footprints)
        return out

    def model(self) -> CostModel:
        """The prior corrected by every sample so far."""
        if self._model is None:
            cal = self.calibration()
            if not cal.empty:
                self._model = cal.apply(self.prior, self.d, self.loads)
            elif is_analytic(self.prior):
                self._model = conservative(self.prior, loads=self.loads, load_factor=self.load_factor)
            else:
                self._model = self.prior
        return self._model

    def describe(self) -> str:
        """One line on what the calibration has measured so far ("" before anything)."""
        if not self.measured:
            return ""
        info = self.model().meta.get("calibration", {})
        parts = []
        if "time_scales" in info:  # rounded to a tenth: the line changes when the model does
            a, b = info["time_scales"]
            parts.append(f"steps {a:.1f}x/{b:.1f}x the prior's (per step/per token)")
        if "memory_scale" in info:
            parts.append(f"memory {info['memory_scale']:.1f}x")
        return "calibrated from this sweep's jobs: " + ", ".join(parts) if parts else ""

    def drift(self, jobs: Sequence[tuple[Sequence[str], int]]) -> str | None:
        """Why the jobs not started yet (their adapters' ids and TP degree) should be planned
        again with `model` (their time moved past the threshold; one no longer fits; or they
        would fit in far less memory than planned), or None (also without `load`, which
        tells an adapter's load by its id)."""
        if not jobs or not self.measured or self.load is None:
            return None
        jobs = [([self.load(a) for a in adapters], tp) for adapters, tp in jobs]
        now, then = self.model(), self.planned
        new = sum(now.job_time(list(loads), tp) for loads, tp in jobs if tp in now.time)
        old = sum(then.job_time(list(loads), tp) for loads, tp in jobs if tp in then.time)
        if old > 0 and abs(new / old - 1.0) > self.threshold:
            return f"measured steps take {new / old:.2f}x the plan's"
        for loads, tp in jobs:
            if tp in now.time and not now.fits(list(loads), tp, self.load_factor):
                return "a waiting job does not fit the measured memory"
        room_now = [now.memory(list(loads), tp) for loads, tp in jobs if tp in now.time]
        room_then = [then.memory(list(loads), tp) for loads, tp in jobs if tp in then.time]
        if room_now and sum(room_then) > (1.0 + 2 * self.threshold) * sum(room_now):
            return "the measured memory holds larger packs than planned"
        return None

    def planned_with(self, model: CostModel) -> None:
        """The jobs not started yet were planned again with ``model``."""
        self.planned = model
