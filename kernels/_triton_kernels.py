"""Triton kernels of the packed LoRA ops (launched from `triton_ops`; see there for shapes).

Every kernel walks *work items*: a token range [lo, hi) inside one adapter's segment
(`meta.Schedule`), crossed with a tile of the hidden dimension. The rank of a launch is a
compile-time bucket RP (next power of two of the adapters' ranks, at least 16); an
adapter's own rank r ≤ RP masks the rest, so padded rows are never loaded and the bytes
moved are those of the adapter's own rank. The rank is never tiled: a program holds all
of it, which keeps the reduction over the hidden dimension (shrink) and over tokens
(weight gradients) inside one program.

Packed low-rank buffers (S' = s·x Aᵀ, dS) hold adapter k's n_k rows at ``s_offsets[k]``
with row stride RP; the first r_k columns are used and the padding always holds zeros
(writers store whole rows or add into zeroed buffers), so readers load whole, aligned
rows with vector loads. They are
in the compute dtype, or float32 when a launch adds into them atomically; every reader
casts what it loads. Products run on the tensor cores in the input dtype with float32
accumulation (exact float32 products when the inputs are float32).

Pointer arithmetic: a 64-bit scalar base per tile plus 32-bit offsets inside the tile.
Per-element 64-bit offsets hide the contiguity of the rows from the compiler, and the
loads then fall back to scalar 2-byte accesses without software pipelining.
"""

import triton
import triton.language as tl


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _item(pid, seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets):
    seg = tl.load(seg_p + pid)
    lo = tl.load(lo_p + pid)
    hi = tl.load(hi_p + pid)
    ts = tl.load(tok_starts + seg)
    r = tl.load(ranks + seg)
    ro = tl.load(rank_starts + seg)
    so = tl.multiple_of(tl.load(s_offsets + seg), 16)  # Σ n_k·RP_k, RP ≥ 16: aligned rows
    return seg, lo, hi, ts, r, ro, so


@triton.jit
def _item_and_tile(HFIRST: tl.constexpr):
    """(work item, hidden tile) of this program; HFIRST: the grid's first axis runs over
    the hidden tiles, so neighbouring programs cover one item (`triton_ops._item_grid`)."""
    if HFIRST:
        return tl.program_id(1), tl.program_id(0)
    else:
        return tl.program_id(0), tl.program_id(1)


@triton.jit
def _shrink_body(
    X, W, S, lo, hi, ts, r, ro, so, scale, d_lo, d_hi, D, stride_x, stride_w,
    BT: tl.constexpr, BD: tl.constexpr, RP: tl.constexpr,
    ATOMIC: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
):
    """S[lo:hi, :] (=|+=) scale · X[lo:hi, d_lo:d_hi] W[ro:ro+r, d_lo:d_hi]ᵀ, hi - lo ≤ BT."""
    ct = X.dtype.element_ty
    rows = tl.arange(0, BT)
    mt = rows < hi - lo
    offs_r = tl.arange(0, RP)
    mr = offs_r < r
    offs_d = tl.arange(0, BD)
    x_ptrs = X + lo.to(tl.int64) * stride_x + (rows[:, None] * stride_x + offs_d[None, :])
    w_ptrs = W + ro.to(tl.int64) * stride_w + (offs_r[None, :] * stride_w + offs_d[:, None])
    acc = tl.zeros((BT, RP), dtype=tl.float32)
    for d in range(d_lo, d_hi, BD):
        if EVEN_D:
            x = tl.load(x_ptrs + d, mask=mt[:, None], other=0.0)
            w = tl.load(w_ptrs + d, mask=mr[None, :], other=0.0)
        else:
            md = (d + offs_d) < D
            x = tl.load(x_ptrs + d, mask=mt[:, None] & md[None, :], other=0.0)
            w = tl.load(w_ptrs + d, mask=mr[None, :] & md[:, None], other=0.0)
        acc = _mm(x, w.to(ct), acc, IEEE)
    acc = acc * scale
    s_ptrs = S + (so + (lo - ts).to(tl.int64) * RP) + (rows[:, None] * RP + offs_r[None, :])
    m = mt[:, None] & (offs_r < RP)[None, :]  # padding columns get zeros: S is all defined
    if ATOMIC:
        tl.atomic_add(s_ptrs, acc, mask=m, sem="relaxed")
    else:
        tl.store(s_ptrs, acc.to(S.dtype.element_ty), mask=m)


