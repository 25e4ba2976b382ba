"""Epochs as fidelity: an adapter scored at each of its epoch ends, its best epoch kept.

With ``eval.each_epoch`` (a sweep of more than one epoch), an adapter is evaluated on the
whole eval set, as its final eval is, at the end of every epoch; the weights of its best
epoch by the objective (ties: the lower eval loss, then the earlier epoch) are what its
PEFT folder holds at the end, and its metrics.json lists every epoch's scores and the
epoch kept. An epoch ends at the adapter step where it has drawn ``e · N`` rows of the
``N`` training rows: ``ceil(e · N / batch_size)``, the step count an ``e``-epoch budget
gives (`plora.data.accumulation.steps_for`); the last epoch ends with the budget (a fractional
last epoch too).

The best weights so far are kept as a flat host copy of the adapter's pieces of the bank
(a tensor-parallel rank's own shards), the layout of a mid-job checkpoint's weights, which
carries them (`plora.train.checkpoint`): an adapter resumed mid-epoch still knows its
earlier epochs' scores and best weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch

__all__ = ["EpochBook", "better_epoch", "epoch_ends", "epoch_record", "flat_weights", "load_flat_weights"]


def epoch_ends(num_train: int, batch_size: int, total_steps: int) -> list[int]:
    """The adapter steps at which its epochs end, the budget's last step included (a
    partial last epoch ends there): ``ceil(e · N / batch_size)`` for e = 1, 2, ..."""
    if num_train <= 0 or total_steps <= 0:
        return [max(0, total_steps)]
    ends: list[int] = []
    e = 1
    while True:
        step = math.ceil(Fraction(e * num_train, batch_size))
        if step >= total_steps:
            break
        if not ends or step > ends[-1]:
            ends.append(step)
        e += 1
    return ends + [total_steps]


def epoch_record(epoch: int, step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
    """One epoch's line of metrics.json's ``epochs``: its number (from 1), the adapter step
    it ended at, and its eval metrics."""
    return {"epoch": int(epoch), "step": int(step), **{k: _plain(v) for k, v in metrics.items()}}


def better_epoch(new: Mapping[str, Any], old: Mapping[str, Any] | None, objective: str, minimize: bool) -> bool:
    """Whether epoch ``new`` beats ``old`` (None: none yet) by ``objective`` (its results
    key, ``eval_<name>``) in its direction; a tie goes to the lower eval loss, then to
    ``old``. A score that is not a number never wins over one that is."""
    if old is None:
        return True
    a, b = _number(new.get(objective)), _number(old.get(objective))
    if a is None or b is None:
        return b is None and a is not None
    if a != b:
        return a < b if minimize else a > b
    la, lb = _number(new.get("eval_loss")), _number(old.get("eval_loss"))
    return la is not None and (lb is None or la < lb)


def flat_weights(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """An adapter's pieces of the bank (`LoRABank.adapter_views`) as one flat host copy."""
    return torch.cat([v.detach().reshape(-1) for v in views]).cpu().clone()


def load_flat_weights(views: Sequence[torch.Tensor], flat: torch.Tensor) -> bool:
    """Copy a flat copy back into the adapter's pieces of the bank; False (nothing copied)
    when its size is not theirs (another layout)."""
    if sum(v.numel() for v in views) != flat.numel():
        return False
    with torch.no_grad():
        off = 0
        for v in views:
            v.copy_(flat[off : off + v.numel()].view(v.shape).to(device=v.device, dtype=v.dtype))
            off += v.numel()
    return True


def _number(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _plain(v: Any) -> Any:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


class EpochBook:
    """Which adapter steps end an adapter's epochs, and its best epoch so far.

    ``num_train``: the job's training rows; ``each_epoch``: score every epoch end (else only
    the budget's end counts); ``objective``/``minimize``: what ranks epochs."""

    def __init__(self, num_train: int, *, each_epoch: bool, objective: str | None, minimize: bool):
        self.num_train = num_train
        self.each_epoch = each_epoch
        self.objective = f"eval_{objective or 'loss'}"
        self.minimize = minimize

    def ends(self, r) -> list[int]:
        """The adapter steps ``r``'s epochs end at (only its budget's end without
        ``eval.each_epoch``)."""
        if r.epoch_ends is None:
            r.epoch_ends = (epoch_ends(self.num_train, r.cfg.batch_size, r.total_steps)
                            if self.each_epoch else [r.total_steps])
        return r.epoch_ends

    def due(self, stepped: Sequence[Any]) -> list[Any]:
        """Adapters of ``stepped`` at the end of an epoch before their last."""
        return [r for r in stepped if r.active and r.at_boundary and r.step < r.total_steps and r.step in self.ends(r)]

    def record(self, r, m: Mapping[str, float]) -> bool:
        """Add the epoch ``r`` has just finished to its scores; True when it is its best so far."""
        ends = self.ends(r)
        record = epoch_record(ends.index(r.step) + 1 if r.step in ends else len(r.epochs) + 1, r.step, m)
        r.epochs.append(record)
        best = next((e for e in r.epochs if e["epoch"] == r.best_epoch), None)
        if not better_epoch(record, best, self.objective, minimize=self.minimize):
            return False
        r.best_epoch = record["epoch"]
        return True

    def keep_best(self, runs: Sequence[Any], metrics: Sequence[Mapping[str, float]]) -> tuple[list[dict], list[Any]]:
        """The last epoch's scores join each adapter's; each adapter's metrics.json scores
        (its best epoch's), and the adapters whose best is an earlier epoch (their kept
        weights are to be saved over the last one's)."""
        out, earlier = [], []
        for r, m in zip(runs, metrics):
            last_best = self.record(r, m)
            if not last_best and r.best_weights is None:  # its best's weights unknown (an old checkpoint): the last
                r.best_epoch = r.epochs[-1]["epoch"]
            elif not last_best:
                earlier.append(r)
            out.append(self.best_scores(r))
        return out, earlier

    @staticmethod
    def best_scores(r) -> dict[str, Any]:
        """The eval scores of ``r``'s best epoch, as metrics.json holds an adapter's."""
        best = next(e for e in r.epochs if e["epoch"] == r.best_epoch)
        return {k: v for k, v in best.items() if k.startswith("eval_")}
