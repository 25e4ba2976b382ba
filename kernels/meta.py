"""Segment and rank metadata of one packed step, built once and shared by every layer.

A packed batch holds, adapter after adapter, the token rows of each adapter's micro-batch.
Every packed LoRA layer of the model sees the same segments and the same ranks, so the
bookkeeping the kernels need (where each segment starts, where each adapter's rows sit in
the stacked A/B, where its low-rank activations live, which tiles each launch walks) is
computed once per step on the host, copied to the device once, and reused by all layers.
Tile schedules depend on the tile sizes a kernel uses, so they are made on first use and
cached here for the rest of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

_T = TypeVar("_T")

#: Largest rank the Triton kernels take (a rank-256 adapter's tile still fits in registers).
MAX_RANK = 256
#: Smallest rank bucket: tensor-core dots need at least 16 along every dimension.
MIN_BUCKET = 16
#: A rank bucket whose adapters hold fewer tokens than this joins the next larger bucket of
#: the pack (cumulatively). A launch that small is mostly ramp and tail, so one launch of
#: the merged adapters beats one each; the merged adapters' padding is still masked, so
#: they load only their own rank's bytes, and pay the larger bucket in arithmetic only.
#: Mixed ranks 8-128 on an H100 (NOTES.md, v7): K = 8, h = 2048, 148 -> 127 us; K = 32,
#: h = 2048 (buckets 16 and 32 join 64), 482 -> 407 us.
MERGE_BUCKET_TOKENS = 8192


def rank_bucket(rank: int) -> int:
    """The padded rank a kernel compiles for: the next power of two, at least 16.

    Adapters are grouped by bucket and each group gets its own launch, so an adapter pays
    for its own rank (at most twice it, in arithmetic only: the padding is masked and never
    loaded), not for the largest rank of the pack. Buckets with few tokens are merged
    upwards (`MERGE_BUCKET_TOKENS`, `merged_buckets`).
    """
    b = MIN_BUCKET
    while b < rank:
        b *= 2
    return b


@dataclass(frozen=True)
class Schedule:
    """Work items of one launch: token ranges [lo, hi) inside one segment each."""

    seg: torch.Tensor  # int32 [n]: adapter index of each item
    lo: torch.Tensor  # int32 [n]: first token (absolute row)
    hi: torch.Tensor  # int32 [n]: one past the last token
    n: int
    split: bool  # some segment is cut into several items (reductions over tokens need atomics)


@dataclass(frozen=True)
class PairSchedule:
    """Work items of a launch that runs two kinds of program (see `LoRAMeta.pair_schedule`)."""

    kind: torch.Tensor  # int32 [n]: 0 or 1
    seg: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    aux: torch.Tensor  # int32 [n]: hidden tile of a kind-1 item, column block of a kind-0 one
    n: int
    split: bool


@dataclass(eq=False)
class LoRAMeta:
    """Everything the packed LoRA ops need to know about the segments and adapters of a step.

    Device tensors: ``token_starts`` (int32 [K+1]), ``rank_starts`` (int32 [K+1]),
    ``ranks`` (int32 [K]), ``scales`` (float32 [K]) and ``s_offsets`` (int64 [K+1]: where
    adapter k's low-rank activations start in the packed buffer: n_k rows of
    ``bucket_of_host[k]`` values, of which the first r_k are used).
    The ``*_host`` tuples hold the same numbers on the host, so that no op has to read
    them back from the device. Device tensors (and the schedules made on first use) are
    copied without blocking on the current stream: like any tensor, using them from another
    stream needs that stream to wait for this one first.
    """

    tokens_host: tuple[int, ...]
    ranks_host: tuple[int, ...]
    scales_host: tuple[float, ...]
    token_starts_host: tuple[int, ...]
    rank_starts_host: tuple[int, ...]
    s_offsets_host: tuple[int, ...]
    bucket_of_host: tuple[int, ...]  # the bucket (row width of S'/dS) each adapter is launched in
    device: torch.device
    token_starts: torch.Tensor
    rank_starts: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    s_offsets: torch.Tensor
    buckets: dict[int, tuple[int, ...]]  # padded rank -> adapters with tokens, in order
    has_empty_adapter: bool  # some adapter has no tokens, so no kernel writes its gradient rows
    _schedules: dict = field(default_factory=dict, repr=False)

    @property
    def num_adapters(self) -> int:
        return len(self.ranks_host)

    @property
    def num_tokens(self) -> int:
        """Rows covered by segments (the packed batch may not hold more)."""
        return self.token_starts_host[-1]

    @property
    def total_rank(self) -> int:
        """R = Σ r_k, the row count of the stacked A and B."""
        return self.rank_starts_host[-1]

    @property
    def s_numel(self) -> int:
        """Σ n_k · bucket(r_k): size of the packed low-rank activation buffer."""
        return self.s_offsets_host[-1]

    def cached(self, key: tuple, build: Callable[[], _T]) -> _T:
        """``build()``'s result under ``key`` for the rest of the step: whatever the kernels
        derive from the segments (tile schedules, launch plans) is made once and reused by
        every layer of the same shape."""
        hit = self._schedules.get(key)
        if hit is None:
            hit = self._schedules[key] = build()
        return hit

    def schedule(self, bucket: int | None, chunk_tokens: int) -> Schedule:
        """Token ranges of at most ``chunk_tokens`` rows over the segments of one rank bucket.

        ``bucket=None`` walks every segment. Cached, so the host work and the copy to the
        device happen once per step and tile size.
        """
        return self.cached((bucket, chunk_tokens), lambda: self._build_schedule(bucket, chunk_tokens))

    def _build_schedule(self, bucket: int | None, chunk_tokens: int) -> Schedule:
        adapters = range(self.num_adapters) if bucket is None else self.buckets.get(bucket, ())
        seg, lo, hi = [], [], []
        split = False
        for k in adapters:
            a, b = self.token_starts_host[k], self.token_starts_host[k + 1]
            if b == a:
                continue
            split |= (b - a) > chunk_tokens
            for t in range(a, b, chunk_tokens):
                seg.append(k)
                lo.append(t)
                hi.append(min(t + chunk_tokens, b))
        packed = torch.tensor([seg, lo, hi], dtype=torch.int32).to(self.device, non_blocking=True)
        return Schedule(packed[0], packed[1], packed[2], len(seg), split)

    def pair_schedule(
        self, bucket: int, tile_tokens: int, chunk_tokens: int, hidden_tiles: int, block_tiles: int = 0
    ) -> PairSchedule:
        """Work of the one-launch dy pass: per segment and column block of ``block_tiles``
        column tiles (0: one block of every tile), its dS items (``tile_tokens`` rows each,
        kind 0, block index in ``aux``) interleaved with its dB items (``chunk_tokens`` rows
        × one of the block's column tiles, kind 1, tile index in ``aux``). Interleaving per
        unit makes both kinds read the same dy at about the same time."""
        block_tiles = block_tiles or max(hidden_tiles, 1)
        return self.cached(
            ("pair", bucket, tile_tokens, chunk_tokens, hidden_tiles, block_tiles),
            lambda: self._build_pair_schedule(bucket, tile_tokens, chunk_tokens, hidden_tiles, block_tiles),
        )

    def _build_pair_schedule(
        self, bucket: int, tile_tokens: int, chunk_tokens: int, hidden_tiles: int, block_tiles: int
    ) -> PairSchedule:
        rows: list[tuple[int, int, int, int, int]] = []
        split = False
        for k in self.buckets.get(bucket, ()):
            a, b = self.token_starts_host[k], self.token_starts_host[k + 1]
            split |= (b - a) > chunk_tokens
            for c, j0 in enumerate(range(0, max(hidden_tiles, 1), block_tiles)):
                s_items = [(0, k, t, min(t + tile_tokens, b), c) for t in range(a, b, tile_tokens)]
                w_items = [
                    (1, k, t, min(t + chunk_tokens, b), j)
                    for t in range(a, b, chunk_tokens)
                    for j in range(j0, min(j0 + block_tiles, hidden_tiles))
                ]
                n = max(len(s_items), len(w_items))
                for i in range(n):  # spread the shorter list evenly through the longer one
                    for items in (s_items, w_items):
                        lo_i, hi_i = i * len(items) // n, (i + 1) * len(items) // n
                        rows.extend(items[lo_i:hi_i])
        cols = list(zip(*rows)) if rows else [[]] * 5
        packed = torch.tensor([list(c) for c in cols], dtype=torch.int32).to(self.device, non_blocking=True)
        return PairSchedule(packed[0], packed[1], packed[2], packed[3], packed[4], len(rows), split)

    def set_scale(self, k: int, value: float) -> None:
        """Adapter k's scale is now ``value`` (its slot holds another adapter of the same
        rank): the host numbers and, in place, the device tensor, which a captured CUDA
        graph reads at its address (the Triton kernels load it; the torch path multiplies by
        the host number, which a capture bakes in)."""
        scales = list(self.scales_host)
        scales[k] = float(value)
        self.scales_host = tuple(scales)
        self.scales[k].fill_(float(value))

    def bucket_tokens(self, bucket: int) -> list[int]:
        """Segment lengths of the adapters in one bucket (for choosing chunk sizes)."""
        return [self.tokens_host[k] for k in self.buckets.get(bucket, ())]


def merged_buckets(tokens: Sequence[int], ranks: Sequence[int], merge_tokens: int) -> list[int]:
    """The bucket each adapter is launched in: its own `rank_bucket`, except that buckets
    holding fewer than ``merge_tokens`` tokens (counting those merged into them) join the
    next larger bucket of the pack. The largest bucket never changes, so no adapter goes
    to a bucket above the pack's largest rank; 0 keeps every bucket."""
    own = [rank_bucket(r) for r in ranks]
    out = list(own)
    pending: list[int] = []
    present = sorted({b for b, n in zip(own, tokens) if n > 0})
    for i, b in enumerate(present):
        pending += [k for k, (ob, n) in enumerate(zip(own, tokens)) if ob == b and n > 0]
        if i == len(present) - 1 or sum(tokens[k] for k in pending) >= merge_tokens:
            for k in pending:
                out[k] = b
            pending = []
    return out


