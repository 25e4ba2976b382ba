"""The packed LoRA linear layer: one frozen base linear, K adapters of their own ranks.

Every packed layer of a model shares one `PackState`: which adapters are in the current
batch, in row order, and the segment metadata the kernels need. The trainer builds it once
per step (`PackState.set_batch`); the layers only read it.

A layer keeps its adapters stacked: one A (R × in) and one Bᵀ (R × out) with R = Σ r_k,
adapter k owning rows ``row_starts[k]:row_starts[k+1]`` of both, exactly the layout the
kernels take. Nothing is concatenated per step, and the autograd graph has two leaves
per layer whatever the number of adapters. An adapter that is not in the batch (finished,
diverged, pruned) gets an empty token segment: no kernel reads its rows, its gradient
rows stay zero, and the optimizer does not step it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from plora.kernels import LoRAMeta, build_lora_meta, packed_lora_linear
from plora.spec.adapter import lora_scale
from plora.train.packed.dropout import adapter_key, hash_dropout, key32, token_keys


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter as the layers see it: its shape, its scale's terms and its dropout."""

    name: str
    rank: int
    alpha: float
    seed: int
    dropout: float = 0.0  # on its rows' LoRA input, in training (`plora.train.packed.dropout`)
    rslora: bool = False  # scale alpha/sqrt(rank) (PEFT's use_rslora)

    @property
    def scale(self) -> float:
        return lora_scale(self.alpha, self.rank, self.rslora)


@dataclass
class PackState:
    """Per-step state shared by every packed layer of one model."""

    adapters: list[AdapterSpec]
    active: list[int] = field(default_factory=list)
    meta: LoRAMeta | None = None
    #: dropout of this step (`set_dropout`): each adapter's step count on the device, and
    #: the width rows are padded to (None: flattened)
    dropout_steps: torch.Tensor | None = None
    dropout_width: int | None = None
    _dropout_table: dict = field(default_factory=dict, repr=False)  # device -> (probs, keys)
    _tokens: tuple | None = field(default=None, repr=False)  # this step's token keys, made on first use

    @property
    def has_dropout(self) -> bool:
        """Whether some adapter of the pack has dropout: then every training step draws masks."""
        return any(s.dropout > 0 for s in self.adapters)

    def set_adapter(self, k: int, spec: AdapterSpec) -> None:
        """Slot ``k`` holds ``spec`` now (same rank); its dropout numbers on the device are
        written in place (a captured step reads them at their address)."""
        self.adapters[k] = spec
        for probs, keys in self._dropout_table.values():
            probs[k] = float(spec.dropout)
            keys[k] = adapter_key(spec.seed)

    def set_dropout(self, steps: torch.Tensor | None, width: int | None) -> None:
        """This step's adapter step counts ([K] on the device; None: 0) and padded width."""
        self.dropout_steps, self.dropout_width, self._tokens = steps, width, None

    def lora_input(self, x: torch.Tensor, layer: int, col_offset: int = 0) -> torch.Tensor | None:
        """A training step's LoRA input of one layer (``x``: T × features, from column
        ``col_offset`` of the layer's input): each adapter's rows dropped at its own rate
        (`plora.train.packed.dropout`); None where no adapter of the pack has dropout."""
        if not self.has_dropout or self.meta is None:
            return None
        if self._tokens is None or self._tokens[0] != x.shape[0] or self._tokens[1].device != x.device:
            probs, keys = self._table(x.device)
            steps = self.dropout_steps if self.dropout_steps is not None else torch.zeros_like(keys)
            h, p = token_keys(self.meta.token_starts, self.meta.num_tokens, x.shape[0], keys, steps, probs,
                              self.dropout_width)
            self._tokens = (x.shape[0], h, p)
        _, h, p = self._tokens
        return hash_dropout(x, h, p, layer, col_offset)

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._dropout_table:
            probs = torch.tensor([s.dropout for s in self.adapters], dtype=torch.float32, device=device)
            keys = torch.tensor([adapter_key(s.seed) for s in self.adapters], dtype=torch.int64, device=device)
            self._dropout_table[key] = (probs, keys)
        return self._dropout_table[key]

    def forget_layout(self) -> None:
        """The adapters were laid out again: tables made for the old ones go."""
        self._dropout_table.clear()
        self._tokens = None

    @property
    def row_starts(self) -> list[int]:
        """Where each adapter's rows start in a layer's stacked A and Bᵀ (K + 1 entries)."""
        out = [0]
        for s in self.adapters:
            out.append(out[-1] + s.rank)
        return out

    def set_batch(
        self,
        active: Sequence[int],
        tokens_per_adapter: Sequence[int],
        device: torch.device | str,
    ) -> None:
        """Adapters `active` (ascending) own consecutive token segments of the flattened
        batch, in order; every other adapter gets an empty segment."""
        if len(active) != len(tokens_per_adapter):
            raise ValueError("one token count per active adapter")
        active = [int(k) for k in active]
        if any(b <= a for a, b in zip(active, active[1:])):
            raise ValueError(f"active adapters must be distinct and ascending, got {active}")
        if active and not (0 <= active[0] and active[-1] < len(self.adapters)):
            raise ValueError(f"active adapters {active} out of range for {len(self.adapters)} adapters")
        self.active = active
        self._tokens = None
        if not self.active:
            self.meta = None
            return
        tokens = [0] * len(self.adapters)
        for k, n in zip(active, tokens_per_adapter):
            tokens[k] = int(n)
        self.meta = build_lora_meta(
            tokens,
            [s.rank for s in self.adapters],
            [s.scale for s in self.adapters],
            device,
        )

    def clear(self) -> None:
        self.active, self.meta = [], None
        self.set_dropout(None, None)

    def use(self, active: Sequence[int], meta: LoRAMeta | None) -> None:
        """Set a batch whose metadata was built before (a replayed step reads the same)."""
        self.active, self.meta = list(active), meta
        self._tokens = None


