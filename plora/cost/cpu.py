"""What a packed job costs on CPU cores before anything is measured: the CPU prior.

On a machine without a GPU every job is one single-threaded process on a core of its own
(`plora.engine.local`). The GPU prior (`CostModel.analytic`) priced such jobs from FLOPs at
a guessed rate: 163 s for a SmolLM2-135M job that takes 45, 29.5 s for a demo job that takes
22. It charged every row ``max_seq_len`` tokens (CPU steps run their rows' real tokens,
flattened), a recomputed forward (CPU jobs keep their activations), the LM head on every
token (it runs where labels are) and nothing for the small-model costs that are not FLOPs,
nor for the packed evals, which decode without a KV cache and on CPU take as long as a few
steps of the pack.

Here a step of one core costs, per token of an adapter's rows, the frozen base's FLOPs
(forward and input gradient) at a per-core rate plus a per-layer cost for every hidden
unit (norms, activations, attention calls, dtype conversions: what dominates a small
model); per rank and token, the LoRA products at their own (low: skinny matmuls) rate; per
adapter, its pass through each adapted linear; per step, a fixed part and one per layer. A
job adds its process start (interpreter, torch and torchtune imports), the model load and,
for each adapter leaving, its packed eval (a forward of each eval row, then one forward per
generated token over the prompt so far) and its save. The sweep prices the rows and the
eval on its own data (`plora.cost.sweep_model.priced_for_sweep`).

The rates are per dtype, fitted on one core of a 2-core AMD EPYC (Zen 4) machine, in CPU
seconds (a shared machine's wall clock measures its neighbours): the shipped tiny Llama
(hidden 128, 2 layers), a random Llama of hidden 384 and 8 layers, and SmolLM2-135M
(hidden 576, 30 layers, all linear layers adapted). A measured profile or the sweep's own
finished jobs (`plora.cost.sweep_model.recalibrated`) replace them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from plora.cost.model import CostModel, TimeCoeffs

from plora.models.families.targets import resolve_lora_targets

from plora.models.shape import ModelShape
from plora.cost.job import JobOverheads

__all__ = ["CPU_RATES", "CpuRates", "cpu_cost_model"]


@dataclass(frozen=True)
class CpuRates:
    """One core's speed at one dtype (seconds, FLOP/s)."""

    base_flops: float  # the frozen base's matmuls
    per_layer_unit_s: float  # per token, layer and hidden unit: everything that is not a matmul
    lora_flops: float  # the LoRA shrink/expand products and their gradients


#: by dtype size in bytes (bfloat16 and float16: 2; float32: 4). Per token, training:
#: 46 µs (tiny, float32), 0.89 ms (hidden 384, float32), 6.3 ms (SmolLM2, float32);
#: 0.76 ms (hidden 384, bfloat16), 4.74 ms (SmolLM2, bfloat16). Per rank and token, LoRA:
#: 0.127 ms (SmolLM2, all linear layers, bfloat16), 4.3 µs (hidden 384, attention, float32).
CPU_RATES = {
    4: CpuRates(base_flops=108e9, per_layer_unit_s=137e-9, lora_flops=28e9),
    2: CpuRates(base_flops=315e9, per_layer_unit_s=196e-9, lora_flops=14.4e9),
}
#: a step's fixed part, and its part per layer (seconds)
STEP_S = 2e-3
STEP_PER_LAYER_S = 0.8e-3
#: each adapter's pass through one adapted linear, forward and backward (seconds)
ADAPTER_PER_LINEAR_S = 0.19e-3
#: an eval forward over a token, against a training step over it (measured: SmolLM2 1.6 ms
#: against 4.74 ms)
EVAL_SHARE = 1 / 3
#: a job process's start: the interpreter, torch's and torchtune's imports (4.4 s of CPU)
START_S = 4.5
#: the model's weights read and the pack set up: seconds per byte of weights, and fixed
LOAD_S_PER_BYTE = 1e-9
SETUP_S = 0.3
#: from the summary written to the process gone (writer drained, interpreter exit)
TAIL_S = 1.0
#: one adapter's PEFT files and metrics written
SAVE_S = 0.05
#: the fraction of a row's tokens that are labels, where the LM head runs (answers are short)
LABEL_SHARE = 0.1


def base_flops_per_token(shape: ModelShape, row_tokens: float) -> float:
    """FLOPs of the frozen base per training token: every block's linears forward and their
    input gradient (4 per weight), causal attention over a row of ``row_tokens``, and the LM
    head on the label tokens only."""
    linears = sum(i * o for i, o in shape.linear_dims().values())
    q_dim = shape.n_heads * shape.head_dim
    attention = 3.5 * 2 * (row_tokens / 2) * q_dim * shape.n_layers
    head = LABEL_SHARE * 4 * shape.vocab * shape.hidden
    return 4 * shape.n_layers * linears + attention + head


def cpu_cost_model(shape: ModelShape, seq_len: int, targets: str | Iterable[str] | None,
                   memory_bytes: float, **memory: float) -> CostModel:
    """The CPU prior of a model: one TP degree (one core a job), the step time and job terms
    described in the module docstring, memory from `CostModel.analytic` (``memory``: its
    keyword arguments, e.g. ``overhead_bytes``) within ``memory_bytes``."""
    rates = CPU_RATES.get(shape.dtype_bytes, CPU_RATES[4])
    names = resolve_lora_targets(targets)
    row_tokens = seq_len / 2  # attention's share only; the sweep prices its rows' real tokens
    per_token = (base_flops_per_token(shape, row_tokens) / rates.base_flops
                 + shape.n_layers * shape.hidden * rates.per_layer_unit_s)
    step = TimeCoeffs(
        c0=STEP_S + STEP_PER_LAYER_S * shape.n_layers,
        c_tok=per_token,
        c_rtok=6 * shape.lora_params_per_rank(names) / rates.lora_flops,
        c_ad=ADAPTER_PER_LINEAR_S * shape.n_layers * len(names),
    )
    cm = CostModel.analytic(shape, seq_len, memory_bytes, names, tp_degrees=[1], **memory)
    cm = replace(cm, time={1: step}, host_time={}).with_meta(source="cpu prior")
    weights = shape.n_params * shape.dtype_bytes
    eval_token = EVAL_SHARE * per_token
    return cm.with_overheads(JobOverheads(
        start_s=START_S, load_s=LOAD_S_PER_BYTE * weights, setup_s=SETUP_S, tail_s=TAIL_S,
        eval_tok_s=eval_token, eval_gen_tok_s=eval_token, eval_gen_fwd_s=EVAL_SHARE * step.c0, save_s=SAVE_S,
    ))