@triton.jit
def _wgrad_body(
    P, X, DW, lo, hi, ts, r, ro, so, pid_d, D, stride_x, stride_dw,
    BT: tl.constexpr, BD: tl.constexpr, RP: tl.constexpr, ATOMIC: tl.constexpr, IEEE: tl.constexpr,
):
    """DW[ro:ro+r, d-tile] (=|+=) P[lo:hi, :r]ᵀ X[lo:hi, d-tile], BT tokens a step."""
    ct = X.dtype.element_ty
    offs_r = tl.arange(0, RP)
    mr = offs_r < r
    offs_d = pid_d * BD + tl.arange(0, BD)
    md = offs_d < D
    acc = tl.zeros((RP, BD), dtype=tl.float32)
    rows = tl.arange(0, BT)
    for i in range(0, tl.cdiv(hi - lo, BT)):
        t = lo + i * BT
        mt = rows < hi - t
        p = tl.load(  # full RP-wide rows (the padding holds zeros): vector loads
            P + (so + (t - ts).to(tl.int64) * RP) + (rows[:, None] * RP + offs_r[None, :]),
            mask=mt[:, None], other=0.0,
        ).to(ct)
        x = tl.load(
            X + t.to(tl.int64) * stride_x + (rows[:, None] * stride_x + offs_d[None, :]),
            mask=mt[:, None] & md[None, :], other=0.0,
        )
        acc = _mm(tl.trans(p), x, acc, IEEE)
    dw_ptrs = DW + ro.to(tl.int64) * stride_dw + (offs_r[:, None] * stride_dw + offs_d[None, :])
    m = mr[:, None] & md[None, :]
    if ATOMIC:
        tl.atomic_add(dw_ptrs, acc, mask=m, sem="relaxed")
    else:
        tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=m)


@triton.jit
def shrink_kernel(
    X, W, S,
    seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets, scales,
    D, stride_x, stride_w, split_len,
    BT: tl.constexpr, BD: tl.constexpr, RP: tl.constexpr,
    ATOMIC: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
):
    """S' = scale · X Wᵀ for the BT tokens of one item (forward: x, A; backward: dy, B).

    Axis 1 splits the hidden dimension into ``split_len`` slices (ATOMIC: partial sums
    added into a zeroed float32 S), so that few tokens still fill the machine.
    """
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    seg, lo, hi, ts, r, ro, so = _item(pid, seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets)
    scale = tl.load(scales + seg)
    d_lo = pid_d * split_len
    d_hi = tl.minimum(d_lo + split_len, D)
    _shrink_body(X, W, S, lo, hi, ts, r, ro, so, scale, d_lo, d_hi, D, stride_x, stride_w,
                 BT, BD, RP, ATOMIC, EVEN_D, IEEE)


@triton.jit
def _expand_tile(S, Y, w, t, hi, ts, so, offs_n, mn, stride_y,
                 BT: tl.constexpr, RP: tl.constexpr, ACCUM: tl.constexpr, IEEE: tl.constexpr):
    """Y[t:t+BT, n-tile] (+)= S[t:t+BT, :] W-tile, rows past ``hi`` masked."""
    ct = Y.dtype.element_ty
    rows = tl.arange(0, BT)
    offs_r = tl.arange(0, RP)
    mt = rows < hi - t
    y_ptrs = Y + t.to(tl.int64) * stride_y + (rows[:, None] * stride_y + offs_n[None, :])
    m = mt[:, None] & mn[None, :]
    s = tl.load(  # full RP-wide rows (the padding holds zeros): vector loads
        S + (so + (t - ts).to(tl.int64) * RP) + (rows[:, None] * RP + offs_r[None, :]),
        mask=mt[:, None], other=0.0,
    ).to(ct)
    acc = tl.zeros((BT, offs_n.shape[0]), dtype=tl.float32)
    acc = _mm(s, w, acc, IEEE)
    if ACCUM:
        acc += tl.load(y_ptrs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(ct), mask=m)


