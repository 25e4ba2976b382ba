"""Changing which adapters a running pack holds: a slot refilled in place, or the pack laid out again.

A slot is one adapter's place in a packed model: its rows of every layer's stacked A and
Bᵀ, its pieces of the `LoRABank` buffers and of `PackedAdamW`'s moments, its step count
and learning rate. An adapter that joins a running job starts exactly as it would alone:
A drawn from its own seed and each layer's name (`PackedLoRALinear._init_a`), Bᵀ zero,
both moments zero, no optimizer step taken.

Two ways in:

- `refill_slot`: a free slot of the same rank takes the newcomer in place; nothing is
  allocated and no other slot is touched.
- `relayout`: the pack is laid out again from a list of slots to keep (their weights,
  moments, step counts and learning rates copied as they are) and new adapters; slots
  left out are given back. Every buffer is new, so whoever holds views of the old ones (a
  captured CUDA graph) must drop them.

Tensor-parallel packs are not supported here (their A or Bᵀ are shards of the full tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from plora.train.packed.bank import LoRABank, PackedAdamW
from plora.train.packed.inject import PackedModel
from plora.train.packed.layer import AdapterSpec

__all__ = ["NewAdapter", "refill_slot", "relayout"]


@dataclass(frozen=True)
class NewAdapter:
    """An adapter entering the pack: its shape, its own learning rate and weight decay."""

    spec: AdapterSpec
    learning_rate: float
    weight_decay: float = 0.0


def _check_not_sharded(pm: PackedModel) -> None:
    if any(layer.tp is not None for layer in pm.layers.values()):
        raise NotImplementedError("adapters cannot join a tensor-parallel pack")


def refill_slot(pm: PackedModel, bank: LoRABank, optimizer: PackedAdamW, k: int, new: NewAdapter) -> None:
    """Slot ``k`` (free, of the newcomer's rank) now holds ``new``, freshly initialized."""
    _check_not_sharded(pm)
    old = pm.state.adapters[k]
    if old.rank != new.spec.rank:
        raise ValueError(f"slot {k} has rank {old.rank}, the new adapter {new.spec.rank}")
    pm.state.set_adapter(k, new.spec)
    r0, r1 = pm.state.row_starts[k], pm.state.row_starts[k + 1]
    with torch.no_grad():
        for layer in pm.layers.values():
            layer.a_all[r0:r1].copy_(layer._init_a(new.spec))
            layer.bt_all[r0:r1].zero_()
        for buf in (optimizer.exp_avg, optimizer.exp_avg_sq, bank.grads):
            for view in bank.adapter_views(buf, k):
                view.zero_()
    optimizer.steps[k] = 0
    optimizer.lrs[k] = float(new.learning_rate)
    optimizer.weight_decays[k] = float(new.weight_decay)


def relayout(
    pm: PackedModel,
    bank: LoRABank,
    optimizer: PackedAdamW,
    slots: Sequence[int | NewAdapter],
    share: Callable[[nn.Parameter], float] | None = None,
) -> tuple[LoRABank, PackedAdamW]:
    """Lay the pack out as ``slots``: an int keeps that old slot as it is, a `NewAdapter`
    enters fresh. Returns the new bank and optimizer (the old ones must not be used again)."""
    _check_not_sharded(pm)
    if not slots:
        raise ValueError("a pack needs at least one slot")
    old_rows = pm.state.row_starts
    specs = [pm.state.adapters[s] if isinstance(s, int) else s.spec for s in slots]
    with torch.no_grad():
        for layer in pm.layers.values():
            device, dtype = layer.a_all.device, layer.a_all.dtype
            a_parts, bt_parts = [], []
            for s in slots:
                if isinstance(s, int):
                    a_parts.append(layer.a_all[old_rows[s] : old_rows[s + 1]])
                    bt_parts.append(layer.bt_all[old_rows[s] : old_rows[s + 1]])
                else:
                    a_parts.append(layer._init_a(s.spec).to(device=device, dtype=dtype))
                    bt_parts.append(torch.zeros(s.spec.rank, layer.out_features, device=device, dtype=dtype))
            a, bt = torch.cat(a_parts), torch.cat(bt_parts)
            for p, value in ((layer.a_all, a), (layer.bt_all, bt)):
                p.grad = None  # the old gradient view has the old shape
                p.data = value
    pm.state.adapters = specs
    pm.state.forget_layout()
    pm.state.clear()
    for layer in pm.layers.values():
        layer._rows = pm.state.row_starts
    new_bank = LoRABank(pm, share=share)
    lrs = [optimizer.lrs[s] if isinstance(s, int) else float(s.learning_rate) for s in slots]
    decays = [optimizer.weight_decays[s] if isinstance(s, int) else float(s.weight_decay) for s in slots]
    new_opt = PackedAdamW(new_bank, lrs, weight_decay=decays, betas=optimizer.betas, eps=optimizer.eps)
    with torch.no_grad():
        for i, s in enumerate(slots):
            if not isinstance(s, int):
                continue
            new_opt.steps[i] = optimizer.steps[s]
            # an adapter accumulating its gradient over several steps keeps what it has summed
            for src, dst in zip(bank.adapter_views(bank.grads, s), new_bank.adapter_views(new_bank.grads, i)):
                dst.copy_(src)
            for old_buf, new_buf in ((optimizer.exp_avg, new_opt.exp_avg), (optimizer.exp_avg_sq, new_opt.exp_avg_sq)):
                for src, dst in zip(bank.adapter_views(old_buf, s), new_bank.adapter_views(new_buf, i)):
                    dst.copy_(src)
    return new_bank, new_opt
