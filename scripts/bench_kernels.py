#!/usr/bin/env python
"""Benchmark the packed LoRA kernels on one GPU against the loop over adapters, a stacked
`bmm` (equal ranks only) and the byte floor at the copy bandwidth measured in the same run.

Byte floor of the unfused op: forward reads x and reads+writes y; backward reads dy and x
and reads+writes dx: 7 passes over K·T·hidden elements (K adapters × T tokens each), at
the bandwidth of device copies issued back to back (a copy replayed from a CUDA graph runs
on the copy engines and is slower; both are logged).

The floor leaves out the adapters' own tensors. The op cannot avoid moving them either: A and
B are read twice each (forward and backward), dA and dB written once, S' and dS written once
and read twice each. "min" adds those bytes to the 7 passes; at rank r, T tokens per adapter
and hidden size h they add 6·r/T (A, B, dA, dB) + 6·r/h (S', dS) of a pass per adapter
(0.75 + 0.04 of a pass at rank 128, T = 1024, h = 18944), so
"loop/min" is the most any kernel at the copy bandwidth can gain over the loop measured in
the same row.

"roof" loosens "min" to what no implementation of the op can beat on this GPU: its passes that
only read (x twice, dy once) at the read-only bandwidth (a float32 sum over 1 GiB), the rest at
the copy bandwidth, or its six products (12·T·h·r FLOP per adapter) at the bf16 rate of a
cuBLAS 8192³ product, whichever takes longer; all three rates are measured in the same run.
"loop/roof" is then the most that packing can gain over the loop in that row.

The loop's time is mostly not its products: every ``x[t0:t1]`` slice's backward fills a
full-size zero gradient and adds it into ``x.grad``, about four passes over all K·T rows per
adapter, so at K = 32 the loop moves about 20× the floor whatever the rank. ``--trace``
prints the loop's kernels beside plora's.

    python scripts/bench_kernels.py --out DIR            # bf16 check + the table
    python scripts/bench_kernels.py --sweep --out DIR    # tile sweep first, table on its best
    python scripts/bench_kernels.py --smoke --out DIR    # tiny, CPU, Triton interpreter
    python scripts/bench_kernels.py --library --out DIR  # stages against library GEMMs

``--sweep`` times each kernel stage under many tile configurations (compiled first in
``--jobs`` parallel processes), checks every variant's output against a float32 reference,
picks the fastest per (stage, rank bucket) and the dy-side mode, and writes them to
``tiles.json`` (use again with ``--tiles``). The check and the table run in child processes:
a GPU fault ends a CUDA context for good, so a row that crashes is re-run stage by stage in
a fresh process (to name the failing launch) and the table goes on after it.

Columns: plora fwd/bwd/both from CUDA-graph replays (GPU time); "eager" = fwd+bwd issued
back to back (host launch overhead shows where it binds); loop and bmm are plain torch
autograd, eager. Files in ``--out``: log.txt, sweep.json, tiles.json, check.json (bf16
errors against a float64 oracle, whole-layer timings), rows.jsonl, result.json. A short
table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _import_kernels():
    """`plora.kernels`, installed or straight from the tree."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import plora.kernels as K
    from plora.kernels import reference, triton_ops

    return K, reference, triton_ops


K, REF, T = _import_kernels()
rel_err = REF.rel_err

HIDDEN = [2048, 3584, 11008, 18944]
KS = [1, 2, 8, 32]
RANK_SETS = ["8", "32", "128", "mixed"]
TOKENS = 1024
DEVICE = "cuda"
DTYPE = torch.bfloat16
CHECK_CASES = [
    ([1024] * 32, [32] * 32, 3584, 3584),
    ([1024] * 8, [8, 25, 42, 59, 77, 94, 111, 128], 2048, 11008),
    ([0, 1, 777, 64, 1500, 33], [8, 128, 100, 1, 8, 256], 1000, 1100),
    ([1024] * 16, [128] * 8 + [64] * 8, 2048, 9000),  # large launches of buckets 64 and 128
]
LAYER_SHAPES = [(3584, 32, "32"), (3584, 32, "mixed")]
EXTRA_SWEEP_SHAPES = [(11008, 32, "8"), (11008, 32, "32"), (18944, 32, "8"), (2048, 32, "32"), (11008, 8, "8"),
                      (11008, 8, "32"), (18944, 8, "32"), (3584, 8, "8"), (2048, 8, "32"), (2048, 32, "128"),
                      (11008, 32, "128"), (3584, 8, "64"), (3584, 32, "64"), (18944, 32, "64"),
                      (18944, 8, "8"), (18944, 8, "128"), (11008, 8, "128"), (2048, 32, "8")]
SWEEP_SHAPES = [
    (3584, 32, "8"), (3584, 32, "32"), (3584, 32, "64"), (3584, 32, "128"),
    (18944, 32, "32"), (18944, 32, "128"), (2048, 8, "8"), (2048, 8, "128"), (3584, 8, "32"), (3584, 8, "128"),
]
# (bt, bh, warps, stages, waves[, other TileConfig fields])


_ta = {"tacc": True}


_hf3 = {"ystages": 3, "hfirst": True}
_hf = {"hfirst": True}


def _ys(n: int) -> dict:
    return {"ystages": n}


