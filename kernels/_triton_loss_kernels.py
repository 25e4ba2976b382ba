"""Triton kernel of the LM head's cross-entropy (launched from `cross_entropy`).

One program per row of logits: the row is read once for its maximum and its sum of
exponentials (online, block by block, in float32), then, with ``GRAD``, read again to write
softmax − one-hot, the gradient of the row's loss, in the logits' dtype.
"""

import triton
import triton.language as tl


@triton.jit
def cross_entropy_rows_kernel(X, stride_x, T, LOSS, G, stride_g, V, ignore_index,
                              BLOCK: tl.constexpr, GRAD: tl.constexpr):
    """LOSS[row] = logsumexp(X[row]) − X[row, T[row]] (0 where T[row] is ``ignore_index``);
    with GRAD, G[row] = softmax(X[row]) − onehot(T[row]) (zeros where ignored)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    target = tl.load(T + row)
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(x_row + c, mask=c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    keep = target != ignore_index
    safe = tl.where(keep, target, 0)
    picked = tl.load(x_row + safe).to(tl.float32)
    tl.store(LOSS + row, tl.where(keep, lse - picked, 0.0))
    if GRAD:
        g_row = G + row * stride_g
        for start in range(0, V, BLOCK):
            c = start + cols
            inside = c < V
            x = tl.load(x_row + c, mask=inside, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(c == safe, p - 1.0, p)
            p = tl.where(keep, p, 0.0)
            tl.store(g_row + c, p.to(G.dtype.element_ty), mask=inside)
