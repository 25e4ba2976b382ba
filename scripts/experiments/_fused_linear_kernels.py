"""Triton kernels of the base linear with the LoRA expand fused in (an experiment, not the
runtime path: see `fused_linear.py` beside this file and `scripts/bench_fused_linear.py`).

Loaded through `plora.kernels.triton_ops.kernels_module(path)`, in the same mode (compiled or
interpreted) as the runtime kernels whose helpers it shares.
"""

import triton
import triton.language as tl

from plora.kernels.triton_ops import kernels_module

_mm = kernels_module()._mm

# ---------------------------------------------------------------- the base linear with the expand fused in
#
# One program computes a BM × BN tile of
#
#     out = X Wᵀ (+ bias) + Σ over the segments k that cross the tile's rows: P_k L_k
#
# where P holds the packed low-rank rows (S', or dS in the backward) and L the stacked
# second factor (B in the forward, A for dx): the base product walks K in BK steps like any
# tiled GEMM, the LoRA term adds BR-rank steps, and the tile is stored once, so the expand's
# read and write of y (or dx) are gone (`fused_linear`). Rows outside every segment get the
# base product only. W is read through strides, so one kernel serves ``x Wᵀ`` (forward, W:
# out × in) and ``dy W`` (dx).


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program, row tiles grouped by GROUP_M so that the
    programs in flight share the W column tiles they read (L2 reuse)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _lora_terms(acc, P, L, seg0, tok_starts, rank_starts, ranks, s_offsets, buckets, NSEG, stride_l,
                pid_m, m0, rows, cols, mn, BM: tl.constexpr, BR: tl.constexpr, IEEE: tl.constexpr, dt):
    """acc + Σ over the segments crossing rows [m0, m0 + BM): P_k L_k on those rows."""
    seg = tl.load(seg0 + pid_m)
    ts = tl.load(tok_starts + seg)  # seg0 may be NSEG: tok_starts has NSEG + 1 entries
    offs_r = tl.arange(0, BR)
    while (seg < NSEG) & (ts < m0 + BM):
        te = tl.load(tok_starts + seg + 1)
        r = tl.load(ranks + seg)
        ro = tl.load(rank_starts + seg)
        rs = tl.load(buckets + seg)
        so = tl.load(s_offsets + seg)
        # rows of this tile inside the segment; P's row t - ts of the segment. P's
        # padding past the rank holds zeros, so P is loaded by its bucket (aligned
        # rows) and only L by the rank; chunks past the rank are never walked.
        ms = (rows >= ts - m0) & (rows < te - m0)
        p_base = P + so + (m0 - ts).to(tl.int64) * rs
        for r0 in range(0, r, BR):
            mr = offs_r < r - r0
            p = tl.load(p_base + (rows[:, None] * rs + (r0 + offs_r)[None, :]),
                        mask=ms[:, None] & (offs_r < rs - r0)[None, :], other=0.0).to(dt)
            lw = tl.load(L + (ro + r0).to(tl.int64) * stride_l + (offs_r[:, None] * stride_l + cols[None, :]),
                         mask=mr[:, None] & mn[None, :], other=0.0).to(dt)
            acc = _mm(p, lw, acc, IEEE)
        seg += 1
        ts = te
    return acc


@triton.jit
def _finish_tile(acc, BIAS, P, L, OUT, seg0, tok_starts, rank_starts, ranks, s_offsets, buckets, NSEG, stride_l,
                 stride_o, pid_m, m0, rows, cols, mm, mn, BM: tl.constexpr, BR: tl.constexpr,
                 HAS_BIAS: tl.constexpr, LORA: tl.constexpr, IEEE: tl.constexpr):
    """The LoRA terms and the bias added to a base-product tile, which is then stored once."""
    ct = OUT.dtype.element_ty
    if LORA:
        acc = _lora_terms(acc, P, L, seg0, tok_starts, rank_starts, ranks, s_offsets, buckets, NSEG, stride_l,
                          pid_m, m0, rows, cols, mn, BM, BR, IEEE, ct)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=mn, other=0.0).to(tl.float32)[None, :]
    o_ptrs = OUT + m0.to(tl.int64) * stride_o + (rows[:, None] * stride_o + cols[None, :])
    tl.store(o_ptrs, acc.to(ct), mask=mm[:, None] & mn[None, :])


@triton.jit
def linear_lora_kernel(
    X, W, BIAS, P, L, OUT,
    seg0, tok_starts, rank_starts, ranks, s_offsets, buckets,
    M, N, KD, NSEG,
    stride_x, stride_wk, stride_wn, stride_l, stride_o,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    BR: tl.constexpr, HAS_BIAS: tl.constexpr, LORA: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):
    """OUT[m-tile, n-tile] = X Wᵀ-operand (+ BIAS) + Σ_k P_k L_k over the tile's segments.

    The W operand's element (k, n) is at ``W + k·stride_wk + n·stride_wn``. ``seg0[i]`` is
    the first segment that ends past row tile i's first row (NSEG: none). P rows of
    adapter k sit at ``s_offsets[k]`` with row stride ``buckets[k]``; L rows of adapter k
    at ``rank_starts[k]``, its first ``ranks[k]`` of them used, BR ranks per step.
    """
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    m0 = pid_m * BM
    rows = tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mm = rows < M - m0
    mn = cols < N
    offs_k = tl.arange(0, BK)
    x_ptrs = X + m0.to(tl.int64) * stride_x + (rows[:, None] * stride_x + offs_k[None, :])
    w_ptrs = W + (offs_k[:, None] * stride_wk + cols[None, :] * stride_wn)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, tl.cdiv(KD, BK)):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=mm[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=mn[None, :], other=0.0)
        else:
            mk = offs_k < KD - kk * BK
            a = tl.load(x_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=mk[:, None] & mn[None, :], other=0.0)
        acc = _mm(a, b, acc, IEEE)
        x_ptrs += BK
        w_ptrs += BK * stride_wk
    _finish_tile(acc, BIAS, P, L, OUT, seg0, tok_starts, rank_starts, ranks, s_offsets, buckets, NSEG, stride_l,
                 stride_o, pid_m, m0, rows, cols, mm, mn, BM, BR, HAS_BIAS, LORA, IEEE)


@triton.jit
def linear_lora_tma_kernel(
    x_desc, w_desc, BIAS, P, L, OUT,
    seg0, tok_starts, rank_starts, ranks, s_offsets, buckets,
    M, N, KD, NSEG, stride_l, stride_o,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    BR: tl.constexpr, HAS_BIAS: tl.constexpr, LORA: tl.constexpr, W_NK: tl.constexpr,
    STAGES: tl.constexpr, IEEE: tl.constexpr,
):
    """`linear_lora_kernel` with X and W read by TMA (host tensor descriptors: X blocks
    BM × BK; W blocks BN × BK when ``W_NK`` (W stored out × in, the forward), else BK × BN).
    TMA zero-fills past the edges, so the reduction needs no masks."""
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    m0 = pid_m * BM
    n0 = pid_n * BN
    rows = tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    mm = rows < M - m0
    mn = cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(KD, BK), num_stages=STAGES):
        a = x_desc.load([m0, kk * BK])
        if W_NK:
            b = w_desc.load([n0, kk * BK]).T
        else:
            b = w_desc.load([kk * BK, n0])
        acc = _mm(a, b, acc, IEEE)
    _finish_tile(acc, BIAS, P, L, OUT, seg0, tok_starts, rank_starts, ranks, s_offsets, buckets, NSEG, stride_l,
                 stride_o, pid_m, m0, rows, cols, mm, mn, BM, BR, HAS_BIAS, LORA, IEEE)
