"""Per-adapter optimizer ops on one flat buffer that holds every adapter of a pack.

A packed job keeps all its LoRA weights in one flat buffer (and the gradients, and the
AdamW moments, in buffers of the same layout). Each adapter owns a set of contiguous
ranges of it (its rows of every layer's stacked A and Bᵀ). The optimizer then needs, per
adapter, a squared norm (clipping, divergence checks) and an AdamW update with the
adapter's own learning rate, bias corrections and clipping coefficient.

Done per adapter and per tensor with torch ops, that is thousands of launches per step
(K adapters × 2 tensors × layers) and as much host work: more than the LoRA math itself
on a GPU. Here the ranges are cut once into tiles (`build_segments`), and each op is one
launch over all tiles with a per-adapter table of numbers, so a step costs the same few
launches whatever K is.

On CPU (and as the test oracle) the torch reference does the same math element-wise with a
per-element owner index.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

#: Elements per tile (one program); per-adapter ranges are cut to at most this.
TILE = 8192
#: Elements per vector step inside a program.
BLOCK = 1024
#: Columns of the per-adapter hyper-parameter table of `segmented_adamw_`.
HP_COLUMNS = ("step", "decay", "step_size", "bc2_sqrt", "beta1", "beta2", "eps", "grad_coef")


@dataclass(eq=False)
class Segments:
    """Which adapter owns which ranges of a flat buffer, cut into tiles; built once per job.

    ``ranges`` are (start, length, group, weight) on the host. ``weight`` scales a range's
    squared norm (tensor-parallel copies of one tensor count once in a norm).
    """

    num_groups: int
    numel: int
    device: torch.device
    ranges: tuple[tuple[int, int, int, float], ...]
    tile_start: torch.Tensor  # int64 [T]
    tile_len: torch.Tensor  # int32 [T]
    tile_group: torch.Tensor  # int32 [T]
    tile_weight: torch.Tensor  # float32 [T]
    gather: torch.Tensor  # int64 [G, max tiles of a group]: tile ids, padded with T
    _owner: torch.Tensor | None = field(default=None, repr=False)
    _elem_weight: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_tiles(self) -> int:
        return int(self.tile_start.numel())

    def owner(self) -> torch.Tensor:
        """int64 [numel]: each element's group, ``num_groups`` where no group owns it
        (the torch path's index; built on first use)."""
        if self._owner is None:
            own = torch.full((self.numel,), self.num_groups, dtype=torch.int64)
            for start, n, g, _ in self.ranges:
                own[start : start + n] = g
            self._owner = own.to(self.device)
        return self._owner

    def elem_weight(self) -> torch.Tensor | None:
        if all(w == 1.0 for *_, w in self.ranges):
            return None
        if self._elem_weight is None:
            w = torch.ones(self.numel, dtype=torch.float64)
            for start, n, _, wt in self.ranges:
                w[start : start + n] = wt
            self._elem_weight = w.to(self.device)
        return self._elem_weight


def build_segments(
    ranges: Sequence[tuple[int, int, int, float]],
    num_groups: int,
    numel: int,
    device: torch.device | str,
    tile: int = TILE,
) -> Segments:
    """Cut per-group ranges (start, length, group, weight) into tiles of at most ``tile``."""
    rows: list[tuple[int, int, int, float]] = []
    clean = []
    for start, n, g, w in ranges:
        if not (0 <= g < num_groups):
            raise ValueError(f"build_segments: group {g} out of range [0, {num_groups})")
        if start < 0 or n < 0 or start + n > numel:
            raise ValueError(f"build_segments: range [{start}, {start + n}) outside the buffer of {numel}")
        if n == 0:
            continue
        clean.append((int(start), int(n), int(g), float(w)))
        for s in range(0, n, tile):
            rows.append((start + s, min(tile, n - s), g, float(w)))
    rows.sort(key=lambda r: (r[2], r[0]))  # tiles of a group together: a deterministic sum per group
    device = torch.device(device)
    T = len(rows)
    per_group: list[list[int]] = [[] for _ in range(num_groups)]
    for t, r in enumerate(rows):
        per_group[r[2]].append(t)
    width = max([len(p) for p in per_group] + [1])
    gather = torch.full((num_groups, width), T, dtype=torch.int64)
    for g, ids in enumerate(per_group):
        gather[g, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    cols = list(zip(*rows)) if rows else [(), (), (), ()]
    return Segments(
        num_groups=num_groups,
        numel=numel,
        device=device,
        ranges=tuple(clean),
        tile_start=torch.tensor(cols[0], dtype=torch.int64).to(device),
        tile_len=torch.tensor(cols[1], dtype=torch.int32).to(device),
        tile_group=torch.tensor(cols[2], dtype=torch.int32).to(device),
        tile_weight=torch.tensor(cols[3], dtype=torch.float32).to(device),
        gather=gather.to(device),
    )


def _backend(t: torch.Tensor, backend: str | None) -> str:
    from .function import backend_for

    return backend_for(t, backend)


def _check_flat(name: str, t: torch.Tensor, seg: Segments) -> None:
    if t.dim() != 1 or not t.is_contiguous() or t.numel() != seg.numel:
        raise ValueError(f"{name}: expected a contiguous 1-D buffer of {seg.numel} elements, got {tuple(t.shape)}")


# ------------------------------------------------------------------------- norms
def segment_sq_norms(x: torch.Tensor, seg: Segments, *, backend: str | None = None) -> torch.Tensor:
    """Σ weight · x² over each group's ranges: float32 [G] (float64 for float64 x).

    Inf or NaN in one group's ranges stays in that group's value.
    """
    _check_flat("x", x, seg)
    if _backend(x, backend) == "triton":
        from .triton_ops import _launch, kernels_module

        partial = torch.zeros(seg.num_tiles + 1, dtype=torch.float32, device=x.device)
        if seg.num_tiles:
            k = kernels_module("_triton_segment_kernels.py")
            _launch(k.sq_norm_tiles_kernel, (seg.num_tiles,), x, seg.tile_start, seg.tile_len, seg.tile_weight,
                    partial, BLOCK=min(BLOCK, TILE), TILE=TILE)
        return partial[seg.gather].sum(dim=1)
    return segment_sq_norms_ref(x, seg)


def segment_sq_norms_ref(x: torch.Tensor, seg: Segments) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    sq = x.to(acc).square()
    w = seg.elem_weight()
    if w is not None:
        sq = sq * w.to(acc)
    out = torch.zeros(seg.num_groups + 1, dtype=acc, device=x.device)
    out.index_add_(0, seg.owner(), sq)
    return out[: seg.num_groups]


# ------------------------------------------------------------------------- AdamW
def adamw_hyperparams(
    steps: dict[int, tuple[int, float, float, float, float, float, float]],
    num_groups: int,
    device: torch.device | str,
) -> torch.Tensor:
    """The per-group table of `segmented_adamw_`.

    ``steps[g] = (t, lr, weight_decay, beta1, beta2, eps, grad_coef)`` for each group that
    steps now (t counts from 1); the other groups' rows say "leave alone".
    """
    hp = torch.zeros(num_groups, len(HP_COLUMNS), dtype=torch.float64)
    for g, (t, lr, wd, b1, b2, eps, coef) in steps.items():
        bc1 = 1.0 - b1**t
        bc2 = 1.0 - b2**t
        hp[g] = torch.tensor([1.0, 1.0 - lr * wd, lr / bc1, math.sqrt(bc2), b1, b2, eps, coef], dtype=torch.float64)
    return hp.to(dtype=torch.float32).to(device, non_blocking=True)


def segmented_adamw_(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    seg: Segments,
    hp: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """One AdamW step, in place, on every range of the groups whose ``hp`` row says step.

    torch.optim.AdamW's update (decoupled weight decay, ``lerp`` first moment, bias
    corrections folded into the step size and the denominator), in float32 (float64 for
    float64 buffers) whatever the parameter dtype; the gradient is first multiplied by the
    group's coefficient (clipping). Elements of other groups are not touched.
    """
    for name, t in (("params", params), ("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_flat(name, t, seg)
    if hp.shape != (seg.num_groups, len(HP_COLUMNS)):
        raise ValueError(f"hp: expected shape {(seg.num_groups, len(HP_COLUMNS))}, got {tuple(hp.shape)}")
    if _backend(params, backend) == "triton" and params.dtype != torch.float64:
        from .triton_ops import _launch, kernels_module

        if seg.num_tiles:
            k = kernels_module("_triton_segment_kernels.py")
            _launch(k.adamw_tiles_kernel, (seg.num_tiles,), params, grads, exp_avg, exp_avg_sq,
                    seg.tile_start, seg.tile_len, seg.tile_group, hp.to(torch.float32).contiguous(),
                    HP=len(HP_COLUMNS), BLOCK=min(BLOCK, TILE), TILE=TILE)
        return
    segmented_adamw_ref_(params, grads, exp_avg, exp_avg_sq, seg, hp)


def segmented_adamw_ref_(params, grads, exp_avg, exp_avg_sq, seg: Segments, hp: torch.Tensor) -> None:
    acc = torch.float64 if params.dtype == torch.float64 else torch.float32
    table = torch.cat([hp.to(acc), torch.zeros(1, hp.shape[1], dtype=acc, device=hp.device)])
    owner = seg.owner()

    def col(name: str) -> torch.Tensor:  # one per-element column at a time: numel values, not numel x 8
        return table[:, HP_COLUMNS.index(name)][owner]

    go = col("step") != 0
    p = params.to(acc)
    g = grads.to(acc) * col("grad_coef")
    m = exp_avg.to(acc)
    v = exp_avg_sq.to(acc)
    m_new = m + (1.0 - col("beta1")) * (g - m)
    b2 = col("beta2")
    v_new = v * b2 + (1.0 - b2) * g * g
    denom = v_new.sqrt() / col("bc2_sqrt").masked_fill(~go, 1.0) + col("eps")
    p_new = p * col("decay") - col("step_size") * m_new / denom
    params.copy_(torch.where(go, p_new, p).to(params.dtype))
    exp_avg.copy_(torch.where(go, m_new, m).to(exp_avg.dtype))
    exp_avg_sq.copy_(torch.where(go, v_new, v).to(exp_avg_sq.dtype))
