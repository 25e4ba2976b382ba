"""Put packed LoRA layers into a torchtune TransformerDecoder.

Users name target modules the Hugging Face way (`q_proj`, `gate_proj`…); torchtune names
them differently inside its decoder layers. This module is the one place that knows both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from torch import nn

from plora.kernels.compile_ahead import compile_ahead, compile_threads, compiles_here
from plora.train.packed.layer import AdapterSpec, PackedLoRALinear, PackState, initial_a

#: Hugging Face module name -> (torchtune sub-module, attribute)
HF_TO_TUNE: dict[str, tuple[str, str]] = {
    "q_proj": ("attn", "q_proj"),
    "k_proj": ("attn", "k_proj"),
    "v_proj": ("attn", "v_proj"),
    "o_proj": ("attn", "output_proj"),
    "gate_proj": ("mlp", "w1"),
    "down_proj": ("mlp", "w2"),
    "up_proj": ("mlp", "w3"),
    # Phi-3's fused projections
    "qkv_proj": ("attn", "qkv_proj"),
    "gate_up_proj": ("mlp", "gate_up_proj"),
}


class PackedModel:
    """A base model with packed LoRA layers in it, and the handles a trainer needs."""

    def __init__(self, model: nn.Module, state: PackState, layers: dict[str, PackedLoRALinear]):
        self.model = model
        self.state = state
        self.layers = layers  # tune-style dotted name ("layers.0.attn.q_proj") -> layer
        self._compiled: set[tuple] = set()  # batches whose kernels were compiled ahead

    def compile_kernels_ahead(self, training: bool, also: Callable[[], None] | None = None) -> int:
        """Compile, all at once, the Triton kernels the batch just set (`PackState.set_batch`)
        will launch in its forward (and, ``training``, backward), and those ``also()``
        launches (the optimizer's), before its first layer runs
        (`plora.kernels.compile_ahead`); how many were compiled. Each composition is looked
        at once; layers sharded over tensor-parallel ranks are left to their launches."""
        meta = self.state.meta
        if meta is None or not self.layers:
            return 0
        layers = list(self.layers.values())
        first = layers[0].a_all
        if not compiles_here(first.device) or compile_threads() <= 0 or any(layer.tp is not None for layer in layers):
            return 0  # nothing to compile here: not even the composition is remembered
        key = (training, tuple(meta.tokens_host), tuple(meta.ranks_host))
        if key in self._compiled:
            return 0
        if len(self._compiled) > 4096:
            self._compiled.clear()
        self._compiled.add(key)
        return compile_ahead(meta, {(layer.in_features, layer.out_features) for layer in layers}, first.dtype,
                             first.device, backward=training, accumulate_dx=not self.state.has_dropout, also=also)

    @property
    def adapters(self) -> list[AdapterSpec]:
        return self.state.adapters

    def adapter_state_dict(self, k: int) -> dict[str, "object"]:
        """Adapter k in torchtune's LoRA naming: `<module>.lora_a.weight` (r, in), `.lora_b.weight` (out, r)."""
        out = {}
        for name, layer in self.layers.items():
            out[f"{name}.lora_a.weight"] = layer.lora_a[k].detach()
            out[f"{name}.lora_b.weight"] = layer.lora_bt[k].detach().t()
        return out


def inject_packed_lora(
    model: nn.Module,
    adapters: Sequence[AdapterSpec],
    targets: Sequence[str],
    dropout: float | None = None,
) -> PackedModel:
    """Replace every targeted linear of every decoder layer by a packed LoRA layer. Each
    adapter's dropout is its spec's; ``dropout``, where given, is every adapter's."""
    if dropout is not None:
        adapters = [replace(a, dropout=float(dropout)) for a in adapters]
    unknown = [t for t in targets if t not in HF_TO_TUNE]
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; known: {list(HF_TO_TUNE)}")
    state = PackState(adapters=list(adapters))
    found: list[tuple[nn.Module, str, str, nn.Linear]] = []
    for i, block in enumerate(model.layers):
        for target in targets:
            sub_name, attr = HF_TO_TUNE[target]
            parent = getattr(block, sub_name)
            base = getattr(parent, attr, None)
            if base is None:
                raise ValueError(f"LoRA target {target!r}: this model has no such layer (layers.{i}.{sub_name}.{attr})")
            if not isinstance(base, nn.Linear):
                raise TypeError(f"layers.{i}.{sub_name}.{attr} is {type(base).__name__}, not nn.Linear")
            found.append((parent, attr, f"layers.{i}.{sub_name}.{attr}", base))
    initial = _initial_as(state.adapters, [(name, base) for _, _, name, base in found])
    layers: dict[str, PackedLoRALinear] = {}
    for (parent, attr, name, base), a_all in zip(found, initial):
        packed = PackedLoRALinear(base, state, name, a_all=a_all)
        setattr(parent, attr, packed)
        layers[name] = packed
    return PackedModel(model, state, layers)


def _initial_as(adapters: Sequence[AdapterSpec], layers: list[tuple[str, nn.Linear]]) -> list[torch.Tensor]:
    """Every layer's stacked initial A (`plora.train.packed.layer.initial_a`). On a GPU each
    draw is a launch there; on the CPU they are drawn on a few threads at once: each A is its
    own seeded CPU draw, and a 16-adapter pack of a 0.5B model draws 118 M numbers (1.8-2.2 s
    of a job's set-up on one thread on an H100 machine). Each layer's draw is the same
    whatever thread makes it."""
    def one(layer: tuple[str, nn.Linear]) -> torch.Tensor:
        name, base = layer
        return initial_a(adapters, name, base.in_features, base.weight.device, base.weight.dtype)

    on_gpu = any(base.weight.device.type == "cuda" for _, base in layers)
    threads = 1 if on_gpu else max(1, min(_A_THREADS, torch.get_num_threads(), len(layers)))
    if threads == 1 or not adapters:
        return [one(layer) for layer in layers]
    with ThreadPoolExecutor(threads, thread_name_prefix="plora-lora-init") as pool:
        return list(pool.map(one, layers))


#: threads that draw a pack's initial A at once (each op also uses torch's own threads)
_A_THREADS = 8