SWEEP = {
    "shrink": [(64, 64, 4, 4, 2), (64, 128, 4, 3, 2), (64, 128, 8, 3, 2), (128, 64, 8, 3, 2), (32, 128, 4, 3, 2),
               (64, 64, 4, 4, 4), (128, 64, 4, 4, 2), (128, 128, 8, 3, 2), (128, 64, 8, 4, 2), (64, 32, 4, 4, 2),
               (256, 32, 8, 4, 2), (256, 64, 8, 3, 2), (128, 32, 8, 4, 2), (64, 32, 4, 6, 2), (32, 64, 4, 4, 4),
               (128, 64, 8, 3, 4), (64, 128, 4, 3, 1), (64, 64, 4, 4, 1), (32, 128, 4, 3, 1)],
    "expand": [(64, 128, 4, 3, 8), (64, 256, 4, 3, 8), (32, 256, 4, 3, 8), (64, 128, 4, 3, 4), (128, 128, 8, 3, 4),
               (64, 64, 4, 3, 8), (64, 256, 8, 3, 4), (64, 128, 4, 3, 8, _ys(3)), (64, 128, 4, 3, 8, _ys(2)),
               (64, 64, 4, 3, 8, _ys(3)), (64, 64, 4, 3, 8, _ys(4)), (32, 128, 4, 3, 8, _ys(4)),
               (64, 256, 8, 3, 4, _ys(2)), (128, 128, 8, 3, 4, _ys(2)), (32, 256, 4, 3, 8, _ys(3)),
               (64, 128, 8, 3, 8, _ys(3)), (64, 128, 4, 3, 4, _ys(3)), (32, 128, 4, 3, 16, _ys(3)),
               (64, 128, 4, 3, 8, _hf3), (64, 64, 4, 3, 8, _hf3),
               (64, 64, 4, 3, 8, {"ystages": 4, "hfirst": True}), (32, 128, 4, 3, 16, _hf3),
               (64, 256, 8, 3, 4, _hf3), (64, 256, 8, 3, 4, _ys(3)),
               (128, 128, 8, 3, 4, _hf3), (64, 128, 4, 3, 16, _hf3),
               # fewer, longer programs for small launches (their y sits in L2: ramp and tail cost)
               (64, 64, 4, 3, 2, _hf3), (64, 64, 4, 3, 4, _hf3), (64, 128, 4, 3, 2, _hf3), (64, 128, 4, 3, 4, _hf3),
               (64, 128, 4, 3, 1, _hf3), (128, 128, 8, 3, 2, _hf3), (64, 256, 8, 3, 2, _hf3), (64, 256, 8, 3, 1, _hf3),
               (128, 64, 4, 3, 4, _hf3), (32, 128, 4, 3, 4, _hf3), (128, 256, 8, 3, 1, _hf3), (64, 64, 4, 3, 1, _hf3)],
    "wgrad": [(64, 128, 4, 3, 2), (32, 128, 4, 3, 2), (32, 256, 8, 3, 2), (64, 128, 8, 3, 2), (64, 256, 8, 3, 2),
              (64, 256, 8, 4, 2), (64, 512, 8, 3, 2), (64, 128, 4, 3, 8), (128, 128, 8, 3, 2), (64, 64, 4, 4, 2),
              (128, 64, 8, 3, 2), (32, 64, 4, 4, 2), (64, 128, 4, 4, 2), (64, 64, 4, 4, 4), (128, 128, 8, 4, 2),
              (64, 64, 4, 4, 1), (64, 128, 4, 3, 1), (32, 64, 4, 4, 1), (32, 256, 8, 3, 1), (32, 128, 4, 3, 1),
              # launched by item (neighbouring programs share its rows of P)
              (64, 256, 8, 4, 2, _hf), (64, 256, 8, 3, 2, _hf), (64, 128, 4, 3, 2, _hf), (64, 128, 4, 3, 1, _hf),
              (64, 64, 4, 4, 1, _hf), (32, 64, 4, 4, 1, _hf), (128, 128, 8, 3, 2, _hf), (64, 512, 8, 3, 2, _hf),
              (32, 256, 8, 3, 1, _hf), (64, 128, 8, 3, 2, _hf), (128, 128, 8, 4, 2, _hf), (64, 64, 4, 4, 2, _hf)],
    "dy_band": [(64, 512, 8, 2, 1, _ta), (64, 512, 8, 2, 2, _ta), (64, 512, 8, 2, 4, _ta), (64, 512, 4, 3, 1, _ta),
                (64, 512, 4, 3, 2, _ta), (64, 512, 4, 3, 4, _ta), (64, 256, 4, 4, 1, _ta), (64, 256, 4, 4, 4, _ta),
                (64, 512, 8, 3, 1), (64, 256, 4, 3, 1), (128, 256, 8, 2, 1, _ta),
                (64, 512, 8, 2, 1, {"tacc": True, "max_chunk": 512}), (64, 512, 4, 3, 1, {"tacc": True, "max_chunk": 512}),
                (64, 256, 4, 4, 1, {"tacc": True, "max_chunk": 512}), (64, 512, 8, 2, 1, {"tacc": True, "max_chunk": 256}),
                (64, 512, 4, 3, 1, {"tacc": True, "max_chunk": 256})],
    "dy_pair": [(64, 128, 4, 3, 2, {"bt2": 64, "bh2": 128}), (32, 128, 4, 3, 2, {"bt2": 64, "bh2": 128}),
                (128, 64, 8, 3, 2, {"bt2": 64, "bh2": 128}), (32, 64, 4, 4, 2, {"bt2": 32, "bh2": 128}),
                (64, 128, 8, 3, 2, {"bt2": 64, "bh2": 256}), (64, 128, 4, 3, 2, {"bt2": 64, "bh2": 128, "max_chunk": 256}),
                (32, 128, 4, 3, 2, {"bt2": 64, "bh2": 128, "max_chunk": 256}),
                (64, 128, 4, 3, 2, {"bt2": 32, "bh2": 128, "max_chunk": 512}),
                (128, 64, 8, 3, 2, {"bt2": 64, "bh2": 128, "max_chunk": 256}),
                (256, 32, 8, 4, 2, {"bt2": 64, "bh2": 64}), (64, 64, 4, 4, 2, {"bt2": 64, "bh2": 64}),
                (128, 64, 8, 3, 2, {"bt2": 64, "bh2": 64}), (128, 64, 8, 3, 2, {"bt2": 128, "bh2": 128}),
                (128, 64, 8, 4, 2, {"bt2": 64, "bh2": 128}), (32, 128, 4, 3, 1, {"bt2": 64, "bh2": 128}),
                (64, 128, 4, 3, 1, {"bt2": 64, "bh2": 128}), (64, 64, 4, 4, 1, {"bt2": 64, "bh2": 64}),
                (64, 128, 8, 3, 1, {"bt2": 64, "bh2": 256})],
    "dy_block": [(64, 128, 4, 4, 2, {"bt2": 64, "bh2": 128, "block": 4096}),
                 (64, 128, 8, 4, 2, {"bt2": 64, "bh2": 256, "block": 4096}),
                 (64, 128, 8, 3, 2, {"bt2": 64, "bh2": 256, "block": 4096}),
                 (64, 128, 8, 4, 2, {"bt2": 64, "bh2": 256, "block": 2048}),
                 (64, 128, 4, 4, 2, {"bt2": 64, "bh2": 128, "block": 2048}),
                 (64, 128, 8, 4, 2, {"bt2": 64, "bh2": 256, "block": 6144})],
}


def ranks_for(name: str, k: int) -> list[int]:
    if name == "mixed":
        return [8] if k == 1 else [round(8 + 120 * i / (k - 1)) for i in range(k)]
    if name == "31x8+1x128":
        return [8] * (k - 1) + [128]
    return [int(name)] * k


def _extra(cfg) -> dict:
    return cfg[5] if len(cfg) > 5 else {}


def fits(kind: str, rp: int, cfg) -> bool:
    """Skip tiles whose float32 accumulators alone would take more than 128 registers a thread."""
    bt, bh, warps = cfg[0], cfg[1], cfg[2]
    per_thread = 128 * warps * 32

    def ok(*elems: int) -> bool:
        return all(e <= per_thread for e in elems)

    if kind == "shrink":
        return ok(bt * rp)
    if kind == "expand":
        return ok(bt * bh) and rp * bh <= 32768
    if kind in ("dy_pair", "dy_block"):
        e = _extra(cfg)
        return ok(bt * rp, rp * e["bh2"], e["bt2"] * rp)
    return ok(rp * bh, bt * rp)


def tile(cfg) -> T.TileConfig:
    bt, bh, w, st, waves = cfg[:5]
    return T.TileConfig(bt=bt, bh=bh, warps=w, stages=st, waves=waves, **_extra(cfg))


def cfg_key(cfg) -> str:
    return json.dumps(list(cfg), sort_keys=True)


