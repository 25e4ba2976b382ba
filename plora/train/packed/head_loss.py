"""The LM head and the loss, only where labels are, in chunks.

The decoder runs to its final norm (`final_hidden`); the hidden states of the positions
that carry a label are gathered per adapter (`plora.train.packed.rows.LabelParts`), and
``model.output`` (the LM head, with tied embeddings or soft-capping inside it) and the
cross-entropy run on them chunk by chunk. No ``[tokens × vocab]`` tensor of a whole pack
is built, and positions without a label (prompts, padding) cost nothing in the head.

In training each chunk's gradient with respect to its hidden states is computed in its
forward (`_HeadCrossEntropy`, as Liger Kernel's fused linear cross-entropy does): its
logits are freed at once, and backward only scales the stored gradient. Where the packed
LoRA kernels run on Triton (a GPU), a chunk's loss and its logits' gradient come from one
kernel that reads the logits twice and writes the gradient once
(`plora.kernels.cross_entropy`), not from torch's float32 cast, log-softmax and NLL and
their backward: on an H200 that was the largest memory-bound part of a 0.5B step. Liger's
own kernel reads its count of labels back to the host, which a CUDA graph cannot capture.

Chunks never straddle adapters, and an adapter's chunks depend only on its own labels, so
its loss is computed by the same operations, of the same shapes, whatever its pack-mates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from plora.cost.model import EVAL_HEAD_BYTES
from plora.data.dataset import IGNORE_INDEX
from plora.train.packed.rope import shared_tables
from plora.train.packed.rows import LabelParts

#: the float32 logits of one chunk (and their gradient) stay under this many bytes (the cost
#: model prices an eval's head by the same bound, without importing torch)
HEAD_CHUNK_BYTES = EVAL_HEAD_BYTES
#: and a chunk has at most this many positions
MAX_CHUNK = 8192


def chunk_rows(vocab_size: int, budget_bytes: int = HEAD_CHUNK_BYTES, bytes_per_logit: int = 8) -> int:
    """Positions per head chunk for this vocabulary, each logit held in ``bytes_per_logit``
    (torch's path: float32 logits and their gradient)."""
    return max(1, min(MAX_CHUNK, budget_bytes // (bytes_per_logit * max(1, vocab_size))))


def head_chunk_rows(vocab_size: int, model: nn.Module, device: torch.device | str) -> int:
    """Positions per head chunk of ``model``'s loss on ``device``. torch's path holds float32
    logits and their gradient, 8 bytes a logit; the fused loss (`fused_loss_on_device`) the
    logits and their gradient in the model's dtype, 4 in bf16, so its chunks are twice as
    long under the same bound: fewer, larger products. On an H200, 12,000 labels of Qwen2.5's
    151,936 columns took 14.5 ms in chunks of 440 rows against 16.2 ms in chunks of 220;
    Gemma's 256,000: 54.6 against 71.0 ms (`scripts/bench_loss.py --chunks`)."""
    per_logit = 2 * head_dtype(model).itemsize if fused_loss_on_device(device) else 8
    return chunk_rows(vocab_size, bytes_per_logit=per_logit)


class _Capture:
    """Stands in for ``model.output`` during `final_hidden`: keeps its input, returns an
    empty tensor (torchtune casts the output to float32, which then costs nothing)."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.hidden = h
        return h.new_empty(0)


class _CaptureModule(nn.Module):
    """`_Capture` where ``model.output`` is a registered module (a tied head, torchtune's
    `TiedLinear`, is a plain attribute, and each kind can only be swapped for its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.capture = _Capture()

    @property
    def hidden(self) -> torch.Tensor | None:
        return self.capture.hidden

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.capture(h)


def final_hidden(model: nn.Module, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's final-norm output ``[b, s, d]`` (what ``model.output`` would read): the
    forward with ``model.output`` swapped out while it runs. ``input_pos``: each token's
    position in its own row (flattened rows)."""
    output = model.output
    capture = _CaptureModule() if isinstance(output, nn.Module) else _Capture()
    max_seq_len = getattr(model, "max_seq_len", None)
    model.output = capture
    try:
        with shared_tables():  # every layer's RoPE tables made once (`plora.train.packed.rope`)
            if input_pos is not None:
                # A flattened batch is longer than the model's context; its rows are not, and
                # their positions (which index the RoPE tables) restart at 0.
                if max_seq_len is not None and tokens.shape[1] > max_seq_len:
                    model.max_seq_len = int(tokens.shape[1])
                model(tokens, input_pos=input_pos)
            else:
                model(tokens)
    finally:
        model.output = output
        if max_seq_len is not None:
            model.max_seq_len = max_seq_len
    if capture.hidden is None:
        raise RuntimeError("the model's forward did not call model.output")
    return capture.hidden


def head_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's logits: its embedding's (the head's, tied or not)."""
    embed = getattr(model, "tok_embeddings", None)
    weight = getattr(embed, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else next(model.parameters()).dtype


def fused_loss_on_device(device: torch.device | str) -> bool:
    """`fused_loss` for tensors on ``device``."""
    return fused_loss(torch.empty(0, device=device))


def fused_loss(t: torch.Tensor) -> bool:
    """Whether a chunk's loss on ``t``'s device runs as one kernel (`plora.kernels.cross_entropy`):
    where the packed LoRA kernels run on Triton (`plora.kernels.backend_for`), unless
    ``PLORA_FUSED_LOSS=0``."""
    from plora.kernels import backend_for
    from plora.settings import fused_loss_on

    return fused_loss_on() and backend_for(t) == "triton"


class _GradientSeed(torch.autograd.Function):
    """A scalar whose gradient with respect to ``logits`` is ``dlogits``: the fused loss's
    gradient fed back through the head as a scalar's backward. (``torch.autograd.grad`` given
    a gradient tensor checks its shape through ``torch.fx``'s symbolic shapes, which imports
    sympy: 0.44 s in a warm job's first step on an H200, and seconds where its bytecode is not
    yet compiled.) Its own gradient is only ever 1: it is the root of that backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, dlogits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(dlogits)
        return logits.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (dlogits,) = ctx.saved_tensors
        return dlogits, None


class _HeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``head(h)`` against ``targets``; the gradient with respect
    to ``h`` is computed in forward and only scaled in backward."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, targets: torch.Tensor, head: Callable) -> torch.Tensor:  # type: ignore[override]
        with torch.enable_grad():
            leaf = h.detach().requires_grad_(True)
            logits = head(leaf)
            if fused_loss(logits):
                from plora.kernels.cross_entropy import cross_entropy_rows

                rows, dlogits = cross_entropy_rows(logits.detach(), targets, IGNORE_INDEX, grad=True)
                loss = rows.sum()
                (grad,) = torch.autograd.grad(_GradientSeed.apply(logits, dlogits), leaf)
            else:
                loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
                (grad,) = torch.autograd.grad(loss, leaf)
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return grad * g.to(grad.dtype), None, None


def head_loss_sum(head: Callable, h: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Σ cross-entropy over rows of ``h`` [n, d], ``chunk`` rows of logits at a time."""
    total = None
    for c0 in range(0, h.shape[0], chunk):
        hc, tc = h[c0 : c0 + chunk], targets[c0 : c0 + chunk]
        if torch.is_grad_enabled() and hc.requires_grad:
            part = _HeadCrossEntropy.apply(hc, tc, head)
        else:
            logits = head(hc)
            if fused_loss(logits):
                from plora.kernels.cross_entropy import cross_entropy_rows

                part = cross_entropy_rows(logits, tc, IGNORE_INDEX, grad=False)[0].sum()
            else:
                part = F.cross_entropy(logits.float(), tc, ignore_index=IGNORE_INDEX, reduction="sum")
        total = part if total is None else total + part
    if total is None:
        return h.new_zeros((), dtype=torch.float32)
    return total


def adapter_loss_sums(
    head: Callable, hidden: torch.Tensor, labels: LabelParts, chunk: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each adapter's summed loss and label count (device tensors). ``hidden``: [T, d], the
    flattened final-norm states; ``labels`` on the same device."""
    sums, counts, start = [], [], 0
    for size in labels.sizes:
        idx = labels.index[start : start + size]
        tgt = labels.targets[start : start + size]
        sums.append(head_loss_sum(head, hidden.index_select(0, idx), tgt, chunk))
        counts.append((tgt != IGNORE_INDEX).sum())
        start += size
    return sums, counts


def adapter_mean_losses(head: Callable, hidden: torch.Tensor, labels: LabelParts, chunk: int) -> list[torch.Tensor]:
    """Each adapter's mean loss over its own label tokens (their sum is the packed loss)."""
    sums, counts = adapter_loss_sums(head, hidden, labels, chunk)
    return [s / c.clamp(min=1) for s, c in zip(sums, counts)]


def labels_to(labels: LabelParts, device: torch.device) -> LabelParts:
    return LabelParts(labels.index.to(device), labels.targets.to(device), list(labels.sizes), list(labels.counts))


def last_position_logits(head: Callable, hidden: torch.Tensor, positions: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Logits at the given flat positions only (greedy decoding reads each row's last)."""
    idx = torch.as_tensor(positions, dtype=torch.long, device=hidden.device)
    return head(hidden.index_select(0, idx)).float()
