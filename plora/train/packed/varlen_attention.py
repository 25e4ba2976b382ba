"""Attention confined to each row of a flattened batch.

torchtune's `MultiHeadAttention` computes attention through its ``_attention_call``
attribute. `install_row_attention` swaps that for a `_RowAttentionCall` that reads the
current row boundaries from one `RowAttention` shared by every layer: while rows are set
(`RowAttention.rows`), a ``[1, T]`` batch is attended row by row, causally; otherwise the
original call runs (padded batches). While a `DecodeCache` is set (`RowAttention.cache`,
greedy generation), a prefill's rows also store their keys and values there, and a decode
forward (one token per row) attends to its row's cached ones instead.

Backends:

- CUDA, half precision, a torch with ``torch.nn.attention.varlen.varlen_attn``: one
  flash varlen launch for all rows (split-KV off where the torch allows, so a row's result
  does not depend on the longest row of the batch); it reads the boundaries from a device
  tensor, so it can be replayed from a CUDA graph (`RowAttention.graph_safe`). Its ATen ops
  are called directly where this torch's take the same arguments
  (`plora.train.packed.flash_varlen`: no ``torch._dynamo`` import).
- otherwise (the CPU path, float32 on CUDA): one causal SDPA per row. Each row's
  attention is then exactly what it would be alone, bit for bit.

With the lean step (`install_row_attention`'s ``lean``), each attention's forward goes straight
to the flash kernel while it can, with no expand or copies (`plora.train.packed.row_forward`);
this call then serves the other cases.

Models whose attention is not a `MultiHeadAttention` (torchtune's Gemma2 attention, for
one) are not touched: `install_row_attention` returns None and the recipe keeps padded rows.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from plora.settings import settings
from plora.train.packed.decode_cache import DecodeCache
from plora.train.packed.flash_varlen import flash_varlen
from plora.train.packed.row_forward import install_row_forward

_ATTR = "_plora_row_attention"


def _varlen_fn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _has_row_kernel() -> bool:
    """Whether one flash launch can attend every row (`flash_varlen`, else torch's ``varlen_attn``)."""
    return flash_varlen() is not None or _varlen_fn() is not None


class RowAttention:
    """The row boundaries of the current flattened batch, shared by every attention layer."""

    def __init__(self) -> None:
        self.lengths: list[int] | None = None
        self.cu_seqlens: torch.Tensor | None = None  # int32 [rows + 1] on the device (varlen kernel)
        self.max_len = 0
        self.cache: DecodeCache | None = None  # greedy generation's keys and values, while it runs

    @property
    def active(self) -> bool:
        return self.lengths is not None

    def set(self, lengths: Sequence[int], cu_seqlens: torch.Tensor | None = None, max_len: int | None = None) -> None:
        """Rows of these lengths, in order. ``cu_seqlens``: their boundaries on the device,
        for the varlen kernel (a graph's own buffer, so a replay reads the step's rows);
        ``max_len``: an upper bound of the row lengths (fixed across a graph's replays)."""
        self.lengths = [int(n) for n in lengths]
        self.cu_seqlens = cu_seqlens
        self.max_len = int(max_len) if max_len is not None else max(self.lengths, default=0)

    def clear(self) -> None:
        self.lengths, self.cu_seqlens, self.max_len = None, None, 0

    def direct(self, x: torch.Tensor) -> bool:
        """Whether attention over ``x`` (``[1, T, features]``) is one call of the flash varlen
        kernel now, on the rows set (`plora.train.packed.row_forward` then skips the copies
        torchtune makes for the other paths)."""
        return (self.lengths is not None and self.cu_seqlens is not None and self.cache is None
                and x.shape[0] == 1 and self.graph_safe(x.device, x.dtype) and flash_varlen() is not None)

    @contextlib.contextmanager
    def rows(self, lengths: Sequence[int], cu_seqlens: torch.Tensor | None = None,
             max_len: int | None = None) -> Iterator["RowAttention"]:
        self.set(lengths, cu_seqlens, max_len)
        try:
            yield self
        finally:
            self.clear()

    @staticmethod
    def graph_safe(device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a step with these rows can be captured in a CUDA graph: only the varlen
        kernel reads its boundaries from the device (the per-row loop slices on the host)."""
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _has_row_kernel()


class _RowAttentionCall:
    """Stands in for a `MultiHeadAttention`'s ``_attention_call`` (module docstring)."""

    def __init__(self, state: RowAttention, original: Callable, q_per_kv: int = 1):
        self.state = state
        self.original = original
        self.q_per_kv = max(1, int(q_per_kv))  # query heads per key-value head (expanded copies)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, dropout_p: float = 0.0,
                 is_causal: bool = True) -> torch.Tensor:
        state = self.state
        cache = state.cache
        if cache is not None and cache.decoding:
            return cache.attend(self, q, k, v, self.q_per_kv)
        if not state.active:
            return self.original(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        if mask is not None or q.shape[0] != 1:
            raise ValueError("row attention takes one flattened sequence [1, T] and no mask")
        if state.cu_seqlens is not None and dropout_p == 0.0 and self.graph_ok(q):
            out = _varlen(q, k, v, state)
        else:
            out = _per_row(q, k, v, state.lengths, dropout_p)
        if cache is not None:
            cache.store(self, k, v, self.q_per_kv)
        return out

    @staticmethod
    def graph_ok(q: torch.Tensor) -> bool:
        return RowAttention.graph_safe(q.device, q.dtype)


def _per_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int],
             dropout_p: float) -> torch.Tensor:
    """One causal SDPA per row, [1, H, T, D] in and out."""
    if sum(lengths) != q.shape[2]:
        raise ValueError(f"rows cover {sum(lengths)} tokens, the batch has {q.shape[2]}")
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                                   dropout_p=dropout_p, is_causal=True))
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


