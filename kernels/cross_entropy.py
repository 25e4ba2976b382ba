"""The LM head's cross-entropy and its gradient in one pass over the logits.

A packed step's loss reads logits of (its label tokens × the vocabulary): 12,000 × 151,936
for the 0.5B benchmark's full pack. torch's path casts them to float32, runs log-softmax and
the NLL forward and backward, then casts the gradient back: about 36 bytes moved per logit,
and on an H200 the largest share of a step's memory-bound time (the softmax's launches alone
took 16 ms of a 95 ms step). Here one program per row reads the row twice, in float32 (its
maximum and sum of exponentials online, then softmax − one-hot) and writes the gradient
once, in the logits' dtype: 6 bytes per logit (bf16). The math is torch's in float32; the
gradient is rounded to the logits' dtype, as the cast back of torch's path rounded it.

Which backend runs follows `backend_for`, as the packed LoRA ops do: Triton on CUDA (not
with ``PLORA_KERNELS=torch``), the torch reference on CPU (Triton's interpreter with
``PLORA_KERNELS=triton`` and ``TRITON_INTERPRET=1``, how the kernel is tested there).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_MAX", "cross_entropy_rows", "cross_entropy_rows_ref", "loss_launches"]

#: vocabulary columns a program holds at once (and its warps), chosen on an H200
#: (`scripts/bench_loss.py --blocks`, 220 rows of Qwen2.5's 151,936 columns in bf16, gradient
#: written: 16,384 columns on 16 warps 65 µs, 3.1 TB/s at 6 bytes a logit; 8,192 on 16: 74 µs;
#: 32,768 on 32: 69 µs; 65,536 on 32: 85 µs): a row of a large vocabulary is walked in blocks
BLOCK_MAX = 16384
#: warps per program by block size, the largest first
WARPS = ((8192, 16), (2048, 8), (0, 4))


def _block(vocab: int) -> tuple[int, int]:
    block = min(BLOCK_MAX, 1 << max(0, int(vocab) - 1).bit_length())
    return block, next(w for at, w in WARPS if block >= at)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, *, grad: bool,
                       backend: str | None = None, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's cross-entropy, float32 [n] (0 where its target is ``ignore_index``), and with
    ``grad`` the gradient of their sum with respect to ``logits`` [n, V], in their dtype
    (else None). ``block``: columns a program holds at once (a power of two; tests walk a
    small vocabulary in several blocks with it), else by the vocabulary's size."""
    from .function import backend_for

    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_rows: logits [n, V] and targets [n], got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if backend_for(logits, backend) != "triton":
        return cross_entropy_rows_ref(logits, targets, ignore_index, grad=grad)
    from .triton_ops import _launch, kernels_module

    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    out = torch.empty_like(logits) if grad else loss
    if n:
        chosen, warps = _block(vocab)
        block = chosen if block is None else int(block)
        k = kernels_module("_triton_loss_kernels.py")
        _launch(k.cross_entropy_rows_kernel, (n,), logits, logits.stride(0), targets, loss, out,
                out.stride(0), vocab, int(ignore_index), BLOCK=block, GRAD=bool(grad), num_warps=warps)
    return loss, (out if grad else None)


def cross_entropy_rows_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, *,
                           grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch reference of `cross_entropy_rows` (the test oracle)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    keep = targets != ignore_index
    safe = torch.where(keep, targets, torch.zeros_like(targets))
    rows = torch.arange(x.shape[0], device=x.device)
    loss = torch.where(keep, lse - x[rows, safe], torch.zeros_like(lse))
    if not grad:
        return loss, None
    g = torch.exp(x - lse[:, None])
    g[rows, safe] -= 1.0
    g = g * keep[:, None]
    return loss, g.to(logits.dtype)


def loss_launches(dtype: torch.dtype, device: torch.device | str, vocab: int, ignore_index: int = -100) -> None:
    """What a step's loss and an eval's launch for logits of ``dtype`` over ``vocab`` columns,
    for `compile_ahead` to collect inside `triton_ops.collecting` (nothing runs): the kernel
    with and without the gradient, each for a chunk's targets on a 16-byte boundary and off
    it (a chunk's targets are a slice of its adapter's, and Triton specializes on that).
    Nothing with ``PLORA_FUSED_LOSS=0``: torch's ops run the loss."""
    from plora.settings import fused_loss_on

    if not fused_loss_on():
        return
    logits = torch.empty(1, int(vocab), dtype=dtype, device=device)
    targets = torch.zeros(2, dtype=torch.int64, device=device)
    for grad in (True, False):
        for t in (targets[:1], targets[1:]):
            cross_entropy_rows(logits, t, ignore_index, grad=grad)
