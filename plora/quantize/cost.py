"""What a base held in NF4 costs: bytes per weight, which weights, the dequantize workspace.

No torch here: the cost model imports it. The layout is torchao's `NF4Tensor`
(``torchao/dtypes/nf4tensor.py``, 0.13-0.15) with torchtune's defaults, block 64 and scaler
block 256 (`plora.quantize.nf4` keeps them wherever a weight allows):

- ``quantized_data``: two 4-bit codes a byte, 0.5 byte a weight;
- ``quantized_scalers``: one int8 absmax per block of 64 weights (double quantization),
  1/64 byte a weight;
- ``quantization_factor``: one scale per 256 blocks, in the model's dtype, ``dtype/16384``;
- ``scaler_mean`` and the 16-entry code table: a few bytes per tensor (not counted).

So 0.5157 byte a weight in bfloat16 (0.5158 in float32), against 2 (4) dense.

Every linear of every decoder block is quantized (q, k, v, o, gate, up, down: targeted by
LoRA or not, as torchtune's QLoRA builders do); embeddings, norms and the LM head stay in
the model's dtype. A quantized product dequantizes its weight for that product only, in
eager torch: torchao's ``get_original_weight`` holds two int64 code tensors (8 bytes a
weight together), the looked-up and scaled halves and the stacked result (3 x dtype) at
once, so the largest linear of a block costs ``(8 + 3 dtype)`` bytes a weight of transient
workspace, and each dequantize moves about `DEQUANT_BYTES_PER_WEIGHT` bytes a weight.
"""

from __future__ import annotations

from typing import Any

#: what ``model.quantize`` accepts (None: the base stays in ``model.dtype``)
QUANTIZE_CHOICES = ("nf4",)
#: torchao's NF4 block (weights sharing one absmax) and scaler block (absmaxes sharing one scale)
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
#: bytes one eager dequantize of a weight reads and writes, about (codes, int64 indices,
#: looked-up and scaled halves, the stacked output)
DEQUANT_BYTES_PER_WEIGHT = 28.0
#: the block linears that are quantized (Hugging Face names; `ModelShape.linear_dims`)
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_quantize(value: Any) -> str | None:
    """``model.quantize`` as stored: None (off) or one of `QUANTIZE_CHOICES`."""
    if value is None or value is False or (isinstance(value, str) and value.lower() == "none"):
        return None
    if isinstance(value, str) and value.lower() in QUANTIZE_CHOICES:
        return value.lower()
    choices = ", ".join(repr(c) for c in QUANTIZE_CHOICES)
    raise ValueError(f"expected {choices} or none (the base in model.dtype), got {value!r}")


def nf4_bytes_per_weight(dtype_bytes: int = 2) -> float:
    """Bytes a weight takes in NF4: codes, double-quantized block scales, their scales."""
    return 0.5 + 1.0 / NF4_BLOCK + dtype_bytes / (NF4_BLOCK * NF4_SCALER_BLOCK)


def quantized_params(shape) -> int:
    """Weights of a `plora.models.shape.ModelShape` that NF4 holds: every block linear."""
    dims = shape.linear_dims()
    return shape.n_layers * sum(i * o for i, o in (dims[n] for n in QUANTIZED_LINEARS))


def largest_linear(shape) -> int:
    """Weights of a block's largest linear (its dequantize workspace is the base's transient)."""
    return max(i * o for i, o in shape.linear_dims().values())


def base_weight_bytes(shape, quantize: str | None = None) -> float:
    """Bytes of a base model's weights (one copy, unsharded): dense, or with its block linears
    in NF4 (``quantize``; default the shape's own ``quantize``)."""
    q = quantize if quantize is not None else getattr(shape, "quantize", None)
    dt = shape.dtype_bytes
    dense = float(shape.n_params) * dt
    if not q:
        return dense
    n = quantized_params(shape)
    return dense - n * dt + n * nf4_bytes_per_weight(dt)


def dequant_workspace_bytes(shape, quantize: str | None = None) -> float:
    """Transient bytes of one dequantized product (0 for a dense base)."""
    q = quantize if quantize is not None else getattr(shape, "quantize", None)
    if not q:
        return 0.0
    return (8.0 + 3.0 * shape.dtype_bytes) * largest_linear(shape)


def dequant_step_bytes(shape, passes: int, quantize: str | None = None) -> float:
    """Bytes a packed step moves dequantizing the base (``passes``: forward, input-gradient
    backward, and a recomputed forward under activation checkpointing)."""
    q = quantize if quantize is not None else getattr(shape, "quantize", None)
    if not q:
        return 0.0
    return passes * DEQUANT_BYTES_PER_WEIGHT * quantized_params(shape)


def check_tp(quantize: str | None, degree: int) -> None:
    """A quantized base trains on one GPU a job: tensor parallelism would slice NF4 weights
    (torchao's NF4 has no slicing) or quantize each rank's shard on its own, which is not the
    one-process model (the invariant "TP equals one process" would break). The planner never
    offers it (`plora.models.shape.ModelShape.tp_degrees`); a job asked for it is refused here."""
    if quantize and int(degree) > 1:
        raise ValueError(f"model.quantize: {quantize} runs on one GPU per job; tensor parallelism "
                         f"(tp {int(degree)}) is refused for a quantized base")