class Problem:
    """K adapters × TOKENS tokens, square hidden, bf16, random data (never zeros)."""

    def __init__(self, hidden: int, k: int, rank_set: str, tiny: bool = False):
        device, dtype = DEVICE, DTYPE
        self.hidden, self.k, self.rank_set = hidden, k, rank_set
        self.ranks = ranks_for(rank_set, k)
        self.scales = [16.0 / r for r in self.ranks]
        self.t = k * TOKENS
        self.meta = K.build_lora_meta([TOKENS] * k, self.ranks, self.scales, device)
        r = sum(self.ranks)
        rows = 1 if tiny else self.t  # tiny: shapes for compiling only, never launched
        g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{hidden} {k} {rank_set}".encode()))

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)

        self.x = rnd(rows, hidden)
        self.y = rnd(rows, hidden)
        self.dy = rnd(rows, hidden)
        self.dx = rnd(rows, hidden)
        self.A = rnd(r, hidden, scale=hidden**-0.5)
        self.B = rnd(r, hidden, scale=0.01)
        self.S = self._low_rank(rnd)
        self.dS = self._low_rank(rnd)

    def _low_rank(self, rnd) -> torch.Tensor:
        """A packed S'/dS as the kernels leave it: compute dtype, zeros in the padding."""
        buf = rnd(max(self.meta.s_numel, 1))
        m = self.meta
        for k in range(m.num_adapters):
            n, r = m.tokens_host[k], m.ranks_host[k]
            s0, s1 = m.s_offsets_host[k], m.s_offsets_host[k + 1]
            buf[s0:s1].view(n, -1)[:, r:] = 0
        return buf

    def pass_bytes(self) -> int:
        """One pass over every adapter's rows: K·T·hidden elements."""
        return self.t * self.hidden * self.x.element_size()

    def floor_bytes(self) -> int:
        return 7 * self.pass_bytes()

    def min_bytes(self) -> int:
        """The floor plus the adapters' own traffic (A, B, dA, dB and S', dS; module docstring)."""
        return self.floor_bytes() + 6 * sum(self.ranks) * (self.hidden + TOKENS) * self.x.element_size()

    def roof_ms(self, rates: dict) -> float:
        """The least time any implementation of the op can take here (module docstring)."""
        own = self.min_bytes() - self.floor_bytes()
        read = max(rates["read"], rates["copy"])  # a read-only pass is never slower than a copy's
        memory = 3 * self.pass_bytes() / read + (4 * self.pass_bytes() + own) / rates["copy"]
        flops = 12 * TOKENS * self.hidden * sum(self.ranks)
        return max(memory, flops / rates["matmul"]) * 1e3


# ---------------------------------------------------------------- stage runners (sweep)

def run_stage(kind: str, p: Problem, out: dict | None = None):
    """Run one stage of the op on p; fill ``out`` with its result for checking."""
    if kind == "shrink":
        s = T.shrink_stage(p.x, p.A, p.meta)
        if out is not None:
            out["S"] = s
    elif kind == "expand":
        y = torch.zeros_like(p.y) if out is not None else p.y
        T.expand_stage(p.S, p.B, p.meta, y)
        if out is not None:
            out["y"] = y
    elif kind == "wgrad":
        db = T.wgrad_stage(p.S, p.dy, p.meta, p.B)
        if out is not None:
            out["dB"] = db
    elif kind in ("dy_pair", "dy_split", "dy_band", "dy_block"):
        with T.tile_overrides(dy_mode=kind[3:]):
            ds, db = T.dy_stage(p.dy, p.S, p.B, p.meta)
        if out is not None:
            out["dS"], out["dB"] = ds, db
    else:
        raise KeyError(kind)


def stage_reference(kind: str, p: Problem) -> dict:
    """float32 torch results of one stage (the oracle of every variant)."""
    m = p.meta
    f32 = dict(dtype=torch.float32, device=p.x.device)
    if kind == "shrink":
        return {"S": REF.lora_forward_ref(p.x, p.A, p.B, m, torch.zeros_like(p.y))}
    y = torch.zeros(p.t, p.hidden, **f32)
    ds = torch.zeros(p.S.shape, **f32)
    db = torch.zeros(p.B.shape, **f32)
    for k in range(m.num_adapters):
        t0, t1 = m.token_starts_host[k], m.token_starts_host[k + 1]
        r0, r1 = m.rank_starts_host[k], m.rank_starts_host[k + 1]
        sl = (slice(t0, t1), slice(r0, r1), slice(m.s_offsets_host[k], m.s_offsets_host[k + 1]))
        sk = REF._rows(p.S, *sl).float()
        dyk = p.dy[t0:t1].float()
        y[t0:t1] = sk @ p.B[r0:r1].float()
        REF._rows(ds, *sl).copy_(m.scales_host[k] * dyk @ p.B[r0:r1].float().t())
        db[r0:r1] = sk.t() @ dyk
    return {"expand": {"y": y}, "wgrad": {"dB": db}}.get(kind, {"dS": ds, "dB": db})


def set_tiles(tiles: dict, large: dict | None = None) -> None:
    T.TILES.clear()
    T.TILES.update(tiles)
    T.TILES_LARGE.clear()
    T.TILES_LARGE.update(large or {})


# ---------------------------------------------------------------- parallel compilation

def _warm_op(meta, d_in: int, d_out: int) -> None:
    """Run (compile) every launch of the op's forward and of each backward mode."""
    r = max(meta.total_rank, 1)

    def z(*shape, dtype=DTYPE):
        return torch.zeros(*shape, device=DEVICE, dtype=dtype)

    x, y, dy, dx, A, B = z(1, d_in), z(1, d_out), z(1, d_out), z(1, d_in), z(r, d_in), z(r, d_out)
    S = T.shrink_stage(x, A, meta)
    T.expand_stage(S, B, meta, y)
    for mode in ("split", "pair"):
        with T.tile_overrides(dy_mode=mode):
            dS, _ = T.dy_stage(dy, S, B, meta)
        T.x_stage(dS, x, A, meta, dx)


def _compile_only() -> None:
    """Make this process compile kernels without launching them (and on one stream): the
    compile workers fill Triton's on-disk cache for the timing process."""

    def warm(kernel, grid, *args, **kwargs) -> None:
        kernel.warmup(*args, grid=grid, **kwargs)

    T._launch = warm
    T._streams_on = lambda device: False


def _compile_worker(tasks):
    """Compile (never launch) every task's kernels into Triton's on-disk cache."""
    _compile_only()
    done, errors = 0, []
    for kind, cfg, shape, tiles in tasks:
        try:
            set_tiles({(k.split(":")[0], int(k.split(":")[1])): tile(c) for k, c in tiles.items()})
            if kind == "check":
                tokens, ranks, d_in, d_out = CHECK_CASES[shape]
                _warm_op(K.build_lora_meta(tokens, ranks, [1.0] * len(ranks), DEVICE), d_in, d_out)
            elif kind is None:
                p = Problem(*shape, tiny=True)
                _warm_op(p.meta, p.hidden, p.hidden)
            else:
                p = Problem(*shape, tiny=True)
                set_tiles({(kind, rp): tile(cfg) for rp in p.meta.buckets})
                run_stage(kind, p)
            done += 1
        except Exception as e:  # recorded; the timing pass meets it again and reports it
            errors.append(f"{kind} {cfg} {shape}: {type(e).__name__}: {e}")
    return done, errors


