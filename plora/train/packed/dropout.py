"""LoRA dropout per adapter whose masks do not depend on the pack.

PEFT drops the input of each LoRA layer (``lora_dropout``: ``x`` before ``lora_A``, the
base path untouched). In a pack every adapter has its own probability, and training it
packed must give what training it alone gives, so its masks may depend on nothing but the
adapter itself: a mask element is a hash of the adapter's seed, its own step count, the
layer, the token's row and position inside the adapter's own rows, and the feature. A
counter-based hash, not a random generator's stream, so that

- the other adapters of the pack (their rows before this one's, their dropout) change
  nothing;
- a recomputation (activation checkpointing) draws the same mask, and backward needs no
  saved mask: it draws it again;
- a step replayed from a CUDA graph draws a new mask: the step count is read from the
  device (the optimizer table copied in before each replay), not baked in;
- tensor-parallel shards draw the columns of the whole layer's mask they hold.

Rows are the adapter's rows as the step lays them out: flattened (one token run per
adapter: the offset inside the run) or padded to a width (row and position). Packed and
alone agree within one layout, which both use for the same sweep.

The hash (`mix32`, a 32-bit integer finaliser) runs in int64 with every product kept
under 2**63, so the same bits come out on every device: as torch ops on the CPU, as one
Triton pass over x on CUDA (``_triton_dropout_kernels.py``, one read and one write, as
torch's own dropout). An adapter with p = 0 keeps every element; a step where no adapter
of the pack has dropout runs none of this.
"""

from __future__ import annotations


import torch

from plora.settings import kernels_choice

M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # the multiplier of the 32-bit integer hash (< 2**31: products stay < 2**63)
_GOLDEN = 0x9E3779B1
#: the mask's resolution: an element is kept where its 24 hash bits are >= p * 2**24
_BITS = 24
#: a padded row's stride in the index of a token (positions stay below it)
ROW_STRIDE = 1 << 16


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MIX & M32
    x = ((x >> 16) ^ x) * _MIX & M32
    return (x >> 16) ^ x


def key32(text: str) -> int:
    """A 32-bit key of a name (a layer's) that does not depend on Python's hash seed."""
    h = 2166136261
    for byte in text.encode():
        h = ((h ^ byte) * 16777619) & M32
    return h


def adapter_key(seed: int) -> int:
    """An adapter's 32-bit dropout key, from its seed."""
    return int(mix32(torch.tensor([(int(seed) * _GOLDEN + 0x632BE5AB) & M32], dtype=torch.int64))[0])


def token_keys(token_starts: torch.Tensor, num_tokens: int, total: int, keys: torch.Tensor, steps: torch.Tensor,
               probs: torch.Tensor, width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's hash key and dropout probability ([T] int64, [T] float32): the key of
    its adapter (``keys[k]``), that adapter's step (``steps[k]``) and the token's index in
    the adapter's own rows (offset, or row and position for rows padded to ``width``).
    Tokens past the segments (``num_tokens``..``total``) keep everything."""
    device = keys.device
    t = torch.arange(total, device=device, dtype=torch.int64)
    starts = token_starts.to(device=device, dtype=torch.int64)
    k = torch.searchsorted(starts[1:], t, right=True).clamp_(max=keys.numel() - 1)
    local = t - starts[k]
    if width:
        local = (local // width) * ROW_STRIDE + local % width
    h = mix32(keys[k] ^ mix32(steps.to(device=device, dtype=torch.int64)[k] & M32))
    h = mix32(h ^ mix32(local & M32))
    p = torch.where(t < num_tokens, probs.to(device)[k], torch.zeros((), device=device))
    return h, p


def _mask(shape: tuple[int, int], h: torch.Tensor, p: torch.Tensor, layer: int, col_offset: int,
          dtype: torch.dtype) -> torch.Tensor:
    cols = (torch.arange(col_offset, col_offset + shape[1], device=h.device, dtype=torch.int64) * _GOLDEN) & M32
    bits = mix32(mix32(h ^ layer)[:, None] ^ cols[None, :]) & ((1 << _BITS) - 1)
    keep = bits >= (p * float(1 << _BITS))[:, None]
    return keep.to(dtype) * (1.0 / (1.0 - p)).to(dtype)[:, None]


def _apply(x: torch.Tensor, h: torch.Tensor, p: torch.Tensor, layer: int, col_offset: int) -> torch.Tensor:
    """x with the mask applied: one Triton pass on CUDA (the same bits), torch ops elsewhere."""
    if x.is_cuda and kernels_choice() != "torch":
        from plora.kernels.triton_ops import kernels_module

        x = x.contiguous()
        out = torch.empty_like(x)
        rows, cols = x.shape
        grid = (_cdiv(rows, _BT), _cdiv(cols, _BF))
        kernels_module("_triton_dropout_kernels.py").hash_dropout_kernel[grid](
            x, out, h, p.float(), rows, cols, layer, col_offset, BT=_BT, BF=_BF)
        return out
    return x * _mask(tuple(x.shape), h, p, layer, col_offset, x.dtype)


_BT, _BF = 32, 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _HashDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, p, layer: int, col_offset: int):
        ctx.save_for_backward(h, p)
        ctx.layer, ctx.col_offset = layer, col_offset
        return _apply(x, h, p, layer, col_offset)

    @staticmethod
    def backward(ctx, g):
        h, p = ctx.saved_tensors
        return _apply(g, h, p, ctx.layer, ctx.col_offset), None, None, None, None


def hash_dropout(x: torch.Tensor, h: torch.Tensor, p: torch.Tensor, layer: int, col_offset: int = 0) -> torch.Tensor:
    """``x`` (T × features) with each token's features dropped at its probability ``p`` and
    the rest scaled by 1/(1-p), the mask drawn from the tokens' keys ``h``, the ``layer``
    key and each feature's index (from ``col_offset``: a shard's first column)."""
    return _HashDropout.apply(x, h, p, int(layer), int(col_offset))