@triton.jit
def expand_kernel(
    S, W, Y,
    seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets,
    N, stride_y, stride_w,
    BT: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr,
    ACCUM: tl.constexpr, IEEE: tl.constexpr, YS: tl.constexpr, HFIRST: tl.constexpr = False,
):
    """Y[t, n-tile] (+)= S[t, :r] W[ro:ro+r, n-tile] over the tokens of one item.

    Forward: y += S' B. Backward: dx += dS A. The W tile is loaded once per program and
    reused for every BT-token step; Y is read and written once, in place. The compiler
    pipelines by itself only the loads that feed a dot (S here), so Y's load would wait
    out its whole latency every step: YS > 0 asks for a YS-stage software pipeline of the
    token loop, which keeps YS - 1 tiles of Y in flight through shared memory (H200: the
    expand went from 80% to 87% of copy bandwidth at rank 32, NOTES.md).
    """
    pid, pid_n = _item_and_tile(HFIRST)  # HFIRST: neighbours cover one token range
    seg, lo, hi, ts, r, ro, so = _item(pid, seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets)
    ct = Y.dtype.element_ty
    offs_r = tl.arange(0, RP)
    mr = offs_r < r
    offs_n = pid_n * BN + tl.arange(0, BN)
    mn = offs_n < N
    w = tl.load(
        W + ro.to(tl.int64) * stride_w + (offs_r[:, None] * stride_w + offs_n[None, :]),
        mask=mr[:, None] & mn[None, :], other=0.0,
    ).to(ct)
    if YS > 0:
        for i in tl.range(0, tl.cdiv(hi - lo, BT), num_stages=YS):
            _expand_tile(S, Y, w, lo + i * BT, hi, ts, so, offs_n, mn, stride_y, BT, RP, ACCUM, IEEE)
    else:
        for i in range(0, tl.cdiv(hi - lo, BT)):
            _expand_tile(S, Y, w, lo + i * BT, hi, ts, so, offs_n, mn, stride_y, BT, RP, ACCUM, IEEE)


@triton.jit
def wgrad_kernel(
    P, X, DW,
    seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets,
    D, stride_x, stride_dw,
    BT: tl.constexpr, BD: tl.constexpr, RP: tl.constexpr, ATOMIC: tl.constexpr, IEEE: tl.constexpr,
    HFIRST: tl.constexpr = False,
):
    """A weight gradient, DW[ro:ro+r, d-tile] (=|+=) P[item, :r]ᵀ X[item, d-tile].

    dB: P = S', X = dy. dA: P = dS, X = x. ATOMIC when a segment is cut into several
    items: their partial sums meet in a zeroed float32 DW. HFIRST orders the grid as the
    expand's: neighbouring programs take the hidden tiles of one item, so the programs in
    flight share its rows of P in L2 and stream whole rows of X.
    """
    pid, pid_d = _item_and_tile(HFIRST)
    seg, lo, hi, ts, r, ro, so = _item(pid, seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets)
    _wgrad_body(P, X, DW, lo, hi, ts, r, ro, so, pid_d, D, stride_x, stride_dw, BT, BD, RP, ATOMIC, IEEE)


@triton.jit
def dy_pair_kernel(
    DY, B, SP, DS, DB,
    kind_p, seg_p, lo_p, hi_p, aux_p, tok_starts, rank_starts, ranks, s_offsets, scales,
    N, stride_dy, stride_b, stride_db, CB, stride_p,
    BT: tl.constexpr, BN: tl.constexpr, BT2: tl.constexpr, BN2: tl.constexpr, RP: tl.constexpr,
    ATOMIC: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
):
    """Both products of dy in one launch: dS = s·dy Bᵀ (kind 0) and dB = S'ᵀ dy (kind 1).

    The two need different reductions (over the hidden dim, over tokens), so they are
    separate programs; the schedule interleaves the items of each segment, so both kinds
    of program stream the same rows of dy at about the same time and the second read of
    each byte hits L2 instead of memory when the rows are still there.

    "pair": a kind-0 item covers every column (CB = N) and stores dS itself. "block": the
    columns come in blocks of CB (a multiple of BN), the schedule's unit is one segment ×
    one block (its dS items and the dB items of its column tiles), so the dy both kinds
    share is a few MB, not a whole segment; kind 0 then stores the block's part of dS in
    float32 to plane ``aux`` of DS (``stride_p`` apart), summed by `band_sum_kernel`.
    """
    pid = tl.program_id(0)
    kind = tl.load(kind_p + pid)
    aux = tl.load(aux_p + pid)
    seg, lo, hi, ts, r, ro, so = _item(pid, seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets)
    if kind == 0:
        scale = tl.load(scales + seg)
        d_lo = aux * CB
        d_hi = tl.minimum(d_lo + CB, N)
        _shrink_body(DY, B, DS + aux.to(tl.int64) * stride_p, lo, hi, ts, r, ro, so, scale, d_lo, d_hi, N,
                     stride_dy, stride_b, BT, BN, RP, False, EVEN_N, IEEE)
    else:
        _wgrad_body(SP, DY, DB, lo, hi, ts, r, ro, so, aux, N, stride_dy, stride_db, BT2, BN2, RP, ATOMIC, IEEE)