def precompile(tasks: list, jobs: int, log) -> None:
    """Fill Triton's cache from ``jobs`` processes: compiling dominates a cold sweep."""
    if jobs <= 1 or not tasks or DEVICE != "cuda":
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    groups: dict = {}
    for task in tasks:  # one (kind, cfg) per worker call, so shared shapes compile once
        groups.setdefault((task[0], cfg_key(task[1] or ())), []).append(task)
    done, errs = 0, []
    try:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            for d, es in pool.map(_compile_worker, list(groups.values())):
                done += d
                errs += es
    except Exception as e:  # a dead worker: the timing pass compiles what is missing
        errs.append(f"pool: {type(e).__name__}: {e}")
    log(f"precompiled {done}/{len(tasks)} tasks in {time.time() - t0:.1f}s with {jobs} processes"
        + (f"; {len(errs)} errors, first: {errs[0]}" if errs else ""))


# ---------------------------------------------------------------- timing

def _t_host(fn) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def t_graph(fn, rep: int = 15) -> float:
    """GPU time of fn (ms, median), launches replayed from a CUDA graph."""
    import triton.testing as tt

    if DEVICE != "cuda":
        return _t_host(fn)

    return tt.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def t_eager(fn, budget_ms: float = 20.0) -> float:
    """Time per call of fn issued back to back (ms): host launch overhead shows when it binds."""
    if DEVICE != "cuda":
        return _t_host(fn)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    est = max(a.elapsed_time(b), 1e-3)
    n = int(min(200, max(3, budget_ms / est)))
    times = []
    for _ in range(3):
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / n)
    return sorted(times)[1]


