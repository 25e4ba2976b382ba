"""Triton kernel of the per-adapter LoRA dropout (`plora.train.packed.dropout`): one pass over
x, the mask drawn in registers from the same integer hash as the torch path."""

import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def hash_dropout_kernel(X, OUT, H, P, T, F, layer, col_offset, BT: tl.constexpr, BF: tl.constexpr):
    """OUT = X · keep / (1 - p) over a (T, F) row-major tensor; keep from each token's key
    H[t] (int64 < 2**32), the layer key and the feature's index (from ``col_offset``)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    mt = t < T
    mf = f < F
    h = tl.load(H + t, mask=mt, other=0).to(tl.int64)
    p = tl.load(P + t, mask=mt, other=0.0)
    h = _mix32(h ^ layer)
    cols = ((f + col_offset).to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF
    bits = _mix32(h[:, None] ^ cols[None, :]) & 0xFFFFFF
    keep = bits.to(tl.float32) >= (p * 16777216.0)[:, None]
    scale = 1.0 / (1.0 - p)
    offs = t.to(tl.int64)[:, None] * F + f[None, :]
    m = mt[:, None] & mf[None, :]
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.where(keep, x * scale[:, None], 0.0)
    tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=m)