def build_lora_meta(
    tokens_per_adapter: Sequence[int],
    ranks: Sequence[int],
    scales: Sequence[float],
    device: torch.device | str,
    merge_tokens: int | None = None,
) -> LoRAMeta:
    """Build the metadata of one packed step; call once per step, pass it to every layer.

    Segments are contiguous in the flattened token dimension, in adapter order; adapter k
    owns rows ``token_starts[k]:token_starts[k+1]`` and rows ``rank_starts[k]:rank_starts[k+1]``
    of the stacked A (R × in) and B (R × out). Segments may be empty; K may be 0.
    ``merge_tokens`` (default `MERGE_BUCKET_TOKENS`; 0: never) merges small rank buckets.
    """
    tokens = tuple(int(n) for n in tokens_per_adapter)
    rks = tuple(int(r) for r in ranks)
    scs = tuple(float(s) for s in scales)
    if not (len(tokens) == len(rks) == len(scs)):
        raise ValueError(
            f"build_lora_meta: one token count, rank and scale per adapter, got {len(tokens)}, {len(rks)}, {len(scs)}"
        )
    if any(n < 0 for n in tokens):
        raise ValueError(f"build_lora_meta: token counts must be >= 0, got {list(tokens)}")
    if any(r < 1 for r in rks):
        raise ValueError(f"build_lora_meta: ranks must be >= 1, got {list(rks)}")
    device = torch.device(device)
    bucket_of = merged_buckets(tokens, rks, MERGE_BUCKET_TOKENS if merge_tokens is None else merge_tokens)
    tstarts, rstarts, soffs = [0], [0], [0]
    for n, r, b in zip(tokens, rks, bucket_of):
        tstarts.append(tstarts[-1] + n)
        rstarts.append(rstarts[-1] + r)
        soffs.append(soffs[-1] + n * b)
    buckets: dict[int, list[int]] = {}
    for k, (n, b) in enumerate(zip(tokens, bucket_of)):
        if n > 0:
            buckets.setdefault(b, []).append(k)
    ints = torch.tensor([tstarts, rstarts, rks + (0,)], dtype=torch.int32).to(device, non_blocking=True)
    return LoRAMeta(
        tokens_host=tokens,
        ranks_host=rks,
        scales_host=scs,
        token_starts_host=tuple(tstarts),
        rank_starts_host=tuple(rstarts),
        s_offsets_host=tuple(soffs),
        bucket_of_host=tuple(bucket_of),
        device=device,
        token_starts=ints[0],
        rank_starts=ints[1],
        ranks=ints[2, : len(rks)],
        scales=torch.tensor(scs, dtype=torch.float32).to(device, non_blocking=True),
        s_offsets=torch.tensor(soffs, dtype=torch.int64).to(device, non_blocking=True),
        buckets={b: tuple(v) for b, v in sorted(buckets.items())},
        has_empty_adapter=any(n == 0 for n in tokens),
    )
