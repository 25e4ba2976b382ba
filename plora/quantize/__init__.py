"""A frozen base held 4-bit: QLoRA's NF4 (``model.quantize: nf4``).

The quantization itself is torchao's (`torchao.dtypes.nf4tensor`, what torchtune's QLoRA
builders use); plora adds none of its own. This package says which weights are quantized
(`plora.quantize.nf4`), what they cost in memory (`plora.quantize.cost`) and what an
exported adapter says of its base (`plora.quantize.export`).
"""

from plora.quantize.cost import NF4_BLOCK, NF4_SCALER_BLOCK, QUANTIZE_CHOICES, nf4_bytes_per_weight

__all__ = ["NF4_BLOCK", "NF4_SCALER_BLOCK", "QUANTIZE_CHOICES", "nf4_bytes_per_weight"]