def copy_bandwidth() -> tuple[float, float]:
    """Device copy bandwidth (bytes/s, bytes read plus bytes written): copies issued back to
    back, and the same from a CUDA graph (where a copy may go to the copy engines)."""
    n = 1 << 29 if DEVICE == "cuda" else 1 << 20  # 1 GiB of bf16
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    eager = t_eager(lambda: dst.copy_(src), budget_ms=50.0)
    graph = t_graph(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 2 / (eager * 1e-3), 2 * n * 2 / (graph * 1e-3)


def stream_rates() -> dict:
    """The ceilings every row is judged against, measured once per run: copy bandwidth (eager
    and from a CUDA graph), read-only bandwidth, and the bf16 tensor-core rate of cuBLAS."""
    copy, copy_graph = copy_bandwidth()
    n = 1 << 29 if DEVICE == "cuda" else 1 << 20
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    read = n * 2 / (t_eager(lambda: src.sum(dtype=torch.float32), budget_ms=50.0) * 1e-3)
    del src
    m = 8192 if DEVICE == "cuda" else 256
    a, b = (torch.randn(m, m, device=DEVICE, dtype=DTYPE) for _ in range(2))
    matmul = 2 * m**3 / (t_eager(lambda: a @ b, budget_ms=50.0) * 1e-3)
    del a, b
    return {"copy": copy, "copy_graph": copy_graph, "read": read, "matmul": matmul}


def plora_fns(p: Problem):
    state = {}

    def fwd():
        state["S"] = T.lora_forward(p.x, p.A, p.B, p.meta, p.y)

    def bwd():
        T.lora_backward(p.dy, p.x, state["S"], p.A, p.B, p.meta, p.dx)

    def both():
        fwd()
        bwd()

    # Build every schedule now, and let its host-to-device copy land: the timers run the
    # op on a side stream, which does not wait for the default stream.
    both()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return fwd, bwd, both


def loop_fns(p: Problem):
    """The loop over adapters as plain torch autograd: slices in, cat out."""
    x = p.x.detach().clone().requires_grad_(True)
    bounds = [(p.meta.token_starts_host[k], p.meta.token_starts_host[k + 1],
               p.meta.rank_starts_host[k], p.meta.rank_starts_host[k + 1]) for k in range(p.k)]
    As = [p.A[r0:r1].detach().clone().requires_grad_(True) for _, _, r0, r1 in bounds]
    Bs = [p.B[r0:r1].detach().clone().requires_grad_(True) for _, _, r0, r1 in bounds]
    leaves = [x, *As, *Bs]

    def fwd():
        parts = [s * (x[t0:t1] @ a.t()) @ b for (t0, t1, _, _), a, b, s in zip(bounds, As, Bs, p.scales)]
        return p.y + torch.cat(parts)

    return _autograd_fns(fwd, leaves, p.dy)


def bmm_fns(p: Problem):
    """All adapters as one batched product (only possible when every rank is equal)."""
    if len(set(p.ranks)) != 1:
        return None
    r = p.ranks[0]
    x = p.x.detach().clone().requires_grad_(True)
    A3 = p.A.detach().view(p.k, r, p.hidden).clone().requires_grad_(True)
    B3 = p.B.detach().view(p.k, r, p.hidden).clone().requires_grad_(True)
    s3 = torch.tensor(p.scales, device=p.x.device, dtype=p.x.dtype).view(p.k, 1, 1)

    def fwd():
        x3 = x.view(p.k, TOKENS, p.hidden)
        return p.y + torch.bmm(torch.bmm(x3, A3.transpose(1, 2)) * s3, B3).view(p.t, p.hidden)

    return _autograd_fns(fwd, [x, A3, B3], p.dy)


def _autograd_fns(fwd_out, leaves, dy):
    held = {}

    def fwd():
        held["out"] = fwd_out()

    fwd()

    def bwd():
        for t in leaves:
            t.grad = None
        held["out"].backward(dy, retain_graph=True)

    def both():
        for t in leaves:
            t.grad = None
        fwd_out().backward(dy)

    return fwd, bwd, both


# ---------------------------------------------------------------- the parts of a run

def check_bf16(log) -> list[dict]:
    """The whole autograd op in bf16 against a float64 oracle, on a few awkward shapes."""
    rows = []
    cases = CHECK_CASES
    for tokens, ranks, d_in, d_out in cases:
        for mode in ("split", "pair", "block", None):  # None: the committed modes
            g = torch.Generator(device=DEVICE).manual_seed(len(tokens) * 7 + d_in)
            t, r = sum(tokens), sum(ranks)

            def rnd(*s, scale=1.0):
                return (torch.randn(*s, generator=g, device=DEVICE) * scale).to(DTYPE)

            x, w, b = rnd(t, d_in), rnd(d_out, d_in, scale=d_in**-0.5), rnd(d_out)
            A, B, dy = rnd(r, d_in, scale=d_in**-0.5), rnd(r, d_out, scale=0.3), rnd(t, d_out)
            scales = [16.0 / q for q in ranks]
            meta = K.build_lora_meta(tokens, ranks, scales, DEVICE)
            xs, As, Bs = (v.clone().requires_grad_(True) for v in (x, A, B))
            with T.tile_overrides(dy_mode=mode):
                y = K.packed_lora_linear(xs, w, b, As, Bs, meta)
                y.backward(dy)
            # oracle: float64 autograd of the formula
            xo, Ao, Bo = (v.double().requires_grad_(True) for v in (x, A, B))
            parts, t0, r0 = [], 0, 0
            for n, q, s in zip(tokens, ranks, scales):
                parts.append(s * (xo[t0:t0 + n] @ Ao[r0:r0 + q].t()) @ Bo[r0:r0 + q])
                t0, r0 = t0 + n, r0 + q
            yo = xo @ w.double().t() + b.double() + torch.cat(parts)
            yo.backward(dy.double())
            errs = {"y": rel_err(y, yo), "dx": rel_err(xs.grad, xo.grad),
                    "dA": rel_err(As.grad, Ao.grad), "dB": rel_err(Bs.grad, Bo.grad)}
            ok = all(e < 3e-2 for e in errs.values())
            rows.append({"tokens": len(tokens), "d_in": d_in, "d_out": d_out, "dy_mode": mode, "ok": ok, **errs})
            log(f"check bf16 K={len(tokens)} {d_in}x{d_out} {mode}: {'ok' if ok else 'FAIL'} "
                + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    return rows


def _matches(shape: tuple, patterns: str | None) -> bool:
    """Whether (hidden, K, ranks) matches one of "h:K:ranks,..." ('*' matches any)."""
    if not patterns:
        return True
    return any(all(p in ("*", str(v)) for p, v in zip(pat.split(":"), shape)) for pat in patterns.split(",") if pat)


def sweep_plan() -> tuple[list, dict]:
    """Shapes and stage variants to sweep (``--sweep-shapes``, ``--sweep-kinds`` narrow them)."""
    pattern = os.environ.get("PLORA_SWEEP_SHAPES")
    shapes = [s for s in dict.fromkeys(SWEEP_SHAPES + EXTRA_SWEEP_SHAPES) if _matches(s, pattern)] if pattern else SWEEP_SHAPES
    kinds = os.environ.get("PLORA_SWEEP_KINDS")
    stages = {k: v for k, v in SWEEP.items() if not kinds or k in kinds.split(",")}
    return shapes, stages


def cfg_of(t: T.TileConfig) -> list:
    """A TileConfig as a sweep entry (bt, bh, warps, stages, waves[, other fields])."""
    extra = {f: getattr(t, f) for f in ("max_chunk", "bt2", "bh2", "ystages", "hfirst", "tacc", "block")
             if getattr(t, f) != getattr(T.TileConfig(), f)}
    return [t.bt, t.bh, t.warps, t.stages, t.waves] + ([extra] if extra else [])


def sweep(jobs: int, log, out: Path) -> dict:
    """Time every tile variant of every stage; return the best tiles per (stage, bucket).

    Stages and buckets left out of the sweep keep their committed tiles in the result."""
    shapes, stages = sweep_plan()
    committed = {f"{k}:{rp}": cfg_of(t) for (k, rp), t in T.TILES.items()}
    committed_large = {f"{k}:{rp}": cfg_of(t) for (k, rp), t in T.TILES_LARGE.items()}
    tasks = []
    for shape in shapes:
        rp = K.rank_bucket(ranks_for(shape[2], shape[1])[0])
        for kind, cfgs in stages.items():
            tasks += [(kind, cfg, shape, {}) for cfg in cfgs if fits(kind, rp, cfg)]
    precompile(tasks, jobs, log)
    rows = []
    for shape in shapes:
        p = Problem(*shape)
        rp = K.rank_bucket(p.ranks[0])
        for kind, cfgs in stages.items():
            want = stage_reference(kind, p)
            for cfg in cfgs:
                if not fits(kind, rp, cfg):
                    continue
                set_tiles({(kind, rp): tile(cfg)})
                row = {"hidden": shape[0], "K": shape[1], "ranks": shape[2], "kind": kind, "rp": rp, "cfg": list(cfg)}
                try:
                    got = {}
                    run_stage(kind, p, got)
                    if DEVICE == "cuda":
                        torch.cuda.synchronize()
                    row["err"] = max(rel_err(got[n], want[n]) for n in want)
                    row["ms"] = t_graph(lambda: run_stage(kind, p), rep=10)
                    row["floor_passes"] = {"shrink": 1, "expand": 2, "wgrad": 1, "dy_pair": 1, "dy_band": 1,
                                          "dy_block": 1}[kind]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
        set_tiles({})
        del p
        torch.cuda.empty_cache()
        log(f"swept {shape}")
        (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    choice = pick_tiles(rows, log)
    swept = {f"{r['kind']}:{r['rp']}" for r in rows}
    choice["tiles"] = {**committed, **choice["tiles"]}
    choice["large"] = {**{k: v for k, v in committed_large.items() if k not in swept}, **choice["large"]}
    choice["dy_mode_large"] = {**{rp: m for rp, m in T.DY_MODE_LARGE.items() if rp not in choice["dy_mode"]},
                               **choice["dy_mode_large"]}
    choice["dy_mode"] = {**T.DY_MODE, **choice["dy_mode"]}
    return choice


def pick_tiles(rows: list[dict], log) -> dict:
    """Per (stage, bucket): among variants that computed right, the config whose worst time
    over the swept shapes, relative to each shape's fastest, is least (a config that wins
    the large shapes can lose the small ones by 2×: a sum hides that, the worst case not)."""
    good = [r for r in rows if "ms" in r and r.get("err", 1) < 2e-2]

    def shape(r):
        return r["hidden"], r["K"], r["ranks"]

    def worst_case(rs: list) -> dict:
        """config -> its worst time over the shapes of ``rs``, relative to each one's fastest."""
        shapes = {shape(r) for r in rs}
        mins = {s: min(r["ms"] for r in rs if shape(r) == s) for s in shapes}
        score: dict = {}
        for r in rs:
            score.setdefault(cfg_key(r["cfg"]), []).append(r["ms"] / mins[shape(r)])
        return {c: max(v) for c, v in score.items() if len(v) == len(shapes)}

    def large(s: tuple) -> bool:
        """Whether a shape's launches are past `LARGE_ELEMS` (they take the large tables)."""
        return s[1] * TOKENS * s[0] > T.LARGE_ELEMS

    best: dict = {}
    best_large: dict = {}
    for kind in SWEEP:
        for rp in sorted({r["rp"] for r in good if r["kind"] == kind}):
            rs = [r for r in good if r["kind"] == kind and r["rp"] == rp]
            small = [r for r in rs if not large(shape(r))] or rs
            full = worst_case(small)
            if full:
                best[(kind, rp)] = min(full, key=full.get)
            big = worst_case([r for r in rs if large(shape(r))])
            if big:  # its own pick when the small one fails there or is 2% slower
                c, small_pick = min(big, key=big.get), best.get((kind, rp))
                if small_pick not in big or big[c] < 0.98 * big[small_pick]:
                    best_large[(kind, rp)] = c
    # dy side per bucket and size class, on the swept shapes: one launch (pair, block,
    # band) or shrink + wgrad
    dy_mode: dict = {}
    dy_mode_large: dict = {}
    for rp in sorted({r["rp"] for r in good}):
        def tbest(kind, s):
            c = (large(s) and best_large.get((kind, rp))) or best.get((kind, rp))
            v = [r["ms"] for r in good if r["kind"] == kind and r["rp"] == rp and cfg_key(r["cfg"]) == c
                 and shape(r) == s]
            return v[0] if v else math.inf

        def worst_modes(shapes: list) -> dict:
            t = {"pair": [tbest("dy_pair", s) for s in shapes],
                 "block": [tbest("dy_block", s) for s in shapes],
                 "split": [tbest("shrink", s) + tbest("wgrad", s) for s in shapes]}
            if rp <= T.BAND_MAX_RANK:  # past it a "band" bucket runs "pair"
                t["band"] = [tbest("dy_band", s) for s in shapes]
            fastest = [min(v[i] for v in t.values()) for i in range(len(shapes))]
            return {m: max((x / f for x, f in zip(v, fastest) if math.isfinite(f)), default=math.inf)
                    for m, v in t.items()}

        shapes = sorted({shape(r) for r in good if r["rp"] == rp})
        big = [s for s in shapes if large(s)]
        small = [s for s in shapes if s not in big] or shapes
        worst = worst_modes(small)
        if not math.isfinite(min(worst.values())):
            continue  # the dy side was not swept for this bucket
        dy_mode[rp] = min(worst, key=worst.get)
        log(f"bucket {rp}: dy side, worst over {len(small)} shapes against the fastest mode: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in worst.items()) + f" -> {dy_mode[rp]}")
        worst = worst_modes(big) if big else {}
        if worst and math.isfinite(min(worst.values())):
            m = min(worst, key=worst.get)
            if m != dy_mode[rp] and worst[m] < 0.98 * worst[dy_mode[rp]]:  # its own pick when 2% better
                dy_mode_large[rp] = m
            log(f"bucket {rp}: past {T.LARGE_ELEMS} elements, worst over {len(big)} shapes: "
                + ", ".join(f"{k} {v:.2f}x" for k, v in worst.items()) + f" -> {dy_mode_large.get(rp, dy_mode[rp])}")
    for (kind, rp), c in sorted(best.items()):
        log(f"best {kind:9s} rp={rp:3d}: {c}" + (f"; past {T.LARGE_ELEMS} elements {best_large[(kind, rp)]}"
                                                  if (kind, rp) in best_large else ""))
    return {"tiles": {f"{k}:{rp}": json.loads(c) for (k, rp), c in best.items()},
            "large": {f"{k}:{rp}": json.loads(c) for (k, rp), c in best_large.items()}, "dy_mode": dy_mode,
            "dy_mode_large": dy_mode_large}


def _keyed(tiles: dict) -> dict:
    return {(k.split(":")[0], int(k.split(":")[1])): tile(c) for k, c in tiles.items()}


def apply_tiles(choice: dict) -> None:
    set_tiles(_keyed(choice["tiles"]), _keyed(choice.get("large", {})))
    T.DY_MODE.clear()
    T.DY_MODE.update({int(k): v for k, v in choice["dy_mode"].items()})
    T.DY_MODE_LARGE.clear()
    T.DY_MODE_LARGE.update({int(k): v for k, v in choice.get("dy_mode_large", {}).items()})


def table(log, out: Path, start: int) -> None:
    """Rows ``start:`` of the table, each appended to rows.jsonl as soon as it is measured."""
    rates = stream_rates()
    bw = rates["copy"]
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s (from a CUDA graph: {rates['copy_graph'] / 1e9:.0f} GB/s), "
        f"read-only {rates['read'] / 1e9:.0f} GB/s, bf16 matmul {rates['matmul'] / 1e12:.0f} TFLOP/s")
    for i, (h, k, rs) in enumerate(table_shapes()):
        if i < start:
            continue
        if os.environ.get("PLORA_BENCH_FAIL_ROW") == str(i):  # exercises the recovery path
            os._exit(3)
        p = Problem(h, k, rs)
        row = {"i": i, "hidden": h, "K": k, "ranks": rs, "copy_GBps": bw / 1e9, "floor_ms": p.floor_bytes() / bw * 1e3,
               "min_ms": p.min_bytes() / bw * 1e3, "roof_ms": p.roof_ms(rates), "read_GBps": rates["read"] / 1e9,
               "matmul_TFLOPs": rates["matmul"] / 1e12}
        f, b, fb = plora_fns(p)
        row.update(plora_fwd=t_graph(f), plora_bwd=t_graph(b), plora_both=t_graph(fb), plora_both_eager=t_eager(fb))
        if len(p.meta.buckets) > 1:  # rank buckets on their own streams, and on one
            default = T.BUCKET_STREAMS
            for on in (True, False):
                T.BUCKET_STREAMS = on
                row["plora_both_streams" if on else "plora_both_1stream"] = t_graph(fb)
            T.BUCKET_STREAMS = default
        del f, b, fb
        lf, lb, lfb = loop_fns(p)
        row.update(loop_fwd=t_eager(lf), loop_bwd=t_eager(lb), loop_both=t_eager(lfb))
        del lf, lb, lfb
        fns = bmm_fns(p)
        if fns:
            row.update(bmm_fwd=t_eager(fns[0]), bmm_bwd=t_eager(fns[1]), bmm_both=t_eager(fns[2]))
        del p, fns
        torch.cuda.empty_cache()
        log(fmt_row(row))
        with open(out / "rows.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")


def diagnose(log, i: int) -> None:
    """Re-run one table row stage by stage, synchronizing after each, to name what fails."""
    h, k, rs = table_shapes()[i]
    p = Problem(h, k, rs)
    steps = [
        ("shrink x", lambda: T.shrink_stage(p.x, p.A, p.meta)),
        ("expand y", lambda: T.expand_stage(p.S, p.B, p.meta, p.y)),
        ("dy split", lambda: run_stage("dy_split", p)),
        ("dy pair", lambda: run_stage("dy_pair", p)),
        ("dA", lambda: T.wgrad_stage(p.dS, p.x, p.meta, p.A)),
        ("dx", lambda: T.expand_stage(p.dS, p.A, p.meta, p.dx)),
        ("graph fwd", lambda: t_graph(plora_fns(p)[0])),
        ("graph both", lambda: t_graph(plora_fns(p)[2])),
    ]
    for name, fn in steps:
        try:
            fn()
            torch.cuda.synchronize()
            log(f"diagnose row {i} ({h}, {k}, {rs}): {name} ok")
        except Exception as e:
            log(f"diagnose row {i} ({h}, {k}, {rs}): {name} FAILED: {type(e).__name__}: {str(e)[:200]}")
            return


def _kernel_times(fn, calls: int = 5) -> list[tuple[float, float, str]]:
    """(µs per call, launches per call, name) of every kernel fn runs, longest first."""
    cuda = DEVICE == "cuda"
    acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    per: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA or not cuda:
            name = e.name.split("(")[0][:40]
            n, us = per.get(name, (0, 0.0))
            per[name] = (n + 1, us + (e.device_time if cuda else e.cpu_time))
    return sorted(((us / calls, n / calls, name) for name, (n, us) in per.items()), reverse=True)


def trace_rows(log, out: Path) -> None:
    """Per table row: GPU time of each kernel of one fwd + bwd (torch.profiler, 5 calls),
    against the op's CUDA-graph time: what each launch costs where the op is slow; and the
    loop's kernels, to show where its time goes."""
    rows = []
    bw = copy_bandwidth()[0]
    for h, k, rs in table_shapes():
        p = Problem(h, k, rs)
        f, b, fb = plora_fns(p)
        total = t_graph(fb)
        parts = _kernel_times(fb)
        busy = sum(u for u, _, _ in parts)
        loop_parts = _kernel_times(loop_fns(p)[2], calls=3)
        loop_busy = sum(u for u, _, _ in loop_parts)
        row = {"hidden": h, "K": k, "ranks": rs, "graph_us": total * 1e3, "kernels_us": busy,
               "floor_us": p.floor_bytes() / bw * 1e6, "min_us": p.min_bytes() / bw * 1e6,
               "kernels": [{"name": nm, "per_call": c, "us": u} for u, c, nm in parts],
               "loop_kernels_us": loop_busy,
               "loop_kernels": [{"name": nm, "per_call": c, "us": u} for u, c, nm in loop_parts],
               "s_atomic": any(pl[2] > 1 for pl in [T._plan(p.meta, "shrink", rp, h, T._num_sms(p.x.device))
                                                    for rp in p.meta.buckets])}
        rows.append(row)
        log(f"trace {h} {k} {rs}: graph {total * 1e3:.0f} us, floor {row['floor_us']:.0f} us, min {row['min_us']:.0f} us, kernels {busy:.0f} us: "
            + ", ".join(f"{nm} {u:.0f}us x{c:g}" for u, c, nm in parts))
        log(f"trace {h} {k} {rs}: loop kernels {loop_busy:.0f} us: "
            + ", ".join(f"{nm} {u:.0f}us x{c:g}" for u, c, nm in loop_parts[:8]))
        del p, f, b, fb
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    (out / "trace.json").write_text(json.dumps(rows, indent=1))


def library_stages(p: Problem) -> dict:
    """Each stage of the op, and the same product from library GEMMs, for equal ranks.

    torch's grouped GEMM (CUTLASS on Hopper: TMA loads, warp-specialized) takes the jagged
    segments; cuBLAS's batched GEMM needs equal segments. Neither scales by adapter nor
    accumulates into y in place (grouped: a separate add, one more pass over y), so they
    are the best a library gets per product, not a drop-in op."""
    F = torch.nn.functional
    m, n, h, G = p.meta, p.t, p.hidden, p.k
    r = p.ranks[0]
    A3, B3 = p.A.view(G, r, h), p.B.view(G, r, h)
    offs = torch.tensor(m.token_starts_host[1:], dtype=torch.int32, device=p.x.device)
    rp = K.rank_bucket(r)  # the packed S'/dS rows are rp wide; the libraries get dense copies
    S2, dS2 = (b.view(n, rp)[:, :r].contiguous() for b in (p.S, p.dS))
    S3, dS3 = S2.view(G, TOKENS, r), dS2.view(G, TOKENS, r)
    x3, y3 = p.x.view(G, TOKENS, h), p.y.view(G, TOKENS, h)
    fns = {
        "shrink": lambda: T.shrink_stage(p.x, p.A, m),
        "grouped shrink": lambda: F.grouped_mm(p.x, A3.transpose(1, 2), offs=offs),
        "bmm shrink": lambda: torch.bmm(x3, A3.transpose(1, 2)),
        "expand": lambda: T.expand_stage(p.S, p.B, m, p.y),
        "grouped expand + add": lambda: p.y.add_(F.grouped_mm(S2, B3, offs=offs)),
        "baddbmm expand": lambda: y3.baddbmm_(S3, B3),
        "wgrad": lambda: T.wgrad_stage(p.dS, p.x, m, p.A),
        "grouped wgrad": lambda: F.grouped_mm(dS2.t(), p.x, offs=offs),
        "bmm wgrad": lambda: torch.bmm(dS3.transpose(1, 2), x3),
        "dy side": lambda: T.dy_stage(p.dy, p.S, p.B, m),
    }
    out = {}
    for name, fn in fns.items():
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        out[name] = t_graph(fn) * 1e3
    return out


def library_rows(log, out: Path) -> None:
    """Per-stage µs of the equal-rank table rows (``--only`` narrows) against library GEMMs."""
    bw = copy_bandwidth()[0]
    rows = []
    for h, k, rs in table_shapes():
        if not rs.isdigit() or k < 8:
            continue
        p = Problem(h, k, rs)
        row = {"hidden": h, "K": k, "ranks": rs, "pass_us": p.pass_bytes() / bw * 1e6,
               **library_stages(p)}
        rows.append(row)
        log(f"library {h} {k} {rs}: one pass {row['pass_us']:.1f} us; "
            + ", ".join(f"{name} {v:.1f}" for name, v in row.items() if isinstance(v, float) and name != "pass_us"))
        del p
        torch.cuda.empty_cache()
    (out / "library.json").write_text(json.dumps(rows, indent=1))


def table_shapes() -> list[tuple]:
    shapes = [(h, k, rs) for h in HIDDEN for k in KS for rs in RANK_SETS]
    shapes += [(h, 32, "31x8+1x128") for h in HIDDEN if 32 in KS]
    return [s for s in shapes if _matches(s, os.environ.get("PLORA_BENCH_ONLY"))]


def layer_rows(log) -> list[dict]:
    """Whole layer (base GEMMs + LoRA) vs the base alone: what the LoRA part adds."""
    rows = []
    for h, k, rs in LAYER_SHAPES:
        p = Problem(h, k, rs)
        w = (torch.randn(h, h, device=DEVICE) * h**-0.5).to(DTYPE)
        x = p.x.detach().clone().requires_grad_(True)
        A, B = p.A.clone().requires_grad_(True), p.B.clone().requires_grad_(True)

        def base():
            x.grad = None
            torch.nn.functional.linear(x, w).backward(p.dy)

        def layer():
            x.grad = A.grad = B.grad = None
            K.packed_lora_linear(x, w, None, A, B, p.meta).backward(p.dy)

        rows.append({"hidden": h, "K": k, "ranks": rs, "base_ms": t_eager(base), "layer_ms": t_eager(layer)})
        log(f"layer h={h} K={k} {rs}: base {rows[-1]['base_ms']:.3f} ms, with LoRA {rows[-1]['layer_ms']:.3f} ms")
    return rows


def fmt_row(r: dict) -> str:
    def g(key):
        v = r.get(key)
        return f"{v:8.3f}" if isinstance(v, float) else f"{'-':>8s}"

    fl = r.get("floor_ms", math.nan)
    ratio = r.get("plora_both", math.nan) / fl
    speed = r.get("loop_both", math.nan) / r.get("plora_both", math.nan)
    return (f"| {r['hidden']:5d} | {r['K']:2d} | {r['ranks']:>10s} | {g('plora_fwd')} | {g('plora_bwd')} | "
            f"{g('plora_both')} | {g('plora_both_eager')} | {g('loop_fwd')} | {g('loop_bwd')} | {g('loop_both')} | "
            f"{g('bmm_fwd')} | {g('bmm_bwd')} | {g('bmm_both')} | {fl:8.3f} | {ratio:5.2f} | {speed:6.1f} |"
            + (f" {r['error']}" if "error" in r else ""))


HEADER = ("| hidden | K | ranks | plora fwd | plora bwd | plora both | both eager | loop fwd | loop bwd | loop both "
          "| bmm fwd | bmm bwd | bmm both | floor | both/floor | loop/plora |\n" + "|---" * 16 + "|")


def smoke() -> None:
    """Shrink everything so the script's own logic runs on CPU through the interpreter."""
    global HIDDEN, KS, TOKENS, DEVICE, DTYPE, SWEEP_SHAPES, LAYER_SHAPES, CHECK_CASES
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["PLORA_KERNELS"] = "triton"
    HIDDEN, KS, TOKENS, DEVICE, DTYPE = [64], [1, 2], 40, "cpu", torch.float32
    SWEEP_SHAPES = [(64, 2, "32"), (48, 2, "128")]
    LAYER_SHAPES = [(64, 2, "mixed")]
    CHECK_CASES = [([0, 1, 37, 5], [8, 128, 100, 1], 40, 56)]
    for kind in SWEEP:
        SWEEP[kind] = [c for c in SWEEP[kind] if c[0] <= 64][:1] + [c for c in SWEEP[kind] if c[0] <= 64][-1:]


SHORT_HEADER = ("| hidden | K | ranks | plora both | bucket streams | eager | loop both | bmm both | floor "
                "| both/floor | min | both/min | roof | both/roof | loop/plora | loop/min | loop/roof |\n"
                + "|---" * 17 + "|")


def fmt_short(r: dict) -> str:
    def g(key):
        v = r.get(key)
        return f"{v:.3f}" if isinstance(v, float) else "-"

    pb, loop, least, roof = (r.get(key, math.nan) for key in ("plora_both", "loop_both", "min_ms", "roof_ms"))
    return (f"| {r['hidden']} | {r['K']} | {r['ranks']} | {g('plora_both')} | {g('plora_both_streams')} | "
            f"{g('plora_both_eager')} | "
            f"{g('loop_both')} | {g('bmm_both')} | {g('floor_ms')} | {pb / r['floor_ms']:.2f} | "
            f"{g('min_ms')} | {pb / least:.2f} | {g('roof_ms')} | {pb / roof:.2f} | {loop / pb:.1f} | "
            f"{loop / least:.1f} | {loop / roof:.1f} |"
            + (" ERR" if "error" in r else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    ap.add_argument("--sweep", action="store_true", help="tile sweep first; table on the best tiles")
    ap.add_argument("--tiles", type=Path, help="tiles.json of an earlier sweep to use")
    ap.add_argument("--no-table", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in Triton's interpreter")
    ap.add_argument("--trace", action="store_true", help="per-kernel GPU times of the table rows (no table)")
    ap.add_argument("--library", action="store_true",
                    help="equal-rank rows, K >= 8: each stage against torch's grouped GEMM and cuBLAS batched GEMMs")
    ap.add_argument("--sweep-kinds", help="stages to sweep, comma-separated (others keep their tiles)")
    ap.add_argument("--sweep-shapes", help="shapes to sweep: hidden:K:ranks patterns (default: the standard set)")
    ap.add_argument("--only", help="table rows to run: comma-separated hidden:K:ranks patterns, '*' matches any")
    ap.add_argument("--child", choices=["check", "table", "diagnose"], help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        smoke()
    if args.only:
        os.environ["PLORA_BENCH_ONLY"] = args.only  # children inherit it
    if args.sweep_kinds:
        os.environ["PLORA_SWEEP_KINDS"] = args.sweep_kinds
    if args.sweep_shapes:
        os.environ["PLORA_SWEEP_SHAPES"] = args.sweep_shapes
    args.out.mkdir(parents=True, exist_ok=True)
    logf = open(args.out / "log.txt", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    if args.tiles and args.tiles.exists():
        apply_tiles(json.loads(args.tiles.read_text()))
    if args.trace:
        return trace_rows(log, args.out)
    if args.library:
        return library_rows(log, args.out)
    if args.child == "check":
        result = {"check": check_bf16(log), "layer": layer_rows(log)}
        (args.out / "check.json").write_text(json.dumps(result, indent=1))
        return
    if args.child == "table":
        return table(log, args.out, args.start)
    if args.child == "diagnose":
        return diagnose(log, args.start)

    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    log(f"device {dev}, torch {torch.__version__}, triton {__import__('triton').__version__}")
    t0 = time.time()
    choice = None
    if args.sweep:
        choice = sweep(args.jobs, log, args.out)
        args.tiles = args.out / "tiles.json"
        args.tiles.write_text(json.dumps(choice, indent=1))
    elif args.tiles:
        choice = json.loads(args.tiles.read_text())
    log(f"[{time.time() - t0:.0f}s] tiles: {json.dumps(choice) if choice else 'defaults'}")
    tiles = (choice or {}).get("tiles", {})
    tasks = [("check", None, i, tiles) for i in range(len(CHECK_CASES))] if not args.no_check else []
    if not args.no_table:
        tasks += [(None, None, s, tiles) for s in table_shapes() + LAYER_SHAPES]
    precompile(tasks, args.jobs, log)

    # The measuring runs in child processes: a GPU fault kills a CUDA context for good, so
    # a crashed row is diagnosed in a fresh process and the table goes on after it.
    def child(mode: str, start: int = 0, timeout: float = 400, env: dict | None = None) -> int:
        cmd = [sys.executable, __file__, "--child", mode, "--start", str(start), "--out", str(args.out)]
        cmd += ["--tiles", str(args.tiles)] if args.tiles else []
        cmd += ["--smoke"] if args.smoke else []
        try:
            return subprocess.run(cmd, timeout=timeout, env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            log(f"child {mode} {start}: timed out")
            return -1

    if not args.no_check:
        rc = child("check", timeout=300)
        log(f"[{time.time() - t0:.0f}s] check done (rc {rc})")
    rows: list[dict] = []
    if not args.no_table:
        shapes = table_shapes()
        done_file = args.out / "rows.jsonl"
        start = 0
        while start < len(shapes):
            rc = child("table", start)
            done = [json.loads(line) for line in done_file.read_text().splitlines()] if done_file.exists() else []
            nxt = max([r["i"] for r in done], default=-1) + 1
            if nxt >= len(shapes):
                break
            log(f"row {nxt} {shapes[nxt]} failed (rc {rc}); diagnosing it in a fresh process")
            child("diagnose", nxt, timeout=120, env={"CUDA_LAUNCH_BLOCKING": "1"})
            h, k, rs = shapes[nxt]
            with open(done_file, "a") as fh:
                fh.write(json.dumps({"i": nxt, "hidden": h, "K": k, "ranks": rs, "floor_ms": math.nan,
                                     "error": f"crashed (rc {rc})"}) + "\n")
            start = nxt + 1
        rows = sorted((json.loads(line) for line in done_file.read_text().splitlines()), key=lambda r: r["i"])
    result = {"device": dev, "tiles": choice, "rows": rows}
    if (args.out / "check.json").exists():
        result.update(json.loads((args.out / "check.json").read_text()))
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    log(f"[{time.time() - t0:.0f}s] done")
    if rows:
        print(f"{dev}; times in ms (plora: CUDA-graph replays; 'eager': calls issued back to back; "
              f"loop/bmm: eager autograd); floor = 7 passes at the copy bandwidth measured in the same run "
              f"({rows[0].get('copy_GBps', math.nan):.0f} GB/s); min = the floor plus the adapters' A, B, dA, dB, "
              f"S', dS traffic; roof = min with its read-only passes at {rows[0].get('read_GBps', math.nan):.0f} GB/s, "
              f"or the products at {rows[0].get('matmul_TFLOPs', math.nan):.0f} TFLOP/s, whichever is longer")
        print(SHORT_HEADER)
        for r in rows:
            print(fmt_short(r))


if __name__ == "__main__":
    main()
