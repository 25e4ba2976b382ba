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
measured job terms (``overheads``, `plora.jobcost`) a job also pays its start, load and
first step once, a graph capture whenever the pack changes, and the packed eval and save of
the adapters leaving at each step count (``eval_load``: the sweep's eval rows); while those
are evaluated, the job's memory is its weights, the adapters' state and the eval batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from plora.accumulation import accumulation_steps, micro_rows
from plora.jobcost import EvalLoad, JobOverheads
from plora.quantize.cost import base_weight_bytes, dequant_step_bytes, dequant_workspace_bytes

__all__ = [
    "AdapterLoad",
    "rank_bucket",
    "CostModel",
    "MemoryCoeffs",
    "ModelShape",
    "TimeCoeffs",
    "resolve_lora_targets",
]

#: hidden-size activations an eval token holds in the live layer (residual, norms, attention, MLP)
EVAL_HIDDEN_COPIES = 16
#: what the eval's LM head holds at once, whatever the batch: one chunk of float32 logits
#: (`plora.packed.head_loss` cuts its chunks by this bound; the head never makes a batch's
#: full logits)
EVAL_HEAD_BYTES = 256 * 2**20

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Megatron-style TP: these shard their output features (column parallel) ...
_COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
# ... and these their input features (row parallel).
_ROWWISE = frozenset({"o_proj", "down_proj"})


def rank_bucket(rank: int) -> int:
    """The kernels' launch group of a rank: the next power of two, at least 16
    (`plora.kernels.rank_bucket`, repeated here so the cost model needs no torch)."""
    b = 16
    while b < rank:
        b *= 2
    return b


def num_buckets(ranks: Iterable[int]) -> int:
    return len({rank_bucket(int(r)) for r in ranks})


def resolve_lora_targets(targets: str | Iterable[str] | None) -> tuple[str, ...]:
    """HF linear names; ``"all-linear"`` (alone or in a list) means every linear of a block."""
    if targets is None:
        return DEFAULT_TARGETS
    if isinstance(targets, str):
        targets = [targets]
    out: list[str] = []
    for t in targets:
        names = ALL_LINEAR if t == "all-linear" else (t,)
        for n in names:
            if n not in ALL_LINEAR:
                raise ValueError(f"unknown LoRA target {n!r}; expected one of {', '.join(ALL_LINEAR)} or all-linear")
            if n not in out:
                out.append(n)
    return tuple(out)


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
    (`plora.accumulation`), so that memory fits by its micro-batch and time counts every part."""
    parts = accumulation_steps(batch_size, micro_batch_size)
    return AdapterLoad(adapter_id, int(rank), micro_rows(batch_size, micro_batch_size), int(steps) * parts)


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a decoder-only transformer that the cost model needs."""

    name: str
    n_params: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    #: the block linears held 4-bit ("nf4", `plora.quantize.cost`); None: in ``dtype_bytes``
    quantize: str | None = None

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear of one block."""
        h, i = self.hidden, self.intermediate
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def lora_params_per_rank(self, targets: str | Iterable[str] | None = None) -> int:
        """LoRA parameters per unit of rank: sum over targeted linears of (in + out), times layers."""
        dims = self.linear_dims()
        return self.n_layers * sum(sum(dims[t]) for t in resolve_lora_targets(targets))

    def lora_split_per_rank(self, targets: str | Iterable[str] | None = None) -> tuple[int, int]:
        """(replicated, sharded) LoRA parameters per rank under Megatron TP.

        A column-parallel linear keeps A (r x in) whole and shards B (out x r); a
        row-parallel one shards A and keeps B whole. Only the sharded part shrinks with d.
        """
        dims = self.linear_dims()
        rep = shard = 0
        for t in resolve_lora_targets(targets):
            i, o = dims[t]
            if t in _COLWISE:
                rep, shard = rep + i, shard + o
            else:
                rep, shard = rep + o, shard + i
        return rep * self.n_layers, shard * self.n_layers

    def tp_degrees(self, max_tp: int = 8) -> tuple[int, ...]:
        """Powers of two up to ``max_tp`` that split attention heads and KV heads evenly.

        Sharding attention by heads needs d | n_heads and d | n_kv_heads; a degree that
        splits a head would change the computation, so it is not offered. A quantized base
        runs at degree 1 only (`plora.quantize.cost.check_tp`).
        """
        if self.quantize:
            return (1,)
        out, d = [], 1
        while d <= max_tp:
            if self.n_heads % d == 0 and self.n_kv_heads % d == 0:
                out.append(d)
            d *= 2
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["quantize"] is None:  # absent when off: keys of earlier profiles stay valid
            del out["quantize"]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelShape":
        return cls(**d)

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """Shapes of common base models (numbers from their HF ``config.json``)."""
        key = name.lower()
        if key not in _PRESETS:
            raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(_PRESETS))}")
        return _PRESETS[key]

    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(sorted(_PRESETS))


def _shape(name, n_params, hidden, inter, layers, heads, kv, head_dim, vocab, tied) -> ModelShape:
    return ModelShape(name, n_params, hidden, inter, layers, heads, kv, head_dim, vocab, 2, tied)


_PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _shape("qwen2.5-0.5b", 494_032_768, 896, 4864, 24, 14, 2, 64, 151936, True),
        _shape("qwen2.5-1.5b", 1_543_714_304, 1536, 8960, 28, 12, 2, 128, 151936, True),
        _shape("qwen2.5-3b", 3_085_938_688, 2048, 11008, 36, 16, 2, 128, 151936, True),
        _shape("qwen2.5-7b", 7_615_616_512, 3584, 18944, 28, 28, 4, 128, 152064, False),
        _shape("qwen2.5-14b", 14_770_033_664, 5120, 13824, 48, 40, 8, 128, 152064, False),
        _shape("qwen2.5-32b", 32_763_876_352, 5120, 27648, 64, 40, 8, 128, 152064, False),
        _shape("llama-3.2-1b", 1_235_814_400, 2048, 8192, 16, 32, 8, 64, 128256, True),
        _shape("llama-3.2-3b", 3_212_749_824, 3072, 8192, 28, 24, 8, 128, 128256, True),
        _shape("llama-3.1-8b", 8_030_261_248, 4096, 14336, 32, 32, 8, 128, 128256, False),
        _shape("mistral-7b-v0.3", 7_248_023_552, 4096, 14336, 32, 32, 8, 128, 32768, False),
    )
}


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


@dataclass
class CostModel:
    """Linear memory and (piecewise-)linear time model of packed jobs, one set of
    coefficients per TP degree.

    ``time`` and ``memory`` are keyed by TP degree; a degree missing from them is one
    the model cannot run at. Treat instances as immutable: the planner caches
    values derived from them.
    """

    gpu_memory_bytes: float
    seq_len: int
    time: dict[int, TimeCoeffs]
    memory_coeffs: dict[int, MemoryCoeffs]
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
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
        the eval memory budget where one is set. 0 when the sweep's eval is not known."""
        ev = self.eval_load
        if ev is None or ev.samples <= 0 or not adapters:
            return 0.0
        m = self.memory_coeffs[d]
        state = sum(m.adapter + m.rank * a.rank for a in adapters)
        groups: dict[int, int] = {}
        for a in adapters:
            groups[a.steps] = groups.get(a.steps, 0) + 1
        rows = min(ev.batch_rows, max(groups.values()) * ev.samples)
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
        leave at each step count add their packed eval and saves (`exit_time`).
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
            total += sum(self.exit_time(n) for n in leaving.values())
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

    def with_overheads(self, overheads: JobOverheads | None) -> "CostModel":
        """The same model with measured job terms; their fixed part becomes ``job_overhead_s``
        (what the planner adds once per job)."""
        if overheads is None:
            return replace(self, overheads=None)
        return replace(self, overheads=overheads, job_overhead_s=overheads.fixed_s,
                       meta={**self.meta, "job_terms": overheads.to_dict()})

    def for_rows(self, row_tokens: float | None, memory_row_tokens: float | None = None) -> "CostModel":
        """The same model timing steps by a sweep's mean real tokens per row (`row_tokens`)
        and, given ``memory_row_tokens``, counting each row's memory at that many tokens."""
        if row_tokens is not None:
            row_tokens = min(float(row_tokens), float(self.seq_len))
        widest = self.memory_row_tokens if memory_row_tokens is None else float(memory_row_tokens)
        return replace(self, row_tokens=row_tokens, memory_row_tokens=widest, meta=dict(self.meta))

    def for_eval(self, load: EvalLoad | None) -> "CostModel":
        """The same model pricing a sweep's eval (`eval_load`)."""
        return replace(self, eval_load=load, meta=dict(self.meta))

    def fits(self, adapters: Sequence[AdapterLoad], d: int, load_factor: float = 0.9) -> bool:
        """Whether the job runs at degree ``d`` within ``load_factor`` of GPU memory."""
        return d in self.time and self.memory(adapters, d) <= load_factor * self.gpu_memory_bytes

    def scaled(self, factor: float) -> "CostModel":
        """The same model with every time `factor` times longer: what a re-plan uses once
        measured job times have drifted from the predicted ones by that factor."""
        def scale(c: TimeCoeffs) -> TimeCoeffs:
            return TimeCoeffs(c.c0 * factor, c.c_tok * factor, c.c_rtok * factor, c.c_ad * factor, c.c_bkt * factor)

        return CostModel(self.gpu_memory_bytes, self.seq_len, {d: scale(c) for d, c in self.time.items()},
                         dict(self.memory_coeffs), name=self.name, meta={**self.meta, "time_scale": factor},
                         job_overhead_s=self.job_overhead_s * factor,
                         host_time={d: scale(c) for d, c in self.host_time.items()},
                         overheads=self.overheads.scaled(factor) if self.overheads is not None else None,
                         eval_load=self.eval_load, row_tokens=self.row_tokens,
                         memory_row_tokens=self.memory_row_tokens)

    # ---- serialization ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "plora.costmodel/linear-v1",
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
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        return cls(
            gpu_memory_bytes=float(data["gpu_memory_bytes"]),
            seq_len=int(data["seq_len"]),
            time={int(d): TimeCoeffs(**c) for d, c in data["time"].items()},
            memory_coeffs={int(d): MemoryCoeffs(**c) for d, c in data["memory"].items()},
            name=str(data.get("name", "")),
            meta=dict(data.get("meta", {})),
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
        return cls(gpu_memory_bytes, seq_len, time, memory, name=f"{shape.name}@{seq_len}", meta=meta)


def steps_for(num_train: int, batch_size: int, epochs: float = 1.0) -> int:
    """Optimizer steps of an adapter that sees ``epochs`` passes over ``num_train`` samples:
    ``ceil(epochs * num_train / batch_size)``, computed exactly (0.3 epochs of 10 samples at
    batch size 3 is 1 step, not the 2 that float rounding would give)."""
    from fractions import Fraction

    if num_train < 1:
        raise ValueError(f"num_train must be >= 1, got {num_train}")
    return max(1, math.ceil(Fraction(repr(float(epochs))) * num_train / batch_size))
