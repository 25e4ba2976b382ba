"""Keys and values of every row of a greedy decode, so that each new token attends to its
row's earlier tokens without running them again.

Greedy generation (`plora.results.generate`) first runs each row's prompt once (the
*prefill*, a flattened batch through the model's row attention), which stores every layer's
keys and values here; each later forward is one new token per row (the *decode*), whose key
and value are written at the row's next slot and whose query attends to the row's slots up
to it. Without the cache, each new token re-ran its whole row through every layer: on
SmolLM2's arithmetic eval (prompts of about 60 tokens, 6 new tokens), six full forwards
instead of one and five of a token per row.

Layout: per layer, one buffer ``[rows * capacity, kv_heads, head_dim]`` each for keys and
values (row ``r``'s slot ``p`` at ``r * capacity + p``), zeroed (a masked slot must hold no
NaN: its softmax weight is 0, and 0 × NaN is NaN). Only the key-value heads are kept: a
grouped-query model's expanded heads are copies, and its queries are grouped over them at
the decode (each row's ``q_per_kv`` queries of one key-value head attend as one short
query sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class DecodeCache:
    """The cached keys and values of ``rows`` rows of at most ``capacity`` tokens each."""

    def __init__(self, rows: int, capacity: int, device: torch.device):
        if rows <= 0 or capacity <= 0:
            raise ValueError(f"a decode cache needs rows and capacity, got {rows} x {capacity}")
        self.rows, self.capacity, self.device = int(rows), int(capacity), device
        self.decoding = False
        self._slots: torch.Tensor | None = None  # flat slots of the current forward's tokens
        self._mask: torch.Tensor | None = None  # [rows, 1, 1, capacity], decode only
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def layer_bytes_per_token(kv_heads: int, head_dim: int, element_size: int) -> int:
        """What one cached token takes in one layer (its key and value)."""
        return 2 * kv_heads * head_dim * element_size

    def prefill(self, lengths: Sequence[int]) -> None:
        """The next forward is the rows' prompts, flattened in row order (``lengths`` tokens each)."""
        if len(lengths) != self.rows or max(lengths, default=0) > self.capacity:
            raise ValueError(f"prompts of {list(lengths)} tokens do not fit {self.rows} rows of {self.capacity}")
        slots = [r * self.capacity + p for r, n in enumerate(lengths) for p in range(n)]
        self._slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.decoding, self._mask = False, None

    def decode(self, positions: torch.Tensor) -> None:
        """The next forward is one token per row, at these positions (int64 ``[rows]`` on the
        device, each below ``capacity``): each attends to its row's slots up to its own."""
        positions = positions.to(self.device, torch.long)
        base = torch.arange(self.rows, device=self.device, dtype=torch.long) * self.capacity
        self._slots = base + positions
        slots = torch.arange(self.capacity, device=self.device, dtype=torch.long)
        self._mask = (slots[None, :] <= positions[:, None]).view(self.rows, 1, 1, self.capacity)
        self.decoding = True

    def store(self, layer: object, k: torch.Tensor, v: torch.Tensor, q_per_kv: int) -> None:
        """Write a forward's keys and values ``[1, heads, T, head_dim]`` (heads expanded
        ``q_per_kv`` times per key-value head, as torchtune's attention passes them) at the
        forward's slots of this layer."""
        n = 0 if self._slots is None else self._slots.numel()
        # a prefill's flattened rows may end in a padding row (`flatten_rows`' smallest
        # size): its tokens are no row's
        if n == 0 or k.shape[2] < n or (self.decoding and k.shape[2] != n):
            raise ValueError(f"a forward of {k.shape[2]} tokens, the cache expects {n}")
        kv = [t[0, ::q_per_kv, :n].transpose(0, 1) for t in (k, v)]  # [n, kv_heads, head_dim]
        key = id(layer)
        if key not in self._layers:
            shape = (self.rows * self.capacity, kv[0].shape[1], kv[0].shape[2])
            self._layers[key] = tuple(torch.zeros(shape, dtype=t.dtype, device=t.device) for t in kv)
        for buf, t in zip(self._layers[key], kv):
            buf.index_copy_(0, self._slots, t)

    def attend(self, layer: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_per_kv: int) -> torch.Tensor:
        """A decode forward's attention ``[1, heads, rows, head_dim]``: store the new tokens'
        keys and values, then each row's query over its row's slots up to its position."""
        if not self.decoding or self._mask is None:
            raise RuntimeError("attend is for decode forwards; a prefill stores after its own attention")
        self.store(layer, k, v, q_per_kv)
        keys, values = self._layers[id(layer)]
        heads, dim = q.shape[1], q.shape[3]
        kv_heads = heads // q_per_kv
        query = q[0].transpose(0, 1).reshape(self.rows, kv_heads, q_per_kv, dim)
        cached = [b.view(self.rows, self.capacity, kv_heads, dim).transpose(1, 2) for b in (keys, values)]
        out = F.scaled_dot_product_attention(query, cached[0], cached[1], attn_mask=self._mask)
        return out.reshape(self.rows, heads, dim).transpose(0, 1).unsqueeze(0)
