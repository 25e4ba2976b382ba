"""Greedy generation of many adapters at once: every adapter's rows in one batch, the base
model run once for all of them.

Where the model's attention is confined to rows (`plora.train.packed.varlen_attention`),
each row's prompt runs once and its keys and values are kept (`DecodeCache`); each new
token then runs alone, attending to them. Each row stays in the batch until the last row is
done (a finished row's new token is ignored), so every decode forward has the same layout:
its kernels are compiled once, at the first. Models without row attention (padded rows)
re-run each live row in full at every new token (`generate_without_cache`).

Either way a row's answer is its own: the same prompt gives the same tokens whatever rows
share its batch, up to the kernels' rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plora.data.dataset import IGNORE_INDEX, Sample, TextTokenizer
from plora.results.eval_forward import adapters_hidden, eval_batch, eval_hidden
from plora.train.packed.decode_cache import DecodeCache
from plora.train.packed.head_loss import last_position_logits
from plora.train.packed.inject import PackedModel
from plora.train.packed.step_batch import StepBatch
from plora.train.packed.varlen_attention import row_attention

#: a decode cache's rows are a multiple of this many slots
CACHE_MULTIPLE = 8


def decode_cache_bytes(pm: PackedModel) -> int:
    """Bytes one token takes in a `DecodeCache` of this model (0: it decodes without one)."""
    if row_attention(pm.model) is None:
        return 0
    elem = pm.model.tok_embeddings.weight.element_size()
    total = 0
    for layer in getattr(pm.model, "layers", []):
        attn = layer.attn
        total += DecodeCache.layer_bytes_per_token(int(attn.num_kv_heads), int(attn.head_dim), elem)
    return total


def greedy_generate(pm: PackedModel, prompts: Sequence[Sequence[int]], adapters: Sequence[int | None],
                    rows_per_adapter: int, tok: TextTokenizer, max_new_tokens: int, max_seq_len: int,
                    device: torch.device) -> list[str]:
    """Each prompt's greedy answer, decoded until a stop token, ``max_new_tokens`` or
    ``max_seq_len`` (adapter k owns rows ``k·n:(k+1)·n``; ``adapters`` = [None] or []: the
    base model owns them all)."""
    if row_attention(pm.model) is None:
        return generate_without_cache(pm, prompts, adapters, rows_per_adapter, tok, max_new_tokens, max_seq_len,
                                      device)
    adapters = list(adapters) or [None]
    active = [a for a in adapters if a is not None]
    out: list[list[int]] = [[] for _ in prompts]
    live = [i for i, p in enumerate(prompts) if 0 < len(p) < max_seq_len]
    if not live or max_new_tokens <= 0:
        return [tok.decode(ids) for ids in out]
    counts = [sum(1 for i in live if i // rows_per_adapter == k) for k in range(len(adapters))]
    keep = [k for k, n in enumerate(counts) if n]
    segments = [counts[k] for k in keep]
    kept = [active[k] for k in keep] if active else []
    lengths = [len(prompts[i]) for i in live]
    limit = [min(max_seq_len, n + max_new_tokens) for n in lengths]  # each row's last length
    capacity = -(-max(limit) // CACHE_MULTIPLE) * CACHE_MULTIPLE  # an aligned mask for the decode's kernel
    cache = DecodeCache(len(live), capacity, device)
    rows = row_attention(pm.model)
    rows.cache = cache
    try:
        cache.prefill(lengths)
        batch = eval_batch(pm, [Sample(list(prompts[i]), [IGNORE_INDEX] * len(prompts[i])) for i in live],
                           segments, tok.pad_id)
        hidden = eval_hidden(pm, batch, kept, device)
        nxt = _next_tokens(pm, hidden, _last_positions(batch, lengths), segments)
        done = [False] * len(live)
        length = list(lengths)
        for step in range(max_new_tokens):
            for r, t in enumerate(nxt):
                if done[r]:
                    continue
                if t in tok.stop_ids:
                    done[r] = True
                    continue
                out[live[r]].append(t)
                length[r] += 1
                done[r] = length[r] >= limit[r]
            if all(done) or step == max_new_tokens - 1:
                break
            # the rows' new tokens at their slots; a finished row runs on at its own last slot
            # (no longer read), its token ignored
            tokens = [0 if done[r] else out[live[r]][-1] for r in range(len(live))]
            positions = [n - 1 for n in length]
            hidden = _decode_forward(pm, cache, kept, segments, tokens, positions, device)
            nxt = _next_tokens(pm, hidden, list(range(len(live))), segments)
    finally:
        rows.cache = None
    return [tok.decode(ids) for ids in out]


def _decode_forward(pm: PackedModel, cache: DecodeCache, active: Sequence[int], segments: Sequence[int],
                    tokens: Sequence[int], positions: Sequence[int], device: torch.device) -> torch.Tensor:
    """One token per row at its position, through the cache: the hidden states ``[rows, d]``
    (the kernels compiled ahead at the first decode's layout; the rest are the same)."""
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    pos = torch.tensor([list(positions)], dtype=torch.long, device=device)
    cache.decode(pos[0])
    return adapters_hidden(pm, ids, pos, active, segments, device)


def _next_tokens(pm: PackedModel, hidden: torch.Tensor, last: Sequence[int], segments: Sequence[int]) -> list[int]:
    """The argmax token at each row's last position; the head per adapter, so that its
    shapes are the adapter's own rows' whatever else is in the batch."""
    nxt: list[int] = []
    start = 0
    for n in segments:
        nxt.extend(last_position_logits(pm.model.output, hidden, last[start : start + n]).argmax(-1).tolist())
        start += n
    return nxt


def generate_without_cache(pm: PackedModel, prompts: Sequence[Sequence[int]], adapters: Sequence[int | None],
                           rows_per_adapter: int, tok: TextTokenizer, max_new_tokens: int, max_seq_len: int,
                           device: torch.device) -> list[str]:
    """`greedy_generate` re-running each live row in full at every new token (padded rows,
    whose attention cannot be confined to a row's cache). Finished rows leave the batch."""
    adapters = list(adapters) or [None]  # no adapter: the base model
    active = [a for a in adapters if a is not None]
    owners = [k for k in range(len(adapters)) for _ in range(rows_per_adapter)]
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    live = [i for i, p in enumerate(seqs) if len(p) < max_seq_len]
    for step in range(max_new_tokens):
        if not live:
            break
        per_adapter = [sum(1 for i in live if owners[i] == k) for k in range(len(adapters))]
        keep = [k for k, n in enumerate(per_adapter) if n]
        samples = [Sample(seqs[i], [IGNORE_INDEX] * len(seqs[i])) for i in live]
        batch = eval_batch(pm, samples, [per_adapter[k] for k in keep], tok.pad_id)
        # each step is a new token layout: only the first one's kernels are compiled ahead
        hidden = eval_hidden(pm, batch, [active[k] for k in keep] if active else [], device,
                             compile_ahead=step == 0)
        nxt = _next_tokens(pm, hidden, _last_positions(batch, [len(s.tokens) for s in samples]),
                           [per_adapter[k] for k in keep])
        still = []
        for i, t in zip(live, nxt):
            if t in tok.stop_ids:
                continue
            out[i].append(t)
            seqs[i].append(t)
            if len(seqs[i]) < max_seq_len:
                still.append(i)
        live = still
    return [tok.decode(ids) for ids in out]


def _last_positions(batch: StepBatch, lengths: Sequence[int]) -> list[int]:
    if batch.flat:
        return batch.last_positions()[: len(lengths)]
    width = int(batch.tokens.shape[1])
    return [r * width + n - 1 for r, n in enumerate(lengths)]
