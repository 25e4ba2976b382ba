"""One eval forward of a packed model: rows laid out as the model's attention allows, the
adapters' LoRA segments set, the final norm's hidden states out (shared by the eval's
losses, choices and greedy generation)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plora.data.dataset import Sample
from plora.train.packed.head_loss import final_hidden
from plora.train.packed.inject import PackedModel
from plora.train.packed.step_batch import StepBatch, build_step_batch
from plora.train.packed.varlen_attention import row_attention


def eval_hidden(pm: PackedModel, batch: StepBatch, active: Sequence[int], device: torch.device,
                compile_ahead: bool = True) -> torch.Tensor:
    """The final-norm hidden states ``[T, d]`` of a batch whose rows belong, adapter by
    adapter, to ``active`` (empty: the base model). ``compile_ahead``: compile the batch's
    kernels all at once first (`PackedModel.compile_kernels_ahead`)."""
    positions = batch.positions.to(device) if batch.positions is not None else None
    rows = row_attention(pm.model)
    if batch.flat:
        rows.set(batch.row_lengths, batch.cu_seqlens().to(device) if device.type == "cuda" else None, batch.max_len)
    try:
        return adapters_hidden(pm, batch.tokens.to(device), positions, active, batch.segment_tokens, device,
                               compile_ahead)
    finally:
        if rows is not None:
            rows.clear()


def adapters_hidden(pm: PackedModel, tokens: torch.Tensor, positions: torch.Tensor | None, active: Sequence[int],
                    segment_tokens: Sequence[int], device: torch.device, compile_ahead: bool = True) -> torch.Tensor:
    """`eval_hidden` of tokens already on the device, adapter by adapter (``segment_tokens``
    each), with whatever attention the model is set for."""
    if active:
        pm.state.set_batch(active, list(segment_tokens), device)
    try:
        if active and compile_ahead:
            pm.compile_kernels_ahead(training=False)
        h = final_hidden(pm.model, tokens, positions)
    finally:
        pm.state.clear()
    return h.reshape(-1, h.shape[-1])


def eval_batch(pm: PackedModel, samples: Sequence[Sample], rows_per_adapter: Sequence[int], pad_id: int) -> StepBatch:
    """Adapter-contiguous rows, flattened where the model's attention is confined to rows."""
    return build_step_batch(samples, rows_per_adapter, pad_id, flat=row_attention(pm.model) is not None)


def vocab_size(pm: PackedModel) -> int:
    return int(pm.model.tok_embeddings.weight.shape[0])