class PackedLoRALinear(nn.Module):
    """`y = x Wᵀ + b + concat_k(s_k (x_k A_kᵀ) B_kᵀ)` over the active adapters' segments.

    ``a_all`` (R × in) stacks every A_k, ``bt_all`` (R × out) every B_kᵀ; ``lora_a[k]`` and
    ``lora_bt[k]`` are adapter k's rows (views).
    """

    def __init__(self, base: nn.Linear, state: PackState, module_name: str, a_all: torch.Tensor | None = None):
        super().__init__()
        self.base = base
        self.state = state
        self.module_name = module_name
        self.dropout_key = key32(module_name)  # this layer's part of its dropout masks
        self.in_features = base.in_features
        self.out_features = base.out_features
        device, dtype = base.weight.device, base.weight.dtype
        # ``a_all``: `initial_a` made ahead (`plora.train.packed.inject` makes every layer's at once)
        a = initial_a(state.adapters, module_name, self.in_features, device, dtype) if a_all is None else a_all
        self.a_all = nn.Parameter(a)
        self.bt_all = nn.Parameter(torch.zeros(a.shape[0], self.out_features, device=device, dtype=dtype))
        self._rows = state.row_starts

    def _init_a(self, spec: AdapterSpec) -> torch.Tensor:
        """``spec``'s initial A for this layer's device (float32), drawn as a pack that began
        with it draws it."""
        return adapter_a(spec, self.module_name, self.in_features, self.a_all.device)

    @property
    def lora_a(self) -> tuple[torch.Tensor, ...]:
        """Each adapter's A_k (r_k × in local features): views of ``a_all``."""
        return tuple(self.a_all[r0:r1] for r0, r1 in zip(self._rows, self._rows[1:]))

    @property
    def lora_bt(self) -> tuple[torch.Tensor, ...]:
        """Each adapter's B_kᵀ (r_k × out local features): views of ``bt_all``."""
        return tuple(self.bt_all[r0:r1] for r0, r1 in zip(self._rows, self._rows[1:]))

    #: set by `plora.train.packed.tp` when the layer is sharded over tensor-parallel ranks: the
    #: sharded forward (local shards, collectives) replaces this one. None on one process.
    tp = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return self.tp.forward(self, x)
        state = self.state
        if not state.active:
            return self.base(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        lora_x = state.lora_input(x2, self.dropout_key) if self.training else None
        y = packed_lora_linear(x2, self.base.weight, self.base.bias, self.a_all, self.bt_all, state.meta, lora_x=lora_x)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        ranks = ",".join(str(s.rank) for s in self.state.adapters)
        return f"in={self.in_features}, out={self.out_features}, ranks=[{ranks}]"


def adapter_a(spec: AdapterSpec, module_name: str, in_features: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Adapter ``spec``'s initial A in layer ``module_name`` (float32) for ``device``: drawn
    on it where it is a GPU, else on the CPU (and left there). Seeded by
    (adapter seed, layer name) only, so an adapter starts from the same weights whatever else
    is in its pack; nn.Linear/PEFT's kaiming-uniform bound.

    On a GPU it is drawn there, by a generator of that GPU seeded the same way: a 16-adapter
    pack of a 0.5B model draws 118 M numbers, 0.45-0.85 s of a job's set-up on CPU threads
    on an H200 machine, milliseconds on the GPU. The GPU's numbers are not the CPU's (and
    torch's GPU draw follows the GPU's count of multiprocessors), so an adapter starts the
    same in any pack on one kind of GPU; a checkpoint keeps its A wherever it resumes."""
    device = torch.device(device)
    seed = _stable_seed(spec.seed, module_name)
    bound = 1.0 / math.sqrt(in_features)
    if device.type == "cuda":
        gen = torch.Generator(device=device).manual_seed(seed)
        return torch.empty(spec.rank, in_features, device=device, dtype=torch.float32).uniform_(
            -bound, bound, generator=gen)
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(spec.rank, in_features, generator=gen, dtype=torch.float32) * 2 - 1) * bound


def initial_a(adapters: Sequence[AdapterSpec], module_name: str, in_features: int, device: torch.device | str,
              dtype: torch.dtype) -> torch.Tensor:
    """A layer's stacked A (every adapter's `adapter_a`, in order) on ``device`` in ``dtype``."""
    if not adapters:
        return torch.zeros(0, in_features, device=device, dtype=dtype)
    a = torch.cat([adapter_a(spec, module_name, in_features, device) for spec in adapters])
    return a.to(device=device, dtype=dtype)


def _stable_seed(seed: int, name: str) -> int:
    """A per-(adapter, layer) seed that does not depend on Python's hash randomization."""
    h = 1469598103934665603
    for byte in f"{seed}:{name}".encode():
        h = ((h ^ byte) * 1099511628211) % (1 << 63)
    return h
