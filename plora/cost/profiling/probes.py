"""Probe jobs: which packs the profiler measures, and what one of them measured.

* **Probe sizes** come from two small calibration probes: their memory gives the bytes per
  row, and the largest probes are sized to about 70% of the usable memory, so the fit
  covers the range the planner will use without running near the limit.
* **Near the limit.** Once a first fit exists, its memory model places the largest packs:
  `fill_probes` are measured for the fit, `limit_probes` check that a predicted fit fits.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from plora.cost.model import AdapterLoad, CostModel
from plora.cost.profiling.errors import ProfileError

#: ranks that probes and validation packs draw from
RANKS = (8, 16, 32, 64, 128)
#: the largest probes are sized to this share of the usable memory (load factor x total),
#: by the bytes per row of the two calibration probes: a rough estimate (on the 7B shape, a
#: pack of 16 mixed ranks came out 14% over it), so it stays well short of the limit
PROBE_MEMORY_SHARE = 0.7
#: "fill" probes, sized by the first fit's memory model (within 1-2% on the GPU) to this
#: share of the usable memory, then part of the final fit. The planner fills GPUs to the
#: load factor; a step-time fit that stops at 0.7 extrapolates the GPU piece from packs
#: that are partly launch-bound (H200, 0.5B shape: packs at the limit under-predicted by up
#: to 26%; refitted with one such pack among the probes, 15%).
FILL_SHARE = 0.97
#: rows of the largest probe when memory cannot say (CPU)
CPU_MAX_ROWS = 8


@dataclass(frozen=True)
class Probe:
    """One packed job to measure: adapter k has rank ``ranks[k]`` and ``batch_sizes[k]`` rows."""

    name: str
    ranks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    role: str = "fit"  # fit | holdout | limit

    def __post_init__(self) -> None:
        if not self.ranks or len(self.ranks) != len(self.batch_sizes):
            raise ValueError(f"probe {self.name}: one batch size per rank, at least one adapter")
        if min(self.ranks) < 1 or min(self.batch_sizes) < 1:
            raise ValueError(f"probe {self.name}: ranks and batch sizes must be positive")

    @property
    def adapters(self) -> int:
        return len(self.ranks)

    @property
    def rows(self) -> int:
        return sum(self.batch_sizes)

    @property
    def rank_sum(self) -> int:
        return sum(self.ranks)

    def tokens(self, seq_len: int) -> int:
        return self.rows * seq_len

    def rank_tokens(self, seq_len: int) -> int:
        return sum(r * b for r, b in zip(self.ranks, self.batch_sizes)) * seq_len

    def loads(self) -> list[AdapterLoad]:
        return [AdapterLoad(f"{self.name}-{k}", r, b, 1) for k, (r, b) in enumerate(zip(self.ranks, self.batch_sizes))]

    def label(self) -> str:
        """``K=4 r=8,32,64,128 bs=2,2,2,2``, runs of equal values folded (``r=16x8``)."""
        return f"K={self.adapters} r={_fold(self.ranks)} bs={_fold(self.batch_sizes)}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ranks": list(self.ranks), "batch_sizes": list(self.batch_sizes), "role": self.role}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Probe":
        return cls(str(d["name"]), tuple(int(r) for r in d["ranks"]), tuple(int(b) for b in d["batch_sizes"]),
                   str(d.get("role", "fit")))


def _fold(values: Sequence[int]) -> str:
    if len(set(values)) == 1 and len(values) > 1:
        return f"{values[0]}x{len(values)}"
    return ",".join(str(v) for v in values)


def calibration_probes() -> list[Probe]:
    """Two small probes that size the others (and are part of the fit)."""
    return [Probe("cal-1", (16,), (1,)), Probe("cal-2", (16, 64), (2, 2))]


def fit_probes(rows: int, kmax: int = 16) -> list[Probe]:
    """Probes whose total rows, Σ rank·rows, Σ rank and adapter count vary independently.

    ``rows`` is the total of the largest probes; adapter counts are capped by it as well,
    since a pack never holds more adapters than rows.
    """
    R = max(1, int(rows))
    k_many = max(2, min(int(kmax), max(R, 2)))
    k_mid = max(2, min(8, k_many))

    def bs(total: float, k: int) -> int:
        return max(1, round(total / k))

    mixed = (8, 32, 64, 128)
    probes = [
        Probe("rows-r8", (8,), (R,)),
        Probe("rows-r128", (128,), (bs(R / 2, 1),)),
        Probe(f"k{k_mid}-r8", (8,) * k_mid, (bs(R, k_mid),) * k_mid),
        Probe("k2-r128", (128, 128), (bs(R / 2, 2),) * 2),
        Probe(f"k{k_many}-r16", (16,) * k_many, (1,) * k_many),
        Probe("k4-mixed", mixed, (bs(R, 4),) * 4),
        Probe(f"k{k_mid}-small", tuple((8, 16, 32, 64)[i % 4] for i in range(k_mid)), (1,) * k_mid),
        # between the launch-bound small packs and the GPU-bound large ones: where the two
        # step-time pieces meet (`fit_step_time`)
        Probe("rows-r64-q", (64,), (bs(R / 4, 1),)),
        Probe(f"k{k_many}-mixed", tuple((8, 16, 32, 64, 128)[i % 5] for i in range(k_many)), (bs(R, k_many),) * k_many),
        Probe("k4-mixed-h", mixed, (bs(R / 2, 4),) * 4),
        Probe(f"k{k_mid}-r32-h", (32,) * k_mid, (bs(R / 2, k_mid),) * k_mid),
        # small packs of several buckets: the host piece's per-adapter and per-bucket costs
        Probe("k4-mixed-small", mixed, (1,) * 4),
        Probe("k2-spread", (8, 128), (1, 1)),
    ]
    seen: set[tuple] = set()  # few rows make some of them the same pack: run it once
    unique = []
    for p in probes:
        if (p.ranks, p.batch_sizes) not in seen:
            seen.add((p.ranks, p.batch_sizes))
            unique.append(p)
    return unique


def holdout_probes(rows: int, kmax: int = 16, n: int = 4, seed: int = 0) -> list[Probe]:
    """Validation packs, none of them a fit probe: one small single-adapter job, then
    seeded random mixes of ranks and batch sizes over the probes' range of rows."""
    R = max(1, int(rows))
    rng = random.Random(seed)
    out = [Probe("ho-1", (32,), (max(1, R // 4),), role="holdout")]
    k_hi = max(2, min(int(kmax), max(R, 2)))
    for i in range(2, n + 1):
        k = rng.randint(2, k_hi)
        target = rng.uniform(0.3, 1.0) * R
        ranks = tuple(rng.choice(RANKS) for _ in range(k))
        sizes = tuple(max(1, round(target / k * rng.choice((0.5, 1.0, 1.5)))) for _ in range(k))
        out.append(Probe(f"ho-{i}", ranks, sizes, role="holdout"))
    return out[:n]


def limit_probes(cm: CostModel, load_factor: float, kmax: int = 16, d: int = 1) -> list[Probe]:
    """Packs that the model predicts *just* fit: the fullest a planner would form.

    Adapters of mixed ranks start at one row each; rows are then added one adapter at a
    time while ``cm.fits`` still holds, so the prediction ends within one row of
    ``load_factor x gpu_memory``. Running them shows whether a predicted fit really fits.
    """
    shapes = (("limit-mixed", (8, 16, 32, 64, 128, 16, 32, 64)[: max(1, min(8, kmax))]), ("limit-r128", (128, 64)))
    return [p for name, ranks in shapes if (p := _filled(cm, name, ranks, load_factor, d, "limit")) is not None]


def fill_probes(cm: CostModel, load_factor: float, kmax: int = 16, d: int = 1,
                max_rows: int | None = None) -> list[Probe]:
    """Fit probes that fill `FILL_SHARE` of the usable memory by ``cm``'s prediction: the
    large packs the planner forms, measured rather than extrapolated to. Their ranks differ
    from the `limit_probes`, which stay validation packs. ``max_rows`` caps them (CPU)."""
    shapes = (("fill-r32", (32,)), ("fill-k4", (16, 32, 64, 128)[: max(1, min(4, kmax))]))
    return [p for name, ranks in shapes
            if (p := _filled(cm, name, ranks, load_factor * FILL_SHARE, d, "fit", max_rows)) is not None]


def _filled(cm: CostModel, name: str, ranks: Sequence[int], load_factor: float, d: int, role: str,
            max_rows: int | None = None) -> Probe | None:
    """The pack of these ranks (as many as fit at one row each) with the most rows that
    ``cm`` predicts fit at ``load_factor``: uniform batch sizes, then one more row for as
    many adapters as still fit (at most ``max_rows`` in all)."""
    ranks = tuple(ranks)
    k = len(ranks)
    while k > 0 and not _fits(cm, ranks[:k], (1,) * k, load_factor, d):
        k -= 1
    if k == 0:
        return None
    ranks = ranks[:k]
    total = 1 << 20 if max_rows is None else max(k, int(max_rows))

    def ok(sizes) -> bool:
        return sum(sizes) <= total and _fits(cm, ranks, tuple(sizes), load_factor, d)

    lo, hi = 1, 2
    while ok((hi,) * k):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # largest uniform batch that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok((mid,) * k) else (lo, mid)
    sizes = [lo] * k
    for i in range(k):  # then one more row for as many adapters as still fit
        trial = sizes.copy()
        trial[i] += 1
        if not ok(trial):
            break
        sizes = trial
    return Probe(name, ranks, tuple(sizes), role=role)


def _fits(cm: CostModel, ranks, sizes, load_factor: float, d: int) -> bool:
    return cm.fits(Probe("x", tuple(ranks), tuple(sizes)).loads(), d, load_factor)


@dataclass
class Measurement:
    """Step times and peak memory of one probe job."""

    probe: Probe
    seq_len: int
    step_times: list[float] = field(default_factory=list)
    #: the job's peak memory: CUDA reserved peak + context (GPU), resident set peak (CPU)
    peak_bytes: float = 0.0
    allocated_peak: float | None = None
    reserved_peak: float | None = None
    context_bytes: float = 0.0
    build_s: float = 0.0
    oom: bool = False
    error: str = ""

    @property
    def step_time(self) -> float:
        """Interquartile mean of the timed steps: robust to a few slow or fast steps like the
        median, steadier than it on the noisy launch-bound steps of small packs."""
        if not self.step_times:
            return float("nan")
        ts = sorted(self.step_times)
        cut = len(ts) // 4
        return statistics.fmean(ts[cut: len(ts) - cut])

    @property
    def allocated_bytes(self) -> float | None:
        """Allocated (not reserved) peak plus context: the footprint without fragmentation."""
        return None if self.allocated_peak is None else self.allocated_peak + self.context_bytes

    @property
    def ok(self) -> bool:
        return not self.oom and not self.error and bool(self.step_times) and self.peak_bytes > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "probe": self.probe.to_dict(),
            "seq_len": self.seq_len,
            "step_time": None if not self.step_times else self.step_time,
            "step_times": self.step_times,
            "peak_bytes": self.peak_bytes,
            "allocated_peak": self.allocated_peak,
            "reserved_peak": self.reserved_peak,
            "context_bytes": self.context_bytes,
            "build_s": self.build_s,
            "oom": self.oom,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measurement":
        return cls(
            probe=Probe.from_dict(d["probe"]),
            seq_len=int(d["seq_len"]),
            step_times=[float(t) for t in d.get("step_times", [])],
            peak_bytes=float(d.get("peak_bytes", 0.0)),
            allocated_peak=d.get("allocated_peak"),
            reserved_peak=d.get("reserved_peak"),
            context_bytes=float(d.get("context_bytes", 0.0)),
            build_s=float(d.get("build_s", 0.0)),
            oom=bool(d.get("oom", False)),
            error=str(d.get("error", "")),
        )


def _calibrated_memory(cal: Sequence[Measurement]) -> tuple[float, float] | None:
    """(base bytes, bytes per row) from the two calibration probes, where the allocator's
    numbers are known (GPU); None otherwise."""
    a, b = cal[0], cal[1]
    if not (a.ok and b.ok and a.reserved_peak is not None):
        return None
    return a.peak_bytes, max((b.peak_bytes - a.peak_bytes) / max(1, b.probe.rows - a.probe.rows), 1.0)


def _probe_rows(cal: Sequence[Measurement], usable_bytes: float, seq_len: int, max_rows: int | None) -> int:
    """Rows of the largest probes: about `PROBE_MEMORY_SHARE` of the usable memory, by the
    bytes per row the two calibration probes show (capped by ``max_rows``)."""
    rows = max_rows
    memory = _calibrated_memory(cal)
    if memory is not None:
        base, per_row = memory
        if base > usable_bytes:
            raise ProfileError(f"the base model alone needs {base / 2**30:.1f} GiB, more than "
                               f"{usable_bytes / 2**30:.1f} GiB usable")
        fit_rows = int((PROBE_MEMORY_SHARE * usable_bytes - base) // per_row) + 1
        rows = fit_rows if rows is None else min(rows, fit_rows)
    return max(1, int(rows if rows is not None else CPU_MAX_ROWS))


def far_from_limit(cal: Sequence[Measurement], rows: int, usable_bytes: float, share: float = 0.5) -> bool:
    """Whether ``rows`` rows stay within ``share`` of the usable memory, by the calibration
    probes' bytes per row (the estimate `_probe_rows` sizes the probes with)."""
    memory = _calibrated_memory(cal)
    if memory is None:
        return False
    base, per_row = memory
    return base + per_row * rows < share * usable_bytes


def sweep_pack_rows(spec) -> int:
    """The most rows one job of this sweep can hold: the largest batch sizes of as many
    configurations as a job may pack. Probes beyond it measure packs the planner never forms."""
    sizes = sorted((c.batch_size for c in spec.expand()), reverse=True)
    return max(1, sum(sizes[: max(1, int(spec.planner.max_adapters_per_job))]))
