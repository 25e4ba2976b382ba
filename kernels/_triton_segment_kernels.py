"""Triton kernels of the segmented optimizer ops (launched from `segments`).

Both walk a tile table: tile t covers ``tile_len[t]`` contiguous elements of a flat buffer
from ``tile_start[t]``, all owned by group ``tile_group[t]`` (one adapter). Per-group
numbers come from a small table, so one launch serves every adapter of a pack with its
own learning rate, bias corrections and clipping coefficient.
"""

import triton
import triton.language as tl


@triton.jit
def sq_norm_tiles_kernel(X, tile_start, tile_len, tile_weight, out, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """out[t] = weight[t] · Σ x² over tile t (float32)."""
    t = tl.program_id(0)
    start = tl.load(tile_start + t)
    n = tl.load(tile_len + t)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    base = X + start
    for s in range(0, TILE, BLOCK):
        mask = s + offs < n
        x = tl.load(base + s + offs, mask=mask, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out + t, tl.sum(acc, axis=0) * tl.load(tile_weight + t))


@triton.jit
def adamw_tiles_kernel(
    P, G, M, V, tile_start, tile_len, tile_group, hp,
    HP: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
):
    """AdamW (decoupled weight decay, torch's update order) on the tiles of stepping groups.

    hp[k] = (step?, 1 - lr·wd, lr / bc1, sqrt(bc2), β1, β2, ε, grad coefficient).
    """
    t = tl.program_id(0)
    k = tl.load(tile_group + t)
    row = hp + k * HP
    go = tl.load(row)
    if go != 0.0:
        decay = tl.load(row + 1)
        step_size = tl.load(row + 2)
        bc2_sqrt = tl.load(row + 3)
        beta1 = tl.load(row + 4)
        beta2 = tl.load(row + 5)
        eps = tl.load(row + 6)
        coef = tl.load(row + 7)
        start = tl.load(tile_start + t)
        n = tl.load(tile_len + t)
        offs = tl.arange(0, BLOCK)
        Pt, Gt, Mt, Vt = P + start, G + start, M + start, V + start  # 64-bit base, 32-bit offsets
        for s in range(0, TILE, BLOCK):
            o = s + offs
            mask = o < n
            p = tl.load(Pt + o, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(Gt + o, mask=mask, other=0.0).to(tl.float32) * coef
            m = tl.load(Mt + o, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(Vt + o, mask=mask, other=0.0).to(tl.float32)
            p = p * decay
            m = m + (1.0 - beta1) * (g - m)
            v = v * beta2 + (1.0 - beta2) * g * g
            p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
            tl.store(Pt + o, p.to(P.dtype.element_ty), mask=mask)
            tl.store(Mt + o, m.to(M.dtype.element_ty), mask=mask)
            tl.store(Vt + o, v.to(V.dtype.element_ty), mask=mask)
