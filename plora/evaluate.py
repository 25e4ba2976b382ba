"""Per-adapter losses and eval metrics of a packed model.

Eval packs too: the adapters being evaluated each get the whole eval set as their rows, and
the base model runs once over all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from plora.data import IGNORE_INDEX, Sample, TextTokenizer, collate
from plora.metrics import choice_accuracy, generated_metrics, score_predictions
from plora.packed.inject import PackedModel


def segment_loss_sums(
    logits: torch.Tensor, labels: torch.Tensor, rows: Sequence[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Summed next-token loss and answer-token count of each adapter's rows (rows are
    adapter-contiguous). Training takes their ratio; eval adds them up over chunks."""
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
    """Mean next-token loss over each adapter's own answer tokens (rows are adapter-contiguous)."""
    sums, counts = segment_loss_sums(logits, labels, rows)
    return [s / c.clamp(min=1) for s, c in zip(sums, counts)]


def _forward(pm: PackedModel, tokens: torch.Tensor, active: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
    seq = tokens.shape[1]
    pm.state.set_batch(active, [r * seq for r in rows], tokens.device)
    try:
        return pm.model(tokens)
    finally:
        pm.state.clear()


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
    batch_rows: int = 256,
) -> list[dict[str, float]]:
    """Eval metrics (`plora.metrics`) for each adapter index (None = the base model alone)."""
    was_training = pm.model.training
    pm.model.eval()
    results: list[dict[str, float]] = [{} for _ in adapters]
    per_chunk = max(1, batch_rows // max(1, len(samples)))
    generated = generated_metrics(metrics)
    for c0 in range(0, len(adapters), per_chunk):
        group = list(range(c0, min(len(adapters), c0 + per_chunk)))
        if "loss" in metrics:
            for i, loss in zip(group, _eval_loss(pm, [adapters[i] for i in group], samples, device, batch_rows)):
                results[i]["eval_loss"] = loss
        if generated:
            prompts, references = _prompts(samples, examples, tok, max_seq_len)
            answers = _answers(pm, [adapters[i] for i in group], prompts, tok, max_new_tokens, max_seq_len, device,
                               batch_rows)
            for i, predictions in zip(group, answers):
                results[i].update(score_predictions(generated, predictions, references))
        if "choice_accuracy" in metrics:
            for i, acc in zip(group, _choice_accuracy(pm, [adapters[i] for i in group], samples, device, batch_rows)):
                results[i]["eval_choice_accuracy"] = acc
    pm.model.train(was_training)
    return results


def _eval_loss(pm, adapters, samples, device, batch_rows) -> list[float]:
    """Token-weighted mean loss over the eval set, per adapter."""
    step = max(1, batch_rows // len(adapters))
    sums = [0.0] * len(adapters)
    counts = [0] * len(adapters)
    for s0 in range(0, len(samples), step):
        chunk = samples[s0 : s0 + step]
        tokens, labels = collate(list(chunk) * len(adapters), pad_id=0)
        tokens, labels = tokens.to(device), labels.to(device)
        active = [a for a in adapters if a is not None]
        if active and len(active) != len(adapters):
            raise ValueError("evaluate the base model on its own, not packed with adapters")
        logits = _forward(pm, tokens, active, [len(chunk)] * len(active))
        chunk_sums, chunk_counts = segment_loss_sums(logits, labels, [len(chunk)] * len(adapters))
        for j, (s, c) in enumerate(zip(torch.stack(chunk_sums).tolist(), torch.stack(chunk_counts).tolist())):
            sums[j] += s
            counts[j] += int(c)
    return [s / max(1, c) for s, c in zip(sums, counts)]


def _prompts(samples, examples, tok: TextTokenizer, max_seq_len: int) -> tuple[list[list[int]], list[str]]:
    """Each eval row's prompt ids and reference answer (from the samples; rows tokenized
    without them fall back to the plain examples)."""
    if samples and all(s.prompt is not None for s in samples):
        return [list(s.prompt) for s in samples], [s.reference or "" for s in samples]
    return [tok.prompt_ids(ex["input"])[: max_seq_len - 1] for ex in examples], [ex["output"] for ex in examples]


def _answers(pm, adapters, prompts, tok: TextTokenizer, max_new_tokens, max_seq_len, device, batch_rows) -> list[list[str]]:
    """Greedy answers of every eval prompt, per adapter (decoded until eos)."""
    step = max(1, batch_rows // len(adapters))
    out: list[list[str]] = [[] for _ in adapters]
    active = [a for a in adapters if a is not None]
    for s0 in range(0, len(prompts), step):
        chunk = prompts[s0 : s0 + step]
        answers = greedy_generate(pm, chunk * len(adapters), active, len(chunk), tok, max_new_tokens, max_seq_len, device)
        n = len(chunk)
        for j in range(len(adapters)):
            out[j].extend(answers[j * n : (j + 1) * n])
    return out


def _choice_accuracy(pm, adapters, samples: Sequence[Sample], device, batch_rows) -> list[float]:
    """Accuracy of the highest log-likelihood choice per row, per adapter: every choice of
    every row is one scored row (labels on the choice's tokens), packed for all adapters."""
    rows = [c for s in samples for c in (s.choices or ())]
    owner = [i for i, s in enumerate(samples) for _ in (s.choices or ())]
    if not rows:
        return [math.nan] * len(adapters)
    active = [a for a in adapters if a is not None]
    if active and len(active) != len(adapters):
        raise ValueError("evaluate the base model on its own, not packed with adapters")
    step = max(1, batch_rows // len(adapters))
    logliks: list[list[float]] = [[] for _ in adapters]
    for r0 in range(0, len(rows), step):
        chunk = rows[r0 : r0 + step]
        tokens, labels = collate(list(chunk) * len(adapters), pad_id=0)
        tokens, labels = tokens.to(device), labels.to(device)
        logits = _forward(pm, tokens, active, [len(chunk)] * len(active))
        sums, _ = segment_loss_sums(logits, labels, [1] * tokens.shape[0])
        values = (-torch.stack(sums)).tolist()
        for j in range(len(adapters)):
            logliks[j].extend(values[j * len(chunk) : (j + 1) * len(chunk)])
    gold = [s.gold for s in samples if s.choices]
    out = []
    for values in logliks:
        scores: list[list[float]] = [[] for _ in samples]
        for i, v in zip(owner, values):
            scores[i].append(v)
        out.append(choice_accuracy([sc for sc in scores if sc], gold))
    return out


def greedy_generate(pm, prompts, active, rows_per_adapter, tok: TextTokenizer, max_new_tokens, max_seq_len, device) -> list[str]:
    """Decode all rows together; each row writes its next token after its own last one."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = min(max_seq_len, int(lengths.max()) + max_new_tokens)
    tokens = torch.full((len(prompts), width), tok.pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in prompts]
    rows = [rows_per_adapter] * len(active) if active else []
    for _ in range(max_new_tokens):
        if bool(done.all()) or int(lengths.max()) >= width:
            break
        cur = int(lengths.max())
        logits = _forward(pm, tokens[:, :cur], active, rows)
        nxt = logits[torch.arange(len(prompts), device=device), lengths - 1].argmax(-1)
        for i in torch.nonzero(~done).flatten().tolist():
            t = int(nxt[i])
            if t == tok.eos_id or int(lengths[i]) >= width:
                done[i] = True
                continue
            out[i].append(t)
            tokens[i, lengths[i]] = t
            lengths[i] += 1
    return [tok.decode(ids) for ids in out]
