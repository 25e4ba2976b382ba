"""Memory and step-time model of packed LoRA jobs.

The planner needs two numbers for any candidate job -- a set of adapters trained
together on one base-model copy at tensor-parallel (TP) degree ``d``: its peak
memory per GPU and its time. Both are kept *linear in the adapters* on purpose (the
step time at most a maximum of two linear forms, below): the planner's integer program
can then express them, and a profiler can refit the coefficients by least squares from
a handful of probe jobs without touching the planner.

Memory (PLoRA, Appendix B), per GPU at TP degree d::

    M(J, d) = base[d] + sum_k ( adapter[d] + rank[d]*r_k
                                + tok[d]*bs_k*seq + rank_tok[d]*r_k*bs_k*seq )

``base`` holds the sharded frozen weights plus a fixed overhead (CUDA context,
allocator slack, communication buffers); ``rank`` the LoRA parameters, their
gradients and AdamW state per unit of rank; ``tok`` the base-model activations
of one token of the adapter's rows; ``rank_tok`` the LoRA activations.

Step time, per packed step::

    t(J, d) = c0[d] + c_tok[d]*sum_k bs_k*seq + c_rtok[d]*sum_k r_k*bs_k*seq + c_ad[d]*K
              + c_bkt[d]*B(J)

``B(J)`` is the number of distinct rank buckets among the pack's adapters (`rank_bucket`):
the packed kernels launch once per bucket, stage and layer, so each bucket adds a fixed
cost to every step (the host side of its launches), whatever its adapters' tokens.

A profiled model may add a second, *host* piece of the same form (``host_time``): the
time the host takes to issue the step's kernels, which does not grow with tokens. The GPU
runs behind the host, so a step takes the longer of the two::

    t(J, d) = max(gpu(J, d), host(J, d))

Small packs are host-bound (flat in tokens), large ones GPU-bound; one linear form
cannot follow both (its error on H200 probes reached 20-30%). The maximum of two linear
forms is still convex and piecewise linear: the planner's integer program takes each phase
of a job at least as long as every piece (`plora.planner.ilp.job_time_model`), which is
exact once it minimises the time.

A job trains every adapter for its own number of steps and an adapter leaves the
pack when it is done, so the step gets cheaper as the job goes on (``job_time``). With
measured job terms (``overheads``, `plora.cost.job`) a job also pays its start, load and
first step once, a graph capture whenever the pack changes, and the packed eval and save of
the adapters leaving at each step count (``eval_load``: the sweep's eval rows); while those
are evaluated, the job's memory is its weights, the adapters' state and the eval batch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from collections.abc import Iterator, Mapping
from typing import Any, Iterable, Sequence

from plora.data.accumulation import accumulation_steps, micro_rows
from plora.cost.job import EvalLoad, JobOverheads
from plora.models.families.targets import resolve_lora_targets
from plora.models.shape import ModelShape
from plora.spec.defaults import EVAL_BATCH_ROWS
from plora.quantize.cost import base_weight_bytes, dequant_step_bytes, dequant_workspace_bytes

__all__ = [
    "AdapterLoad",
    "rank_bucket",
    "CostMeta",
    "CostModel",
    "MemoryCoeffs",
    "ModelShape",
    "TimeCoeffs",
    "resolve_lora_targets",
]

#: hidden-size activations an eval token holds in the live layer (residual, norms, attention, MLP)
EVAL_HIDDEN_COPIES = 16
#: what the eval's LM head holds at once, whatever the batch: one chunk of float32 logits
#: (`plora.train.packed.head_loss` cuts its chunks by this bound; the head never makes a batch's
#: full logits)
EVAL_HEAD_BYTES = 256 * 2**20

def rank_bucket(rank: int) -> int:
    """The kernels' launch group of a rank: the next power of two, at least 16
    (`plora.kernels.rank_bucket`, repeated here so the cost model needs no torch)."""
    b = 16
    while b < rank:
        b *= 2
    return b


def num_buckets(ranks: Iterable[int]) -> int:
    return len({rank_bucket(int(r)) for r in ranks})


@dataclass(frozen=True)
class AdapterLoad:
    """What planning needs of one adapter: its size (rank), rows per step and step count."""

    id: str
    rank: int
    batch_size: int
    steps: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AdapterLoad":
        return cls(id=str(d["id"]), rank=int(d["rank"]), batch_size=int(d["batch_size"]), steps=int(d["steps"]))


def packed_load(adapter_id: str, rank: int, batch_size: int, steps: int, micro_batch_size: int | None) -> AdapterLoad:
    """What planning sees of an adapter of effective batch ``batch_size`` and ``steps``
    optimizer steps: the rows it puts in one packed step and the packed steps it takes
    (`plora.data.accumulation`), so that memory fits by its micro-batch and time counts every part."""
    parts = accumulation_steps(batch_size, micro_batch_size)
    return AdapterLoad(adapter_id, int(rank), micro_rows(batch_size, micro_batch_size), int(steps) * parts)


@dataclass(frozen=True)
class TimeCoeffs:
    """Step-time coefficients at one TP degree (seconds; per step, per token, per rank*token,
    per adapter, per rank bucket)."""

    c0: float
    c_tok: float
    c_rtok: float
    c_ad: float
    c_bkt: float = 0.0


@dataclass(frozen=True)
class MemoryCoeffs:
    """Peak-memory coefficients per GPU at one TP degree (bytes; see the module docstring)."""

    base: float
    adapter: float
    rank: float
    tok: float
    rank_tok: float


#: CostMeta's typed keys, in the order profile.json writes them
_META_FIELDS = (
    "source", "plan_source", "name", "shape", "targets", "device", "backend", "dtype", "seq_len", "warmup", "iters",
    "probe_rows", "sized_by", "measured_degrees", "extrapolated_degrees", "step_time_pieces", "probes_used",
    "calibration", "memory_margin", "time_scale", "job_terms", "job_overhead", "job_overhead_measured",
    "profiling_s", "holdout",
)


@dataclass(frozen=True)
class CostMeta(Mapping[str, Any]):
    """Where a cost model comes from and what was done to it, typed: what ``profile.json``
    keeps under ``meta``. Frozen like the model: `with_` gives a changed copy. Read as a
    mapping (``meta["source"]``, ``meta.get("calibration")``) it holds the keys that are set
    (not None), and ``extra`` holds any other key a profile carries (how it was measured:
    device FLOPs, fit errors...), kept as it was."""

    #: "analytic", "profile" or "cpu prior"
    source: str | None = None
    #: what the sweep planned with, in words (`plora.sweep`)
    plan_source: str | None = None
    name: str | None = None
    #: `plora.models.shape.ModelShape.to_dict` of the model it prices
    shape: dict[str, Any] | None = None
    targets: list[str] | None = None
    device: str | None = None
    backend: str | None = None
    dtype: str | None = None
    seq_len: int | None = None
    warmup: int | None = None
    iters: int | None = None
    #: the rows of the largest probes, and what sized them ("rows": the sweep's largest pack; "memory")
    probe_rows: int | None = None
    sized_by: str | None = None
    measured_degrees: list[int] | None = None
    extrapolated_degrees: list[int] | None = None
    step_time_pieces: int | None = None
    probes_used: int | None = None
    #: what calibration changed (`plora.cost.profiling.calibrate.Calibration.apply`)
    calibration: dict[str, Any] | None = None
    memory_margin: float | None = None
    time_scale: float | None = None
    job_terms: dict[str, Any] | None = None
    #: {"measured_s", "jobs", "at"}: the job overhead learned from finished sweeps
    job_overhead: dict[str, Any] | None = None
    job_overhead_measured: bool | None = None
    profiling_s: float | None = None
    #: predicted against measured on held-out packs (`plora.cost.profiling.record.Profile.summary`)
    holdout: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "CostMeta":
        if isinstance(data, CostMeta):
            return data
        data = dict(data or {})
        typed = {k: data.pop(k) for k in _META_FIELDS if k in data}
        return cls(**typed, extra=data)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.items())

    def with_(self, **changes: Any) -> "CostMeta":
        """A copy with ``changes`` (a key outside the typed ones goes to ``extra``)."""
        typed = {k: v for k, v in changes.items() if k in _META_FIELDS}
        other = {k: v for k, v in changes.items() if k not in _META_FIELDS}
        return replace(self, **typed, extra={**self.extra, **other}) if other else replace(self, **typed)

    def only(self, keys: Sequence[str]) -> "CostMeta":
        """A copy keeping ``keys`` alone."""
        return CostMeta.from_dict({k: v for k, v in self.items() if k in keys})

    def __getitem__(self, key: str) -> Any:
        if key in _META_FIELDS:
            value = getattr(self, key)
            if value is None:
                raise KeyError(key)
            return value
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in _META_FIELDS if getattr(self, k) is not None)
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass(frozen=True)
class CostModel:
    """Linear memory and (piecewise-)linear time model of packed jobs, one set of
    coefficients per TP degree.

    ``time`` and ``memory`` are keyed by TP degree; a degree missing from them is one
    the model cannot run at. Frozen (the planner caches values derived from a model): a
    changed model is a copy (`dataclasses.replace`, `with_meta`, `for_rows`...).
    """

    gpu_memory_bytes: float
    seq_len: int
    time: dict[int, TimeCoeffs]
    memory_coeffs: dict[int, MemoryCoeffs]
    name: str = ""
    meta: CostMeta = field(default_factory=CostMeta)
    job_overhead_s: float = 0.0  # process start, imports, model load: paid once per job
    #: the host piece per TP degree (empty: the step is the GPU piece alone)
    host_time: dict[int, TimeCoeffs] = field(default_factory=dict)
    #: measured job terms (start, load, captures, eval, saves); None: ``job_overhead_s`` alone
    overheads: JobOverheads | None = None
    #: the sweep's eval per adapter (set per sweep, `for_eval`); None: evals are not priced
    eval_load: EvalLoad | None = None
    #: mean real tokens of the sweep's training rows (set per sweep, `for_rows`): what a step
    #: without padding costs per row; None: every row costs ``seq_len`` (the probes' rows).
    #: Memory keeps ``seq_len``: a step may draw the longest rows.
    row_tokens: float | None = None
    #: the most tokens a row takes in a step of the sweep (its longest row, padded as its
    #: steps pad; in balanced batches, a row's share of the largest segment), set per sweep
    #: (`for_rows`): what memory counts a row at; None: ``seq_len``
    memory_row_tokens: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.meta, CostMeta):  # a plain mapping given (tests, older callers): typed here
            object.__setattr__(self, "meta", CostMeta.from_dict(self.meta))
        if set(self.time) != set(self.memory_coeffs):
            raise ValueError("time and memory coefficients must cover the same TP degrees")
        if not self.time:
            raise ValueError("a cost model needs at least one TP degree")
        if not set(self.host_time) <= set(self.time):
            raise ValueError("host time coefficients at a TP degree without GPU time coefficients")

    # ---- the linear pieces (what the planner's ILP uses) -------------------------------
    @property
    def degrees(self) -> tuple[int, ...]:
        """TP degrees the model can run at, ascending."""
        return tuple(sorted(self.time))

    def memory_base(self, d: int) -> float:
        """Bytes per GPU of a job before any adapter is added."""
        return self.memory_coeffs[d].base

    def memory_per_adapter(self, a: AdapterLoad, d: int) -> float:
        """Bytes per GPU that adapter ``a`` adds to any job at degree ``d``."""
        m, tok = self.memory_coeffs[d], a.batch_size * self.memory_tokens
        return m.adapter + m.rank * a.rank + m.tok * tok + m.rank_tok * a.rank * tok

    @property
    def memory_tokens(self) -> float:
        """Tokens memory counts a row at (`memory_row_tokens`, at most ``seq_len``)."""
        if self.memory_row_tokens is None:
            return float(self.seq_len)
        return min(float(self.memory_row_tokens), float(self.seq_len))

    def step_base(self, d: int) -> float:
        """Seconds of a packed step that do not depend on the adapters in it."""
        return self.time[d].c0

    def step_per_adapter(self, a: AdapterLoad, d: int) -> float:
        """Seconds that adapter ``a`` adds to every step it takes part in (the GPU piece)."""
        return self.piece_per_adapter(self.time[d], a)

    # ---- the contract -------------------------------------------------------------------
    def memory(self, adapters: Sequence[AdapterLoad], d: int) -> float:
        """Peak bytes per GPU of a job at TP degree ``d``: its training peak, or its eval's
        where that is larger (`eval_memory`)."""
        train = self.memory_base(d) + sum(self.memory_per_adapter(a, d) for a in adapters)
        return max(train, self.eval_memory(adapters, d))

    def eval_memory(self, adapters: Sequence[AdapterLoad], d: int) -> float:
        """Peak bytes per GPU while adapters leaving together are evaluated: the weights, every
        adapter's parameters and AdamW state, one eval batch's activations (training
        activations are gone by then) of `eval_bytes_per_token` a token, and one head chunk
        (the loss and the next-token choice read the LM head chunk by chunk, never a
        batch's full logits). The batch holds at most ``batch_rows`` rows, and no more than
        the eval memory budget where one is set. 0 when the sweep's eval is not known.
        A GPU's larger row cap (`plora.spec.defaults.EVAL_BATCH_ROWS_GPU`) only takes what is
        free when the eval runs (half of it: `plora.results.evaluate.eval_token_budget`), so
        the batch is priced at the CPU's cap, the rows an eval needs to run as it used to."""
        ev = self.eval_load
        if ev is None or ev.samples <= 0 or not adapters:
            return 0.0
        m = self.memory_coeffs[d]
        state = sum(m.adapter + m.rank * a.rank for a in adapters)
        groups: dict[int, int] = {}
        for a in adapters:
            groups[a.steps] = groups.get(a.steps, 0) + 1
        rows = min(ev.batch_rows, EVAL_BATCH_ROWS, max(groups.values()) * ev.samples)
        batch = self.eval_bytes_per_token(d) * rows * ev.row_tokens + (EVAL_HEAD_BYTES if self._shaped else 0.0)
        if ev.budget_bytes is not None:
            batch = min(batch, float(ev.budget_bytes))
        return self.memory_base(d) + state + batch

    def step_per_bucket(self, d: int) -> float:
        """Seconds each distinct rank bucket in a pack adds to every step."""
        return self.time[d].c_bkt

    def pieces(self, d: int) -> tuple[TimeCoeffs, ...]:
        """The linear step-time forms at degree ``d`` whose maximum is the step time: the
        GPU piece first (``step_base``, ``step_per_adapter``, ``step_per_bucket`` are its
        terms), then the host piece when there is one."""
        return (self.time[d], self.host_time[d]) if d in self.host_time else (self.time[d],)

    def piece_per_adapter(self, c: TimeCoeffs, a: AdapterLoad) -> float:
        """Seconds adapter ``a`` adds to every step under the linear form ``c``."""
        tok = a.batch_size * (self.row_tokens if self.row_tokens is not None else self.seq_len)
        return c.c_tok * tok + c.c_rtok * a.rank * tok + c.c_ad

    def step_time(self, adapters: Sequence[AdapterLoad], d: int) -> float:
        """Seconds of one packed step of all ``adapters``: the longest of the pieces."""
        buckets = num_buckets(a.rank for a in adapters)
        return max(c.c0 + c.c_bkt * buckets + sum(self.piece_per_adapter(c, a) for a in adapters)
                   for c in self.pieces(d))

    def job_time(self, adapters: Sequence[AdapterLoad], d: int) -> float:
        """Seconds of a whole job; each adapter leaves the pack once its steps are done.

        With adapters sorted by steps n_(1) <= ... <= n_(K), the job runs
        n_(i) - n_(i-1) steps with adapters i..K still in the pack, after
        ``job_overhead_s`` (process start, model load) paid once. With measured job terms
        (``overheads``), each later pack composition adds a capture, and the adapters that
        leave at each step count add their packed eval and saves, or only their saves where
        they are scored beside the pack's training (`exit_pause`).
        """
        order = sorted(adapters, key=lambda a: a.steps)
        total, done, phases = self.job_overhead_s if order else 0.0, 0, 0
        for i, a in enumerate(order):
            if a.steps > done:
                total += (a.steps - done) * self.step_time(order[i:], d)
                done = a.steps
                phases += 1
        if self.overheads is not None and order:
            total += self.overheads.capture_s * max(0, phases - 1)
            leaving: dict[int, int] = {}
            for a in order:
                leaving[a.steps] = leaving.get(a.steps, 0) + 1
            last = max(leaving)
            total += sum(self.exit_pause(n, d, inline=s == last) for s, n in leaving.items())
        return total

    @property
    def _shaped(self) -> bool:
        shape = self.meta.get("shape")
        return isinstance(shape, dict) and "hidden" in shape

    def eval_bytes_per_token(self, d: int) -> float:
        """Bytes an eval forward holds per token of its batch: a few hidden-size activations
        of the live layer (the head's logits are a chunk apart, `eval_memory`). Without the
        model's shape in ``meta``, a training token's activations (an upper bound)."""
        if not self._shaped:
            return self.memory_coeffs[d].tok
        shape = self.meta["shape"]
        return EVAL_HIDDEN_COPIES * float(shape["hidden"]) * float(shape.get("dtype_bytes", 2))

    def exit_time(self, adapters: int) -> float:
        """Seconds ``adapters`` adapters leaving a pack together add to its job: their packed
        eval on the sweep's eval rows and their checkpoints (0 without measured job terms)."""
        return self.overheads.exit_time(adapters, self.eval_load) if self.overheads is not None else 0.0

    def exit_pause(self, adapters: int, d: int, *, inline: bool) -> float:
        """Seconds ``adapters`` adapters leaving a pack together hold up its job at degree
        ``d``: their evals and saves (`exit_time`) where the job scores them in line (nothing
        stays in the pack, or a join may still change it), else their saves and any
        epoch-end evals before their last: a one-GPU job scores the final one beside the
        others' training (`EvalLoad.beside_training`)."""
        if self.overheads is None or adapters <= 0:
            return 0.0
        load = self.eval_load
        if not inline and d == 1 and load is not None and load.beside_training:
            # the final eval beside; epoch-end evals before it (per-epoch scoring) run in line
            earlier = self.overheads.eval_time(adapters, load) * (max(1, load.evals) - 1)
            return earlier + self.overheads.save_s * adapters
        return self.exit_time(adapters)

    def scored_in_line(self) -> "CostModel":
        """The same model with every leaving group's eval paid in line: for jobs that never
        score beside training (they wait for joins, or accumulate micro-batches)."""
        load = self.eval_load
        if load is None or not load.beside_training:
            return self
        return replace(self, eval_load=replace(load, beside_training=False))

    def with_overheads(self, overheads: JobOverheads | None) -> "CostModel":
        """The same model with measured job terms; their fixed part becomes ``job_overhead_s``
        (what the planner adds once per job)."""
        if overheads is None:
            return replace(self, overheads=None)
        return replace(self, overheads=overheads, job_overhead_s=overheads.fixed_s,
                       meta=self.meta.with_(job_terms=overheads.to_dict()))

    def for_rows(self, row_tokens: float | None, memory_row_tokens: float | None = None) -> "CostModel":
        """The same model timing steps by a sweep's mean real tokens per row (`row_tokens`)
        and, given ``memory_row_tokens``, counting each row's memory at that many tokens."""
        if row_tokens is not None:
            row_tokens = min(float(row_tokens), float(self.seq_len))
        widest = self.memory_row_tokens if memory_row_tokens is None else float(memory_row_tokens)
        return replace(self, row_tokens=row_tokens, memory_row_tokens=widest)

    def for_eval(self, load: EvalLoad | None) -> "CostModel":
        """The same model pricing a sweep's eval (`eval_load`)."""
        return replace(self, eval_load=load)

    def with_meta(self, **changes: Any) -> "CostModel":
        """The same model with ``changes`` to its `meta`."""
        return replace(self, meta=self.meta.with_(**changes))

    def fits(self, adapters: Sequence[AdapterLoad], d: int, load_factor: float = 0.9) -> bool:
        """Whether the job runs at degree ``d`` within ``load_factor`` of GPU memory."""
        return d in self.time and self.memory(adapters, d) <= load_factor * self.gpu_memory_bytes

    def scaled(self, factor: float) -> "CostModel":
        """The same model with every time `factor` times longer: what a re-plan uses once
        measured job times have drifted from the predicted ones by that factor."""
        def scale(c: TimeCoeffs) -> TimeCoeffs:
            return TimeCoeffs(c.c0 * factor, c.c_tok * factor, c.c_rtok * factor, c.c_ad * factor, c.c_bkt * factor)

        return CostModel(self.gpu_memory_bytes, self.seq_len, {d: scale(c) for d, c in self.time.items()},
                         dict(self.memory_coeffs), name=self.name, meta=self.meta.with_(time_scale=factor),
                         job_overhead_s=self.job_overhead_s * factor,
                         host_time={d: scale(c) for d, c in self.host_time.items()},
                         overheads=self.overheads.scaled(factor) if self.overheads is not None else None,
                         eval_load=self.eval_load, row_tokens=self.row_tokens,
                         memory_row_tokens=self.memory_row_tokens)

    # ---- serialization ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "plora.cost.model/linear-v1",
            "name": self.name,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "seq_len": self.seq_len,
            "time": {str(d): asdict(c) for d, c in sorted(self.time.items())},
            "memory": {str(d): asdict(c) for d, c in sorted(self.memory_coeffs.items())},
            "job_overhead_s": self.job_overhead_s,
            **({"host_time": {str(d): asdict(c) for d, c in sorted(self.host_time.items())}} if self.host_time else {}),
            **({"overheads": self.overheads.to_dict()} if self.overheads is not None else {}),
            **({"eval_load": self.eval_load.to_dict()} if self.eval_load is not None else {}),
            **({"row_tokens": self.row_tokens} if self.row_tokens is not None else {}),
            **({"memory_row_tokens": self.memory_row_tokens} if self.memory_row_tokens is not None else {}),
            "meta": self.meta.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        return cls(
            gpu_memory_bytes=float(data["gpu_memory_bytes"]),
            seq_len=int(data["seq_len"]),
            time={int(d): TimeCoeffs(**c) for d, c in data["time"].items()},
            memory_coeffs={int(d): MemoryCoeffs(**c) for d, c in data["memory"].items()},
            name=str(data.get("name", "")),
            meta=CostMeta.from_dict(data.get("meta")),
            job_overhead_s=float(data.get("job_overhead_s", 0.0)),
            host_time={int(d): TimeCoeffs(**c) for d, c in data.get("host_time", {}).items()},
            overheads=JobOverheads.from_dict(data["overheads"]) if data.get("overheads") else None,
            eval_load=EvalLoad.from_dict(data["eval_load"]) if data.get("eval_load") else None,
            row_tokens=float(data["row_tokens"]) if data.get("row_tokens") is not None else None,
            memory_row_tokens=(float(data["memory_row_tokens"]) if data.get("memory_row_tokens") is not None
                               else None),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        data = json.loads(Path(path).read_text())
        # A profile file may wrap the model next to its raw measurements.
        return cls.from_dict(data.get("cost_model", data))

    # ---- analytic prior -----------------------------------------------------------------
    @classmethod
    def analytic(
        cls,
        shape: ModelShape,
        seq_len: int,
        gpu_memory_bytes: float,
        targets: str | Iterable[str] | None = None,
        *,
        device_flops: float = 989e12,
        device_bandwidth: float = 3.35e12,
        link_bandwidth: float = 3.0e11,
        mfu: float = 0.45,
        lora_efficiency: float = 0.25,
        kernel_launch_s: float = 5e-6,
        allreduce_latency_s: float = 2e-5,
        step_overhead_s: float = 5e-3,
        activation_checkpointing: bool = True,
        logits_bytes_per_vocab: float | None = None,
        overhead_bytes: float = 3 * 2**30,
        adapter_overhead_bytes: float = 16 * 2**20,
        tp_degrees: Iterable[int] | None = None,
        max_tp: int = 8,
    ) -> "CostModel":
        """A prior from FLOPs and bytes, before any measurement (defaults: one H100 SXM).

        Time per TP degree d:
          * ``c_tok``: frozen-base FLOPs per token (forward, input-gradient backward,
            plus a recomputed forward under activation checkpointing; causal attention
            included) at ``mfu`` of ``d * device_flops``; the LoRA path's memory traffic
            (about 7 passes over each adapted linear's inputs and outputs); and the TP
            all-reduces of the hidden state, 2(d-1)/d of its bytes over ``link_bandwidth``.
          * ``c_rtok``: LoRA FLOPs per rank and token (shrink, expand and their four
            backward products) at ``lora_efficiency`` -- skinny GEMMs run far from peak.
          * ``c_ad``: per-adapter work that does not scale with tokens or rank: its loss
            terms and host bookkeeping (the layers, norms and optimizer take the same few
            launches whatever the adapter count).
          * ``c_bkt``: each rank bucket's kernel launches in every adapted layer.
          * ``c0``: streaming the weights from HBM once per pass, the per-layer kernel
            launches, all-reduce latency and a fixed per-step overhead.
        A quantized base (``shape.quantize``) holds its block linears in NF4 and dequantizes
        each for every product (`plora.quantize.cost`): its weights' bytes shrink, one
        dequantized linear's workspace is added to the base, and ``c0`` streams the
        dequantize's bytes in each pass.
        Memory follows PLoRA Appendix B with activation checkpointing: the inputs of
        every layer are kept (replicated across TP ranks), one layer's activations
        are live while it is recomputed (its head/MLP parts sharded), and the logits
        and their gradient are vocab-parallel; LoRA parameters and gradients are in the
        model dtype, AdamW moments in fp32 (2·dtype + 8 bytes per parameter).
        """
        dt = shape.dtype_bytes
        h, inter, L = shape.hidden, shape.intermediate, shape.n_layers
        q_dim = shape.n_heads * shape.head_dim
        kv_dim = shape.n_kv_heads * shape.head_dim
        names = resolve_lora_targets(targets)
        p_rank = shape.lora_params_per_rank(names)
        p_rep, p_shard = shape.lora_split_per_rank(names)
        ckpt = 1 if activation_checkpointing else 0
        degrees = tuple(sorted(set(tp_degrees))) if tp_degrees is not None else shape.tp_degrees(max_tp)

        # FLOPs per token of the frozen base: matmul weights (the input embedding is a lookup).
        embed = shape.vocab * h
        matmul_params = shape.n_params - (0 if shape.tied_embeddings else embed)
        attn_fwd = 2 * seq_len * q_dim * L  # causal: QK^T and AV over seq/2 keys on average
        base_flops = (2 + ckpt) * 2 * matmul_params + (1 + 2.5 + ckpt) * attn_fwd
        lora_bytes = 3.5 * dt * p_rank  # ~7 passes over in+out per adapted linear
        lora_flops = (6 + 2 * ckpt) * p_rank  # per rank and token
        allreduces = (4 + 2 * ckpt) * L  # Megatron: 2 forward + 2 backward per layer (+ recompute)
        launches = L * 20 * (2 + ckpt)

        if logits_bytes_per_vocab is None:
            logits_bytes_per_vocab = 2 * dt  # logits and their gradient
        kept_inputs = L * h * dt if ckpt else 0.0
        live_rep = 4 * h * dt  # norms and residual stream of the live layer
        live_shard = (q_dim + 2 * kv_dim + q_dim + 3 * inter) * dt  # q,k,v,attn out, gate/up/act
        if not ckpt:
            live_rep, live_shard = live_rep * L, live_shard * L
        lora_act = len(names) * dt * (1 if ckpt else L)  # shrink outputs, per rank and token

        weight_bytes = base_weight_bytes(shape) + dequant_workspace_bytes(shape)
        dequant_bytes = dequant_step_bytes(shape, 2 + ckpt)
        time: dict[int, TimeCoeffs] = {}
        memory: dict[int, MemoryCoeffs] = {}
        for d in degrees:
            ring = 2 * (d - 1) / d
            comm_tok = allreduces * h * dt * ring / link_bandwidth if d > 1 else 0.0
            time[d] = TimeCoeffs(
                c0=(2 + ckpt) * shape.n_params * dt / (d * device_bandwidth)
                + launches * kernel_launch_s
                + (allreduces * allreduce_latency_s if d > 1 else 0.0)
                + step_overhead_s
                + dequant_bytes / (d * device_bandwidth),
                c_tok=base_flops / (d * device_flops * mfu) + lora_bytes / (d * device_bandwidth) + comm_tok,
                c_rtok=lora_flops / (d * device_flops * lora_efficiency),
                c_ad=8 * kernel_launch_s,
                c_bkt=L * len(names) * 6 * kernel_launch_s,  # 2 forward + ~4 backward launches per layer
            )
            memory[d] = MemoryCoeffs(
                base=weight_bytes / d + overhead_bytes,
                adapter=adapter_overhead_bytes,
                rank=(2.0 * dt + 8.0) * (p_rep + p_shard / d),
                tok=kept_inputs + live_rep + live_shard / d + shape.vocab * logits_bytes_per_vocab / d,
                rank_tok=lora_act,
            )
        meta = {
            "source": "analytic",
            "shape": shape.to_dict(),
            "targets": list(names),
            "device_flops": device_flops,
            "device_bandwidth": device_bandwidth,
            "link_bandwidth": link_bandwidth,
            "mfu": mfu,
            "activation_checkpointing": bool(ckpt),
        }
        return cls(gpu_memory_bytes, seq_len, time, memory, name=f"{shape.name}@{seq_len}", meta=CostMeta.from_dict(meta))
