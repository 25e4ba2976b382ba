"""The adapters of a packed job as parameters: the bank of their weights and their optimizer.

`AdapterPack` owns the packed model's adapter slots (`plora.train.packed.inject.PackedModel`),
the flat `LoRABank` of their weights and the `PackedAdamW` over it (one launch per step for
the whole pack), and, under tensor parallelism, the process group's view of them. Every
change to what a slot holds goes through it: learning rates for the next step, an adapter's
state for a checkpoint and back, an epoch's weights kept and put back, a slot refilled or
the pack laid out again for adapters that join (`plora.train.packed.slots`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from plora.job.config import JobAdapter
from plora.kernels.segments import HP_COLUMNS
from plora.train.adapter_run import AdapterRun, lr_factor
from plora.train.epochs import flat_weights, load_flat_weights
from plora.train.packed.bank import LoRABank, PackedAdamW
from plora.train.packed.inject import PackedModel
from plora.train.packed.layer import AdapterSpec
from plora.train.packed.slots import NewAdapter, refill_slot, relayout
from plora.train.packed.tp import TensorParallel

#: learning rates are capped here: lr / (1 - beta1) must stay under float32 max (3.4e38)
MAX_LR = 1e37


def adapter_spec(a: JobAdapter) -> AdapterSpec:
    """An adapter as the packed layers see it."""
    return AdapterSpec(a.id, a.rank, a.alpha, a.seed, dropout=a.dropout or 0.0, rslora=bool(a.rslora))


def newcomer(a: JobAdapter) -> NewAdapter:
    """An adapter joining the pack, freshly initialized."""
    return NewAdapter(adapter_spec(a), a.learning_rate, a.weight_decay or 0.0)


class AdapterPack:
    """The pack's adapter weights and optimizer (after TP sharding: the local shards)."""

    def __init__(self, pm: PackedModel, adapters: Sequence[JobAdapter], tp: TensorParallel | None = None):
        self.pm = pm
        self.tp = tp
        self.bank = LoRABank(pm, share=tp.share if tp else None)
        self.optimizer = PackedAdamW(self.bank, [a.learning_rate for a in adapters],
                                     weight_decay=[a.weight_decay for a in adapters])

    @property
    def num_slots(self) -> int:
        return self.bank.num_adapters

    def scale(self, k: int) -> float:
        return self.pm.state.adapters[k].scale

    # ------------------------------------------------------------------ a step
    def set_learning_rates(self, active: Sequence[AdapterRun]) -> None:
        """Each active adapter's learning rate at its own step (warm-up and schedule)."""
        for r in active:
            lr = r.cfg.learning_rate * lr_factor(r.step, r.total_steps, r.warmup, r.scheduler)
            # lr / (1 - beta1) goes to the device as float32: a larger value would turn one
            # absurd adapter's step into inf before its weights could show it.
            self.optimizer.lrs[r.index] = min(lr, MAX_LR)

    def learning_rate(self, k: int) -> float:
        return self.optimizer.lrs[k]

    def planned(self, slots: Sequence[int]) -> torch.Tensor:
        """The optimizer's per-slot hyperparameters of a step of ``slots`` (a vacant slot's
        row says "leave alone")."""
        return self.optimizer.planned_hyperparams(slots)

    def zero_grad(self, where: torch.Tensor | None = None) -> None:
        """Every slot's gradient to zero, or only where ``where`` (a bool per slot) says."""
        if where is None:
            self.bank.zero_grad()
        else:
            self.bank.zero_grad_where(where)

    def step_where(self, planned: torch.Tensor, go: torch.Tensor, coef: torch.Tensor) -> None:
        """AdamW on the device for the slots ``go`` marks, gradients scaled by ``coef``."""
        self.optimizer.step_where(planned, go, coef)

    def count_steps(self, slots: Sequence[int]) -> None:
        """The optimizer steps ``slots`` took (bias correction)."""
        self.optimizer.count_steps(list(slots))

    def optimizer_launches(self) -> None:
        """What a step's norms and AdamW launch, for `plora.kernels.compile_ahead` to collect
        inside `triton_ops.collecting` (where no kernel runs: every buffer is left as it is)."""
        if self.tp is not None:
            return
        hp = torch.zeros(self.num_slots, len(HP_COLUMNS), dtype=torch.float32, device=self.bank.weights.device)
        self.bank.sq_norms()
        self.optimizer.step_where(hp, torch.zeros(self.num_slots, dtype=torch.bool, device=hp.device),
                                  torch.zeros(self.num_slots, dtype=torch.float32, device=hp.device))

    def sq_norms(self, of_weights: bool = False) -> torch.Tensor:
        """Every adapter's squared L2 norm (gradient, or weights) over the whole model: one
        launch, one all-reduce under TP; a device tensor [K]."""
        sq = self.bank.sq_norms(of_weights)
        if self.tp is not None:
            self.tp.reduce_sq_norms(sq)
        return sq

    # ------------------------------------------------------------ saving
    def host_states(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """The adapters' weights in torchtune's LoRA naming, on the host: one copy of the bank
        for them all, or under TP gathered to full tensors (a collective, on every rank)."""
        if self.tp is None:
            return self.bank.host_states(list(indices))
        return [self.tp.adapter_state_dict(k) for k in indices]

    def leaving_states(self, indices: Sequence[int]) -> list[Any]:
        """What the adapter writer saves of leaving adapters: each one's state, to be brought
        to the host on the writer's thread from one device copy of their rows made now
        (`LoRABank.snapshot`); under TP, gathered full tensors on the host (a collective)."""
        if self.tp is None:
            snap = self.bank.snapshot(list(indices))
            return [partial(snap.state, i) for i in range(len(indices))]
        return [self.tp.adapter_state_dict(k) for k in indices]

    def keep_weights(self, k: int) -> torch.Tensor:
        """Slot ``k``'s weights as one flat host copy (an epoch's, kept for later)."""
        return flat_weights(self.bank.adapter_views(self.bank.weights, k))

    def put_weights(self, k: int, flat: torch.Tensor) -> None:
        """Put weights `keep_weights` kept back into slot ``k``."""
        load_flat_weights(self.bank.adapter_views(self.bank.weights, k), flat)

    def adapter_state(self, k: int) -> dict[str, Any]:
        """What slot ``k``'s next step depends on: weights, both moments, its optimizer steps."""
        bank, opt = self.bank, self.optimizer
        return {
            "weights": torch.cat(bank.adapter_views(bank.weights, k)).detach().cpu().clone(),
            "exp_avg": torch.cat(bank.adapter_views(opt.exp_avg, k)).cpu().clone(),
            "exp_avg_sq": torch.cat(bank.adapter_views(opt.exp_avg_sq, k)).cpu().clone(),
            "optimizer_steps": int(opt.steps[k]),
        }

    def load_adapter_state(self, k: int, saved: dict[str, Any]) -> bool:
        """Put `adapter_state`'s pieces back into slot ``k``; False (nothing changed) where
        they are of another layout (other targets or shards)."""
        bank, opt = self.bank, self.optimizer
        pieces = [(bank.adapter_views(bank.weights, k), saved["weights"]),
                  (bank.adapter_views(opt.exp_avg, k), saved["exp_avg"]),
                  (bank.adapter_views(opt.exp_avg_sq, k), saved["exp_avg_sq"])]
        if any(sum(v.numel() for v in views) != flat.numel() for views, flat in pieces):
            return False
        with torch.no_grad():
            for views, flat in pieces:
                off = 0
                for v in views:
                    v.copy_(flat[off : off + v.numel()].to(device=v.device, dtype=v.dtype))
                    off += v.numel()
        opt.steps[k] = int(saved["optimizer_steps"])
        return True

    # ------------------------------------------------------------ joins
    def free_slots(self, holders: dict[int, bool]) -> dict[int, list[int]]:
        """Slots no training adapter holds, by rank (``holders``: slot -> whether its adapter trains)."""
        free: dict[int, list[int]] = {}
        for k, spec in enumerate(self.pm.state.adapters):
            if not holders.get(k, False):
                free.setdefault(spec.rank, []).append(k)
        return free

    def refill(self, k: int, a: JobAdapter) -> None:
        """Slot ``k`` (free, of ``a``'s rank) now holds ``a``, freshly initialized."""
        refill_slot(self.pm, self.bank, self.optimizer, k, newcomer(a))

    def relayout(self, keep: Sequence[int], new: Sequence[JobAdapter]) -> dict[int, int]:
        """The pack laid out again: the slots ``keep`` (in this order) and then ``new``; every
        other slot is given back. Every buffer is new. Returns old slot -> new slot."""
        self.bank, self.optimizer = relayout(self.pm, self.bank, self.optimizer,
                                             list(keep) + [newcomer(a) for a in new])
        return {old: i for i, old in enumerate(keep)}
