"""The packed LoRA linear layer: one frozen base linear, K adapters of their own ranks.

Every packed layer of a model shares one `PackState`: which adapters are in the current
batch, in row order, and the segment metadata the kernels need. The trainer builds it once
per step (`PackState.set_batch`); the layers only read it. An adapter that is not in the
batch (finished, diverged, pruned) takes no part in the step: its weights are not even
concatenated, so it gets no gradient and the optimizer leaves it alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from plora.kernels import LoRAMeta, build_lora_meta, packed_lora_linear


@dataclass(frozen=True)
class AdapterSpec:
    """The shape of one adapter as the layers see it."""

    name: str
    rank: int
    alpha: float
    seed: int

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class PackState:
    """Per-step state shared by every packed layer of one model."""

    adapters: list[AdapterSpec]
    active: list[int] = field(default_factory=list)
    meta: LoRAMeta | None = None

    def set_batch(
        self,
        active: Sequence[int],
        tokens_per_adapter: Sequence[int],
        device: torch.device | str,
    ) -> None:
        """Adapters `active` own consecutive token segments of the flattened batch, in order."""
        if len(active) != len(tokens_per_adapter):
            raise ValueError("one token count per active adapter")
        self.active = list(active)
        if not self.active:
            self.meta = None
            return
        specs = [self.adapters[i] for i in self.active]
        self.meta = build_lora_meta(
            list(tokens_per_adapter),
            [s.rank for s in specs],
            [s.scale for s in specs],
            device,
        )

    def clear(self) -> None:
        self.active, self.meta = [], None


class PackedLoRALinear(nn.Module):
    """`y = x Wᵀ + b + concat_k(s_k (x_k A_kᵀ) B_kᵀ)` over the active adapters' segments.

    A_k is stored as (r_k, in) and B_k transposed as (r_k, out), so that the active adapters'
    weights concatenate along dim 0 into the stacked layout the kernels take.
    """

    def __init__(self, base: nn.Linear, state: PackState, dropout: float, module_name: str):
        super().__init__()
        self.base = base
        self.state = state
        self.module_name = module_name
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.lora_a = nn.ParameterList()
        self.lora_bt = nn.ParameterList()
        device, dtype = base.weight.device, base.weight.dtype
        for spec in state.adapters:
            a, bt = self._init_adapter(spec, device, dtype)
            self.lora_a.append(a)
            self.lora_bt.append(bt)

    def _init_adapter(self, spec: AdapterSpec, device, dtype) -> tuple[nn.Parameter, nn.Parameter]:
        # Seeded by (adapter seed, layer name) only, so an adapter starts from the same
        # weights whatever else is in its pack. A: nn.Linear/PEFT's kaiming-uniform bound.
        gen = torch.Generator().manual_seed(_stable_seed(spec.seed, self.module_name))
        bound = 1.0 / math.sqrt(self.in_features)
        a = (torch.rand(spec.rank, self.in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        bt = torch.zeros(spec.rank, self.out_features)
        return (
            nn.Parameter(a.to(device=device, dtype=dtype)),
            nn.Parameter(bt.to(device=device, dtype=dtype)),
        )

    #: set by `plora.packed.tp` when the layer is sharded over tensor-parallel ranks: the
    #: sharded forward (local shards, collectives) replaces this one. None on one process.
    tp = None

    def adapter_parameters(self, k: int) -> list[nn.Parameter]:
        return [self.lora_a[k], self.lora_bt[k]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return self.tp.forward(self, x)
        state = self.state
        if not state.active:
            return self.base(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        a = torch.cat([self.lora_a[k] for k in state.active]) if len(state.active) > 1 else self.lora_a[state.active[0]]
        bt = torch.cat([self.lora_bt[k] for k in state.active]) if len(state.active) > 1 else self.lora_bt[state.active[0]]
        lora_x = self.dropout(x2) if self.dropout is not None and self.training else None
        y = packed_lora_linear(x2, self.base.weight, self.base.bias, a, bt, state.meta, lora_x=lora_x)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        ranks = ",".join(str(s.rank) for s in self.state.adapters)
        return f"in={self.in_features}, out={self.out_features}, ranks=[{ranks}]"


def _stable_seed(seed: int, name: str) -> int:
    """A per-(adapter, layer) seed that does not depend on Python's hash randomization."""
    h = 1469598103934665603
    for byte in f"{seed}:{name}".encode():
        h = ((h ^ byte) * 1099511628211) % (1 << 63)
    return h
