"""RoPE in fewer kernels, with the same numbers.

A packed step's fixed cost is its count of kernels (on an H200 about 2.5 µs each, replayed
from a CUDA graph, whatever the rows), and RoPE as torchtune writes it is one of the
largest shares of that count: every call gathers and casts its tables, then autograd
records a chain of small ops whose backward adds slice gradients, zero-filled at full size,
into the input's. Per call, forward and backward, that is 17 kernels for Hugging Face's
rotate-half layout (Qwen2, Gemma2, Phi-3) and about 30 for torchtune's interleaved pairs
computed in float32 (Llama, SmolLM2), on q and on k of every layer.

`PackedRope` computes the same function with one autograd node per call, from tables made
once per forward for every layer (`shared_tables`):

- halves: ``y = x·cos + swap(x)·sin_f`` and ``dx = g·cos + swap(g)·sin_b``, with
  ``swap(z) = cat(z[h:], z[:h])``, ``sin_f = cat(-sin[:h], sin[h:])`` and
  ``sin_b = cat(sin[h:], -sin[:h])``: 4 kernels each way;
- pairs: the same with ``swap`` exchanging the two values of each pair, in float32, and one
  cast back: 5 kernels each way.

Each output element is computed by the same IEEE operations on the same operands as the
original (``a - b`` is ``a + (-b)`` exactly, a negation is exact, and an element's
gradient is the same two products added, the zero-filled slice terms adding nothing), so
results are equal bit for bit (up to the sign of a zero), which `tests/test_lean_step.py`
checks against the original modules in float32 and bfloat16.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn
from torch.autograd.function import once_differentiable

#: how a RoPE module lays out the two halves of each rotation
PAIRS, HALVES = "pairs", "halves"


class _Shared(threading.local):
    """Per thread: the tables of the forward in progress (`shared_tables`), or None."""

    def __init__(self) -> None:
        self.tables: dict | None = None


_SHARED = _Shared()


@contextlib.contextmanager
def shared_tables() -> Iterator[None]:
    """Within, each `PackedRope` makes its tables once per positions tensor and reuses them
    for every layer: one forward of the model (the caller keeps its positions alive until
    the end). Outside, every call makes its own (an activation-checkpointed layer's
    recomputation in backward, a generation's decode steps)."""
    outer = _SHARED.tables
    _SHARED.tables = {}
    try:
        yield
    finally:
        _SHARED.tables = outer


class _Rotate(torch.autograd.Function):
    """``y = x·cos + swap(x)·sin_f`` over the rotated features; backward
    ``g·cos + swap(g)·sin_b``. ``pairs``: products in float32 (the tables are), one cast back
    to x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin_f: torch.Tensor, sin_b: torch.Tensor,  # type: ignore[override]
                layout: str) -> torch.Tensor:
        ctx.layout, ctx.dtype = layout, x.dtype
        ctx.save_for_backward(cos, sin_b)
        return _apply(x, cos, sin_f, layout).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        cos, sin_b = ctx.saved_tensors
        return _apply(g, cos, sin_b, ctx.layout).to(ctx.dtype), None, None, None, None


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """``x·cos + swap(x)·sin``, written contiguous: a gradient arriving in attention's
    transposed layout would otherwise leave it strided, and the view before RoPE (heads
    split off the projection's output) would copy it once more in backward."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    torch.mul(x, cos, out=out)
    return out.add_(_swap(x, layout) * sin)


def _swap(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == PAIRS:
        return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat((x[..., h:], x[..., :h]), dim=-1)


def _neg_first_half(t: torch.Tensor) -> torch.Tensor:
    h = t.shape[-1] // 2
    return torch.cat((-t[..., :h], t[..., h:]), dim=-1)


class PackedRope(nn.Module):
    """One of torchtune's RoPE modules (or plora's `PartialRotaryEmbedding`) computed in one
    autograd node per call, from its own tables; ``x``: ``[b, s, n_heads, head_dim]``."""

    def __init__(self, inner: nn.Module, layout: str) -> None:
        super().__init__()
        self.inner = inner
        self.layout = layout
        #: features rotated from the start of each head (the rest passes through: Phi-3)
        self.rotary_dim: int | None = getattr(inner, "rotary_dim", None)

    def forward(self, x: torch.Tensor, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        if not getattr(self.inner, "is_cache_built", True) or x.dtype == torch.float64:
            # the module itself: it raises where its cache is not built; in float64 the pairs'
            # products are float32 there and the halves' would not be
            return self.inner(x, input_pos=input_pos)
        r = self.rotary_dim or x.shape[-1]
        backward = torch.is_grad_enabled() and x.requires_grad
        cos, sin_f, sin_b = self._tables(x, input_pos, r, backward)
        part = x if r == x.shape[-1] else x[..., :r]
        if backward:
            y = _Rotate.apply(part, cos, sin_f, sin_b, self.layout)
        else:  # no gradient wanted (an eval, a decode step): no autograd node, no backward table
            y = _apply(part, cos, sin_f, self.layout).to(x.dtype)
        return y if part is x else torch.cat((y, x[..., r:]), dim=-1)

    def _tables(self, x: torch.Tensor, input_pos: torch.Tensor | None, r: int,
                backward: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        shared = _SHARED.tables
        key = (id(self), id(input_pos), x.shape[1], r, x.dtype, x.device, backward)
        if shared is not None and key in shared:
            return shared[key]
        made = self._make_tables(x, input_pos, r, backward)
        if shared is not None:
            shared[key] = made
        return made

    def _make_tables(self, x: torch.Tensor, input_pos: torch.Tensor | None, r: int,
                     backward: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """cos, sin_f and (for a backward) sin_b, broadcastable against ``x[..., :r]``, as the
        module's own forward would gather and cast them (pairs: float32; halves: x's dtype).
        ``sin_b`` is ``swap(sin_f)`` in either layout: the sine with its other half negated."""
        s = x.shape[1]
        inner = self.inner
        if self.layout == PAIRS:  # cache [L, r/2, 2]: (cos, sin) per pair, torchtune's interleaved RoPE
            cache = inner.cache[:s] if input_pos is None else inner.cache[input_pos]
            cache = cache.view(-1, s, 1, r // 2, 2).float()
            c, sn = cache[..., 0], cache[..., 1]
            cos = torch.stack((c, c), dim=-1).flatten(-2)
            sin_f = torch.stack((-sn, sn), dim=-1).flatten(-2)
        else:
            if hasattr(inner, "cache"):  # Qwen2's: cache [L, 2·dim], cos then sin
                cache = inner.cache[:s] if input_pos is None else inner.cache[input_pos]
                cache = cache.view(-1, s, 1, r * 2)
                cos, sin = cache[..., :r].to(x.dtype), cache[..., r:].to(x.dtype)
            else:  # plora's PartialRotaryEmbedding: cos and sin [L, rotary_dim]
                cos = inner.cos[:s] if input_pos is None else inner.cos[input_pos]
                sin = inner.sin[:s] if input_pos is None else inner.sin[input_pos]
                cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
            sin_f = _neg_first_half(sin)
        return cos, sin_f, _swap(sin_f, self.layout) if backward else None

    def extra_repr(self) -> str:
        return f"layout={self.layout}"


def rope_layout(module: nn.Module) -> str | None:
    """PAIRS or HALVES for a RoPE module `PackedRope` computes exactly, else None."""
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import RotaryPositionalEmbeddings

    from plora.models.families.modules import PartialRotaryEmbedding

    kind = type(module)
    if kind is Qwen2RotaryPositionalEmbeddings or kind is PartialRotaryEmbedding:
        return HALVES
    # Llama3ScaledRoPE has RotaryPositionalEmbeddings' forward over its own cache
    if kind is RotaryPositionalEmbeddings or kind.__name__ == "Llama3ScaledRoPE":
        cache = getattr(module, "cache", None)
        if cache is not None and cache.dim() == 3 and cache.shape[-1] == 2:
            return PAIRS
    return None


def install_packed_rope(model: nn.Module) -> int:
    """Every attention's RoPE module of a known kind replaced by a `PackedRope` over it (one
    shared by the layers that shared the module); how many attentions use one now."""
    found: list[tuple[nn.Module, PackedRope]] = []
    made: dict[int, PackedRope] = {}
    for module in model.modules():
        rope = getattr(module, "pos_embeddings", None)
        if not isinstance(rope, nn.Module) or isinstance(rope, PackedRope):
            continue
        if id(rope) not in made:
            layout = rope_layout(rope)
            if layout is None:
                continue
            made[id(rope)] = PackedRope(rope, layout)
        found.append((module, made[id(rope)]))
    for module, packed in found:
        module.pos_embeddings = packed
    return len(found)
