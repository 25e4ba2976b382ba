"""Base models: a local Hugging Face-format folder, built as a torchtune decoder.

The family (`plora.models.families`) reads config.json, builds the decoder through torchtune's
builders where 0.6.1 has them (composed from its modules where not), and maps the Hugging
Face weights into it; adapter weights map back to Hugging Face names in
`plora.train.packed.peft_format`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plora.models.families.base import ModelError, check_seq_len
from plora.models.families.table import get_family
from plora.models.folders import (ASSETS, ensure_weights, read_model_info, resolve_model_path, shape_folder,
                                  write_shape_folder)
from plora.models.info import ModelInfo

__all__ = ["ASSETS", "DTYPES", "ModelError", "build_model", "build_on_meta", "load_base_model", "read_hf_weights",
           "read_model_info", "resolve_model_path", "shape_folder", "write_shape_folder"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def build_model(info: ModelInfo, max_seq_len: int) -> nn.Module:
    """An empty torchtune TransformerDecoder of the folder's architecture (its family's builder)."""
    check_seq_len(info, max_seq_len)
    return get_family(info.family).build(info, max(max_seq_len, 8))


def build_on_meta(info: ModelInfo, max_seq_len: int) -> nn.Module:
    """`build_model` on the meta device: no memory, no values (`_MetaBuild`). Some ops on
    meta tensors run through torch's Python references, whose first call imports
    ``torch._dynamo``: 5.9 s of a job process's 12 s of imports on an H100 machine, for a
    job that compiles nothing. Their calls in a model's build are its parameters'
    initialisation (values a meta tensor does not have) and its RoPE caches (a few
    kilobytes, computed on the CPU; every load computes them again on its device:
    `_rebuild_rope_caches`)."""
    with torch.device("meta"), _MetaBuild():
        return build_model(info, max_seq_len)


class _MetaBuild(torch.overrides.TorchFunctionMode):
    """Inside an enclosing ``torch.device("meta")``: ``torch.nn.init`` functions and
    in-place random fills of a meta tensor do nothing (there are no values to fill), and a
    tensor made without a device by a ``rope_init`` (or what it calls) is made on the CPU.
    The frames are looked at only for tensor constructors, a few hundred calls in a build."""

    _FRAMES = 8  # how far up from a constructor a rope_init may be (torchtune's go two deep)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init passes it by name
        if isinstance(target, torch.Tensor) and target.is_meta and _fills(func):
            return target
        if kwargs.get("device") is None and func in _constructors() and _inside_rope_init(self._FRAMES):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


#: in-place fills of a tensor's values, as module initialisers call them
_FILLS = frozenset({"normal_", "uniform_", "zero_", "fill_", "copy_", "trunc_normal_", "kaiming_uniform_",
                    "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_", "ones_", "zeros_",
                    "constant_", "eye_", "dirac_", "sparse_", "uniform", "normal", "exponential_", "bernoulli_",
                    "random_", "cauchy_", "log_normal_", "geometric_"})


def _fills(func) -> bool:
    return getattr(func, "__name__", "") in _FILLS and (getattr(func, "__module__", "") == "torch.nn.init"
                                                         or isinstance(func, _TENSOR_METHOD_TYPES))


_TENSOR_METHOD_TYPES = (type(torch.Tensor.normal_), type(torch.Tensor.__dict__.get("normal_")))


def _constructors() -> set:
    from torch.utils._device import _device_constructors

    return _device_constructors()


def _inside_rope_init(depth: int) -> bool:
    import sys

    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "rope_init":
            return True
        frame = frame.f_back
    return False


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors (the shards its index names, if it has one)."""
    from safetensors.torch import load_file

    ensure_weights(folder)  # a GGUF file's folder converted head first
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelError(f"{index}: not a safetensors index ({e})") from None
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise ModelError(f"{folder / name}: named by the index but missing")
        state.update(load_file(str(folder / name)))
    return state


def load_base_model(
    path: str | Path,
    *,
    family: str = "auto",
    max_seq_len: int = 2048,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    random_init: bool = False,
) -> tuple[nn.Module, ModelInfo]:
    """Build the torchtune model and load its Hugging Face weights, frozen.

    `random_init` skips the weights (a folder with only config.json and tokenizer.json
    will do): profiling and throughput benchmarks need the shapes, not the values.
    """
    info = read_model_info(resolve_model_path(path, dtype), family)
    if random_init:
        return _random_model(info, max_seq_len, dtype, device), info
    model = build_on_meta(info, max_seq_len)
    state = get_family(info.family).hf_to_tune(read_hf_weights(info.path), info)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        raise ModelError(f"{info.path}: weights do not match the {info.family} architecture ({what})")
    model.load_state_dict(state, assign=True)
    _rebuild_rope_caches(model, device)
    model.to(device=device, dtype=DTYPES[dtype])
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model, info


def _random_model(info: ModelInfo, max_seq_len: int, dtype: str, device) -> nn.Module:
    model = build_on_meta(info, max_seq_len)
    model.to(dtype=DTYPES[dtype])  # on meta: no full-precision copy ever lands on the device
    _materialize(model, device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name or "scale" in name else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    _rebuild_rope_caches(model, device)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model


def _materialize(model: nn.Module, device: str | torch.device) -> None:
    """`nn.Module.to_empty` without its ``empty_like`` of meta tensors, which runs through
    torch's Python references, whose first call imports sympy: 2 s of a spare's 2.6 s model
    load on an H200 machine (its bytecode compiled again in every process there). Parameters
    shared between modules stay shared."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    table[name] = empty(t)


def _rebuild_rope_caches(model: nn.Module, device: str | torch.device) -> None:
    """RoPE caches are buffers built at init; a model built on the meta device has none."""
    for module in model.modules():
        if hasattr(module, "rope_init") and callable(module.rope_init):
            with torch.device(device):
                module.rope_init()