@triton.jit
def dy_band_kernel(
    DY, SP, B, P, DB,
    seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets, scales,
    N, stride_dy, stride_b, stride_db, stride_p,
    BT: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr,
    ATOMIC: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr, TACC: tl.constexpr = False,
):
    """Both products of dy from one read of it, in bands of BN output columns.

    A program walks the tokens of one item over one band: dB for the band, S'ᵀ dy, is
    summed over those tokens in registers (complete when the item is a whole segment), and
    each step's s·dy Bᵀ over the band is that band's part of dS, stored in float32 to the
    band's plane of P (``band_sum_kernel`` adds the planes). The planes cost 2·RP/BN of dy's
    bytes each way, against a second pass over dy for the two-program "pair" schedule,
    whose second read of a dy tile misses L2 once many segments are in flight.
    """
    pid = tl.program_id(0)
    band = tl.program_id(1)
    seg, lo, hi, ts, r, ro, so = _item(pid, seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets)
    scale = tl.load(scales + seg)
    ct = DY.dtype.element_ty
    offs_r = tl.arange(0, RP)
    mr = offs_r < r
    offs_n = band * BN + tl.arange(0, BN)
    mn = offs_n < N
    bt = tl.load(
        B + ro.to(tl.int64) * stride_b + (offs_r[None, :] * stride_b + offs_n[:, None]),
        mask=mr[None, :] & mn[:, None], other=0.0,
    ).to(ct)
    p_band = P + band.to(tl.int64) * stride_p
    if TACC:  # dBᵀ (BN × RP): the band is the product's long side (warp-group MMA shapes)
        acc = tl.zeros((BN, RP), dtype=tl.float32)
    else:
        acc = tl.zeros((RP, BN), dtype=tl.float32)
    rows = tl.arange(0, BT)
    for i in range(0, tl.cdiv(hi - lo, BT)):
        t = lo + i * BT
        mt = rows < hi - t
        s_off = (so + (t - ts).to(tl.int64) * RP) + (rows[:, None] * RP + offs_r[None, :])
        sp = tl.load(SP + s_off, mask=mt[:, None], other=0.0).to(ct)
        dy_ptrs = DY + t.to(tl.int64) * stride_dy + (rows[:, None] * stride_dy + offs_n[None, :])
        if EVEN_N:
            dy = tl.load(dy_ptrs, mask=mt[:, None], other=0.0)
        else:
            dy = tl.load(dy_ptrs, mask=mt[:, None] & mn[None, :], other=0.0)
        if TACC:
            acc = _mm(tl.trans(dy), sp, acc, IEEE)
        else:
            acc = _mm(tl.trans(sp), dy, acc, IEEE)
        part = tl.zeros((BT, RP), dtype=tl.float32)
        part = _mm(dy, bt, part, IEEE) * scale
        tl.store(p_band + s_off, part, mask=mt[:, None])
    if TACC:
        db_ptrs = DB + ro.to(tl.int64) * stride_db + (offs_r[None, :] * stride_db + offs_n[:, None])
        m = mr[None, :] & mn[:, None]
    else:
        db_ptrs = DB + ro.to(tl.int64) * stride_db + (offs_r[:, None] * stride_db + offs_n[None, :])
        m = mr[:, None] & mn[None, :]
    if ATOMIC:
        tl.atomic_add(db_ptrs, acc, mask=m, sem="relaxed")
    else:
        tl.store(db_ptrs, acc.to(DB.dtype.element_ty), mask=m)


@triton.jit
def band_sum_kernel(
    P, DS, seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets, bands, stride_p,
    BT: tl.constexpr, RP: tl.constexpr,
):
    """dS[item rows] = Σ over the bands of P (float32 sums, stored in dS's dtype)."""
    pid = tl.program_id(0)
    seg, lo, hi, ts, r, ro, so = _item(pid, seg_p, lo_p, hi_p, tok_starts, rank_starts, ranks, s_offsets)
    rows = tl.arange(0, BT)
    offs = (so + (lo - ts).to(tl.int64) * RP) + (rows[:, None] * RP + tl.arange(0, RP)[None, :])
    m = (rows < hi - lo)[:, None]
    acc = tl.zeros((BT, RP), dtype=tl.float32)
    p_ptrs = P + offs
    for _ in range(0, bands):
        acc += tl.load(p_ptrs, mask=m, other=0.0)
        p_ptrs += stride_p
    tl.store(DS + offs, acc.to(DS.dtype.element_ty), mask=m)
