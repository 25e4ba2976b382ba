"""Per-adapter L2 norms of gradients or weights, for clipping and divergence checks.

One `_foreach_norm` over every tensor of every adapter and one segment sum: a handful of
kernel launches per step whatever the number of adapters and layers, and one host sync.
Inf/NaN anywhere in a group makes its norm non-finite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def group_norms(
    groups: Sequence[Sequence[nn.Parameter]],
    of_weights: bool = False,
    *,
    share: Callable[[nn.Parameter], float] | None = None,
    reduce: Callable[[torch.Tensor], None] | None = None,
) -> list[float]:
    """Each group's norm. `share(p)` scales a tensor's squared norm (tensor-parallel copies
    held by several ranks count once); `reduce` sums the squared norms across ranks in place."""
    if not groups:
        return []
    tensors, owner, weight = [], [], []
    for g, params in enumerate(groups):
        for p in params:
            t = p.detach() if of_weights else p.grad
            if t is not None:
                tensors.append(t)
                owner.append(g)
                weight.append(share(p) if share else 1.0)
    device = next((p.device for params in groups for p in params), torch.device("cpu"))
    acc = torch.float64 if tensors and tensors[0].dtype == torch.float64 else torch.float32
    sums = torch.zeros(len(groups), device=device, dtype=acc)
    if tensors:
        squares = torch.stack(torch._foreach_norm(tensors)).to(acc).pow(2)
        if share is not None:
            squares = squares * torch.tensor(weight, device=device, dtype=acc)
        sums.index_add_(0, torch.tensor(owner, device=device), squares)
    if reduce is not None:
        reduce(sums)
    return sums.sqrt().tolist()
