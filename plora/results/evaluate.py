"""Per-adapter losses and eval metrics of a packed model.

Eval packs too: the adapters being evaluated each get the whole eval set as their rows, and
the base model runs once over all of them.

Batches are sized from a memory budget (`eval_token_budget`), never from the number of
adapters alone: the eval set is cut into *pieces* of at most a budget's tokens, the same
pieces whatever adapters are evaluated, and a forward runs a group of adapters over one
piece, as many adapters as the budget holds. Each adapter's numbers are sums over the same
pieces, in the same order, so they do not depend on which adapters share its eval. A
forward that runs out of memory is retried in smaller pieces: half the adapters, then half
the rows, down to one row of one adapter.

Rows are flattened without padding where the model's attention can be confined to rows
(`plora.train.packed.varlen_attention`), padded otherwise; the LM head runs only where labels are
(loss) or at each row's last token (greedy decoding), in chunks (`plora.train.packed.head_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F

from plora.data.dataset import IGNORE_INDEX, Sample, TextTokenizer
from plora.spec.defaults import EVAL_BATCH_ROWS
from plora.results.metrics import choice_accuracy, generated_metrics, needs_eval_loss, perplexity, score_predictions
from plora.results.eval_forward import eval_batch, eval_hidden, vocab_size
from plora.results.generate import decode_cache_bytes, greedy_generate
from plora.train.packed.head_loss import adapter_loss_sums, head_chunk_rows, labels_to
from plora.train.packed.inject import PackedModel
from plora.train.packed.rows import LabelParts
from plora.train.packed.step_batch import label_counts

#: tokens per eval forward on a CPU (or when the device's free memory is unknown)
CPU_EVAL_TOKENS = 32768
#: the share of the device's free memory an eval forward may take
CUDA_MEMORY_SHARE = 0.5
#: at least this many tokens per eval forward, whatever the budget says
MIN_EVAL_TOKENS = 64

_T = TypeVar("_T")


# ------------------------------------------------------------------ reference
def segment_loss_sums(
    logits: torch.Tensor, labels: torch.Tensor, rows: Sequence[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Summed next-token loss and answer-token count of each adapter's rows (rows are
    adapter-contiguous), from full logits ``[B, W, V]``: the plain computation that the
    chunked head (`plora.train.packed.head_loss`) is checked against."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    token_loss = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)
    mask = shift_labels != IGNORE_INDEX
    sums, counts, start = [], [], 0
    for n in rows:
        sums.append(token_loss[start : start + n].sum())
        counts.append(mask[start : start + n].sum())
        start += n
    return sums, counts


def per_adapter_loss(logits: torch.Tensor, labels: torch.Tensor, rows: Sequence[int]) -> list[torch.Tensor]:
    """Mean next-token loss over each adapter's own answer tokens, from full logits."""
    sums, counts = segment_loss_sums(logits, labels, rows)
    return [s / c.clamp(min=1) for s, c in zip(sums, counts)]