_VARLEN_PARAMS: set[str] | None = None


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: RowAttention) -> torch.Tensor:
    """The flash varlen kernel over every row at once, [1, H, T, D] in and out."""
    global _VARLEN_PARAMS
    qt, kt, vt = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [T, H, D]
    cu = state.cu_seqlens
    direct = flash_varlen()  # the same ops, without importing torch._dynamo (`flash_varlen`)
    if direct is not None:
        return direct(qt, kt, vt, cu, state.max_len).transpose(0, 1).unsqueeze(0)
    fn = _varlen_fn()
    if _VARLEN_PARAMS is None:
        _VARLEN_PARAMS = set(inspect.signature(fn).parameters)
    kwargs = {}
    if "window_size" in _VARLEN_PARAMS:  # torch >= 2.11: causal is window (-1, 0)
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in _VARLEN_PARAMS:
        kwargs["is_causal"] = True
    if "num_splits" in _VARLEN_PARAMS:  # no split-KV: a row's result is independent of the others
        kwargs["num_splits"] = 1
    out = fn(qt, kt, vt, cu, cu, state.max_len, state.max_len, **kwargs)
    return out.transpose(0, 1).unsqueeze(0)


def install_row_attention(model: nn.Module, lean: bool | None = None) -> RowAttention | None:
    """Swap every decoder layer's attention call for the row-confined one; None (and the
    model untouched) when a layer's attention has no ``_attention_call`` to swap. ``lean``
    (None: unless ``PLORA_LEAN_STEP=0``): each attention's forward also goes straight to the
    flash kernel while it can (`plora.train.packed.row_forward`)."""
    existing = row_attention(model)
    if existing is not None:
        return existing
    attns = []
    for layer in getattr(model, "layers", []):
        attn = getattr(layer, "attn", None)
        if attn is None or not callable(getattr(attn, "_attention_call", None)):
            return None
        attns.append(attn)
    if not attns:
        return None
    state = RowAttention()
    for attn in attns:
        heads, kv_heads = int(getattr(attn, "num_heads", 1)), int(getattr(attn, "num_kv_heads", 0) or 0)
        q_per_kv = heads // kv_heads if kv_heads and heads % kv_heads == 0 else 1
        attn._attention_call = _RowAttentionCall(state, attn._attention_call, q_per_kv)
    if settings().lean_step if lean is None else lean:
        install_row_forward(attns, state)
    setattr(model, _ATTR, state)
    return state


def row_attention(model: nn.Module) -> RowAttention | None:
    """The `RowAttention` installed in this model, if any."""
    return getattr(model, _ATTR, None)
