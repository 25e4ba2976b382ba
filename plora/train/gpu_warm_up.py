"""A spare's held base model run once, forward and backward, on a few tokens before its job.

A job's first GPU work pays for what a process does once: cuBLAS's handles and workspaces,
the autograd engine's device thread, and loading each of torch's kernels its steps use
(CUDA loads a module at its kernel's first launch). On a warm 0.5B sweep on an H200, its
base eval of 8k tokens took 0.33 s against 0.36 s for the eval of 64k tokens that ended
its first pack: most of the first was that. A spare waits seconds for its job while the
sweep plans (`plora.train.spare`), so it pays them there, through the model it holds: the
decoder's own linears, norms and head forward and backward (base weights not trained, as in
a job), the causal row attention a job's packed rows use (`flash_varlen`), and the small
ops a step decides with after its loss.

Nothing a job computes changes: no weight is written, no gradient kept, no random number
drawn (the tokens are zeros), and the job seeds its own generators.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["warm_up"]

#: tokens of the warm-up row
TOKENS = 16


def warm_up(model: Any, device: torch.device | str) -> float | None:
    """Seconds spent; None where there is nothing to warm (not a GPU, not a decoder with
    ``tok_embeddings``, ``layers``, ``norm`` and ``output``)."""
    device = torch.device(device)
    if device.type != "cuda" or not all(hasattr(model, a) for a in ("tok_embeddings", "layers", "norm", "output")):
        return None
    t0 = time.perf_counter()
    trained = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in trained:
            p.requires_grad_(False)
        with torch.enable_grad():
            tokens = torch.zeros(1, TOKENS, dtype=torch.long, device=device)
            h = model.tok_embeddings(tokens).detach().requires_grad_(True)
            x = h
            for layer in model.layers:
                x = layer(x)
            logits = model.output(model.norm(x))
            F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
            attn = getattr(model.layers[0], "attn", None)
            heads = int(getattr(attn, "num_heads", 2))
            _row_attention(h.dtype, device, heads, int(getattr(attn, "num_kv_heads", 0) or heads),
                           int(getattr(attn, "head_dim", 64)))
        _step_bookkeeping(device)
        torch.cuda.synchronize(device)
    finally:
        for p, wanted in trained:
            p.requires_grad_(wanted)
    return time.perf_counter() - t0


def _row_attention(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> None:
    """The packed rows' causal flash attention, forward and backward, on two short rows of
    the model's own heads (flash attention picks its kernel by the head's size; grouped
    key-value heads add the sum of their gradients, as `plora.train.packed.row_forward`
    calls it)."""
    from plora.train.packed.flash_varlen import flash_varlen

    fn = flash_varlen()
    if fn is None or dtype not in (torch.float16, torch.bfloat16):
        return
    q, k, v = (torch.zeros(TOKENS, n, head_dim, dtype=dtype, device=device, requires_grad=True)
               for n in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, TOKENS // 2, TOKENS], dtype=torch.int32, device=device)
    fn(q, k, v, cu, TOKENS // 2).sum().backward()


def _step_bookkeeping(device: torch.device) -> None:
    """The small ops a packed step decides with after its loss (`plora.train.packed_step`:
    which adapters step, their gradient norms and clipping coefficients, its report), on two
    slots: CUDA loads each kernel at its first launch, and a job's first step, a capture
    with the GPU idle, paid 40-50 ms for the norms' square root and the masks' selects alone
    on an H200."""
    losses = torch.ones(2, device=device, requires_grad=True)
    values = losses.detach().float()
    ok = torch.isfinite(values) & (values <= 1e30)
    torch.where(ok, losses, torch.zeros_like(losses)).sum().backward()
    active = torch.arange(2, device=device)
    loss_k = torch.full((2,), float("nan"), dtype=torch.float32, device=device)
    loss_k.index_copy_(0, active, values)
    go = torch.zeros(2, dtype=torch.bool, device=device)
    go.index_copy_(0, active, ok)
    norms = (values * values).sqrt()
    go &= torch.isfinite(norms)
    coef = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    hp = torch.ones(2, 8, dtype=torch.float32, device=device).clone()
    hp[:, 0] *= go.to(hp.dtype)
    hp[:, 7] = torch.where(go, coef.to(hp.dtype), 0.0)
    out = torch.empty(3, 2, device=device)
    out[0].copy_(loss_k)
    out[1].zero_().index_copy_(0, active, ok.float())
    out[2].copy_(go)