# ------------------------------------------------------------------ budgets
def eval_token_budget(pm: PackedModel, device: torch.device, budget: int | None = None, held_bytes: int = 0) -> int:
    """Tokens one eval forward may hold: ``budget`` when given; on CUDA, a share of the free
    memory over the bytes a token's activations take (the widest layer's few live tensors;
    the head's chunk is bounded on its own) and ``held_bytes`` more per token (a decode
    cache's keys and values); `CPU_EVAL_TOKENS` elsewhere."""
    if budget is not None:
        return max(1, int(budget))
    if device.type != "cuda":
        return CPU_EVAL_TOKENS
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    model = pm.model
    hidden = int(model.tok_embeddings.weight.shape[1])
    widest = max([hidden] + [int(layer.out_features) for layer in pm.layers.values()])
    elem = model.tok_embeddings.weight.element_size()
    per_token = elem * (6 * hidden + 3 * widest) + 64 + int(held_bytes)  # + positions, ids, row metadata
    return max(MIN_EVAL_TOKENS, int(free * CUDA_MEMORY_SHARE) // per_token)


def split_pieces(lengths: Sequence[int], max_tokens: int, max_rows: int, widest: bool = False
                 ) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` ranges of rows, each at most ``max_tokens`` tokens (a
    longer row is a piece of its own) and ``max_rows`` rows. ``widest``: each row takes its
    piece's widest row's room (a decode cache, padded rows), ``lengths`` ascending, so that
    a piece costs its rows times its last length."""
    pieces, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        cost = (i - start + 1) * n if widest else tokens + n
        if i > start and (cost > max_tokens or i - start >= max_rows):
            pieces.append((start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        pieces.append((start, len(lengths)))
    return pieces


def retry_smaller(run: Callable[[list[_T], tuple[int, int]], None], group: list[_T], piece: tuple[int, int]) -> None:
    """``run(group, piece)``; on out-of-memory, the same work in halves: the group's adapters
    first (each adapter's numbers stay the same), then the piece's rows, down to one row of
    one adapter (which re-raises)."""
    try:
        run(group, piece)
        return
    except torch.OutOfMemoryError:
        if len(group) == 1 and piece[1] - piece[0] == 1:
            raise
    _free_cached()
    if len(group) > 1:
        half = len(group) // 2
        retry_smaller(run, group[:half], piece)
        retry_smaller(run, group[half:], piece)
    else:
        mid = (piece[0] + piece[1]) // 2
        retry_smaller(run, group, (piece[0], mid))
        retry_smaller(run, group, (mid, piece[1]))


def _free_cached() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ metrics
@torch.no_grad()
def evaluate_adapters(
    pm: PackedModel,
    adapters: Sequence[int | None],
    samples: Sequence[Sample],
    examples: Sequence[dict],
    tok: TextTokenizer,
    *,
    metrics: Sequence[str],
    max_new_tokens: int,
    max_seq_len: int,
    device: torch.device,
    batch_rows: int = EVAL_BATCH_ROWS,
    token_budget: int | None = None,
) -> list[dict[str, float]]:
    """Eval metrics (`plora.results.metrics`) for each adapter index (None = the base model alone).

    ``batch_rows`` caps the rows of one forward; ``token_budget`` its tokens (default: from
    the device's free memory, `eval_token_budget`)."""
    if any(a is None for a in adapters) and len(adapters) != 1:
        raise ValueError("evaluate the base model on its own, not packed with adapters")
    was_training = pm.model.training
    pm.model.eval()
    try:
        results: list[dict[str, float]] = [{} for _ in adapters]
        budget = eval_token_budget(pm, device, token_budget)
        if needs_eval_loss(metrics) and samples:
            for i, loss in enumerate(_eval_loss(pm, list(adapters), samples, device, budget, batch_rows, tok.pad_id)):
                if "loss" in metrics:
                    results[i]["eval_loss"] = loss
                if "perplexity" in metrics:
                    results[i]["eval_perplexity"] = perplexity(loss)
        generated = generated_metrics(metrics)
        if generated and (samples or examples):
            prompts, references = _prompts(samples, examples, tok, max_seq_len)
            room = eval_token_budget(pm, device, token_budget, held_bytes=decode_cache_bytes(pm))
            answers = _answers(pm, list(adapters), prompts, tok, max_new_tokens, max_seq_len, device, room,
                               batch_rows)
            for i, predictions in enumerate(answers):
                results[i].update(score_predictions(generated, predictions, references))
        if "choice_accuracy" in metrics:
            for i, acc in enumerate(_choice_accuracy(pm, list(adapters), samples, device, budget, batch_rows,
                                                     tok.pad_id)):
                results[i]["eval_choice_accuracy"] = acc
    finally:
        pm.model.train(was_training)
    return results


def _groups(n_adapters: int, piece_tokens: int, piece_rows: int, budget: int, batch_rows: int) -> int:
    """How many adapters one forward over a piece holds."""
    by_tokens = budget // max(1, piece_tokens)
    by_rows = batch_rows // max(1, piece_rows)
    return max(1, min(n_adapters, by_tokens, by_rows))


def _eval_loss(pm, adapters, samples, device, budget, batch_rows, pad_id) -> list[float]:
    """Token-weighted mean loss over the eval set, per adapter."""
    sums = [0.0] * len(adapters)
    counts = [0] * len(adapters)
    chunk = head_chunk_rows(vocab_size(pm), pm.model, device)

    def run(group: list[int], piece: tuple[int, int]) -> None:
        loss_sums, loss_counts = eval_loss_piece(pm, [adapters[j] for j in group], samples[piece[0] : piece[1]],
                                                 device, chunk, pad_id)
        for j, s, c in zip(group, loss_sums, loss_counts):
            sums[j] += s
            counts[j] += c

    _each_piece(len(adapters), [len(s.tokens) for s in samples], budget, batch_rows, run)
    return [s / max(1, c) for s, c in zip(sums, counts)]


def eval_loss_piece(pm: PackedModel, adapters: Sequence[int | None], samples: Sequence[Sample],
                    device: torch.device, chunk: int, pad_id: int) -> tuple[list[float], list[int]]:
    """One eval forward: every adapter of the group over the same rows; each adapter's
    summed loss and label count."""
    active = [a for a in adapters if a is not None]
    rows = [len(samples)] * len(adapters)
    batch = eval_batch(pm, list(samples) * len(adapters), rows, pad_id)
    hidden = eval_hidden(pm, batch, active, device)
    sums, counts = adapter_loss_sums(pm.model.output, hidden, labels_to(batch.labels, device), chunk)
    return [float(s) for s in torch.stack(sums).tolist()], [int(c) for c in torch.stack(counts).tolist()]


def _each_piece(n_adapters: int, lengths: Sequence[int], budget: int, batch_rows: int,
                run: Callable[[list[int], tuple[int, int]], None], widest: bool = False) -> None:
    """``run(group, piece)`` over the eval rows cut into budget-sized pieces (the same pieces
    whatever adapters are evaluated; ``widest``: as `split_pieces` takes it) and the adapters
    in groups that fit, retried smaller on out-of-memory."""
    slots = list(range(n_adapters))
    for piece in split_pieces(lengths, budget, batch_rows, widest):
        part = lengths[piece[0] : piece[1]]
        per = _groups(n_adapters, len(part) * max(part) if widest else sum(part), len(part), budget, batch_rows)
        for g0 in range(0, len(slots), per):
            retry_smaller(run, slots[g0 : g0 + per], piece)


def _prompts(samples, examples, tok: TextTokenizer, max_seq_len: int) -> tuple[list[list[int]], list[str]]:
    """Each eval row's prompt ids and reference answer (from the samples; rows tokenized
    without them fall back to the plain examples)."""
    if samples and all(s.prompt is not None for s in samples):
        return [list(s.prompt) for s in samples], [s.reference or "" for s in samples]
    return [tok.prompt_ids(ex["input"])[: max_seq_len - 1] for ex in examples], [ex["output"] for ex in examples]


def _answers(pm, adapters, prompts, tok: TextTokenizer, max_new_tokens, max_seq_len, device, budget,
             batch_rows) -> list[list[str]]:
    """Greedy answers of every eval prompt, per adapter (decoded until eos). Prompts go in
    order of length, so that a forward's rows (each as wide as its widest: a decode cache's
    rows, or padded rows) are of about one length."""
    out: list[list[str | None]] = [[None] * len(prompts) for _ in adapters]
    widths = [min(max_seq_len, len(p) + max_new_tokens) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: widths[i])

    def run(group: list[int], piece: tuple[int, int]) -> None:
        rows = order[piece[0] : piece[1]]
        n = len(rows)
        answers = greedy_generate(pm, [prompts[i] for i in rows] * len(group), [adapters[j] for j in group], n,
                                  tok, max_new_tokens, max_seq_len, device)
        for gi, j in enumerate(group):
            for i, answer in zip(rows, answers[gi * n : (gi + 1) * n]):
                out[j][i] = answer

    _each_piece(len(adapters), [widths[i] for i in order], budget, batch_rows, run, widest=True)
    return [[a or "" for a in answers] for answers in out]


def _choice_accuracy(pm, adapters, samples: Sequence[Sample], device, budget, batch_rows, pad_id) -> list[float]:
    """Accuracy of the highest log-likelihood choice per row, per adapter: every choice of
    every row is one scored row (labels on the choice's tokens), packed for all adapters."""
    rows = [c for s in samples for c in (s.choices or ())]
    owner = [i for i, s in enumerate(samples) for _ in (s.choices or ())]
    if not rows:
        return [math.nan] * len(adapters)
    logliks: list[list[float]] = [[0.0] * len(rows) for _ in adapters]
    chunk = head_chunk_rows(vocab_size(pm), pm.model, device)

    def run(group: list[int], piece: tuple[int, int]) -> None:
        part = rows[piece[0] : piece[1]]
        active = [adapters[j] for j in group if adapters[j] is not None]
        scored = list(part) * len(group)
        batch = eval_batch(pm, scored, [len(part)] * len(group), pad_id)
        hidden = eval_hidden(pm, batch, active, device)
        # the batch's labels are in row order: split per row instead of per adapter
        per_row = label_counts(scored, [1] * len(scored))
        labels = LabelParts(batch.labels.index, batch.labels.targets, per_row, per_row)
        sums, _ = adapter_loss_sums(pm.model.output, hidden, labels_to(labels, device), chunk)
        values = (-torch.stack(sums)).tolist()
        for gi, j in enumerate(group):
            logliks[j][piece[0] : piece[1]] = values[gi * len(part) : (gi + 1) * len(part)]

    _each_piece(len(adapters), [len(r.tokens) for r in rows], budget, batch_rows, run)
    gold = [s.gold for s in samples if s.choices]
    out = []
    for values in logliks:
        scores: list[list[float]] = [[] for _ in samples]
        for i, v in zip(owner, values):
            scores[i].append(v)
        out.append(choice_accuracy([sc for sc in scores if sc], gold))
    return out
