"""The LM head's fused cross-entropy (`plora.kernels.cross_entropy`): against torch's, on the
interpreter (float32 and float16 logits, a vocabulary walked in several blocks, ignored
rows), inside the head's chunked loss, and what its compile-ahead dry run launches. The
`gpu` test runs it compiled in bf16 (`scripts/bench_loss.py` times it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plora.data.dataset import IGNORE_INDEX
from plora.kernels import triton_ops
from plora.kernels.compile_ahead import _variant
from plora.kernels.cross_entropy import cross_entropy_rows, cross_entropy_rows_ref, loss_launches

pytest.importorskip("triton")


@pytest.fixture
def triton_interpreted(monkeypatch):
    """The Triton backend on CPU tensors: its kernels in Triton's interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PLORA_KERNELS", "triton")


def _case(dtype: torch.dtype, rows: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[1] = IGNORE_INDEX
    targets[-1] = vocab - 1  # the last column: in the last, partial block
    return logits, targets


def _torch_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor):
    x = logits.float().requires_grad_(True)
    loss = F.cross_entropy(x, targets, ignore_index=IGNORE_INDEX, reduction="none")
    loss.sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab,block", [(7, None), (100, 16), (1000, 128), (1000, None)])
def test_the_kernel_gives_torchs_loss_and_gradient(triton_interpreted, dtype, vocab, block):
    logits, targets = _case(dtype, 9, vocab)
    loss, grad = cross_entropy_rows(logits, targets, IGNORE_INDEX, grad=True, block=block)
    want_loss, want_grad = _torch_loss_and_grad(logits, targets)
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    # the gradient is rounded to the logits' dtype, as torch's cast back rounds it
    torch.testing.assert_close(grad, want_grad.to(dtype), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-3)
    assert loss[1] == 0 and torch.count_nonzero(grad[1]) == 0  # an ignored row: no loss, no gradient
    alone, none = cross_entropy_rows(logits, targets, IGNORE_INDEX, grad=False, block=block)
    assert none is None and torch.equal(alone, loss)


def test_the_reference_is_torchs_cross_entropy():
    logits, targets = _case(torch.float32, 6, 50, seed=3)
    loss, grad = cross_entropy_rows_ref(logits, targets, IGNORE_INDEX, grad=True)
    want_loss, want_grad = _torch_loss_and_grad(logits, targets)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)


def test_every_row_ignored_and_no_rows(triton_interpreted):
    logits = torch.randn(3, 40)
    loss, grad = cross_entropy_rows(logits, torch.full((3,), IGNORE_INDEX), IGNORE_INDEX, grad=True, block=16)
    assert torch.count_nonzero(loss) == 0 and torch.count_nonzero(grad) == 0
    loss, grad = cross_entropy_rows(logits[:0], torch.zeros(0, dtype=torch.long), IGNORE_INDEX, grad=True)
    assert loss.shape == (0,) and grad.shape == (0, 40)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="logits"):
        cross_entropy_rows(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long), IGNORE_INDEX, grad=False)
    with pytest.raises(ValueError, match="targets"):
        cross_entropy_rows(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), IGNORE_INDEX, grad=False)


def test_the_torch_backend_runs_the_reference(monkeypatch):
    """On CPU without the interpreter the op is the reference: nothing is launched."""
    monkeypatch.setenv("PLORA_KERNELS", "torch")
    logits, targets = _case(torch.float32, 4, 30)
    with triton_ops.collecting() as calls:
        loss, _ = cross_entropy_rows(logits, targets, IGNORE_INDEX, grad=True)
    assert calls == [] and torch.allclose(loss, _torch_loss_and_grad(logits, targets)[0])


def test_the_heads_chunked_loss_and_gradient_are_the_same_on_the_kernel(triton_interpreted, monkeypatch):
    """`head_loss_sum` over chunks that do not divide the rows, with a linear head: the fused
    path's loss and gradient with respect to the hidden states are torch's path's."""
    from plora.kernels import cross_entropy
    from plora.train.packed.head_loss import head_loss_sum

    kernel_calls = []

    def counted(*args, **kwargs):
        kernel_calls.append(kwargs["grad"])
        return cross_entropy_rows(*args, **kwargs)

    monkeypatch.setattr(cross_entropy, "cross_entropy_rows", counted)
    gen = torch.Generator().manual_seed(7)
    hidden, vocab = 12, 300
    weight = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    h = torch.randn(11, hidden, generator=gen)
    targets = torch.randint(0, vocab, (11,), generator=gen)
    targets[4] = IGNORE_INDEX

    def run():
        leaf = h.clone().requires_grad_(True)
        loss = head_loss_sum(lambda x: F.linear(x, weight), leaf, targets, chunk=4)
        loss.backward()
        with torch.no_grad():
            scored = head_loss_sum(lambda x: F.linear(x, weight), h, targets, chunk=4)
        return loss.detach(), leaf.grad, scored

    fused = run()
    assert kernel_calls == [True] * 3 + [False] * 3  # three chunks, trained then scored
    monkeypatch.setenv("PLORA_KERNELS", "torch")
    plain = run()
    assert len(kernel_calls) == 6
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_dry_run_covers_every_variant_a_step_and_an_eval_launch(triton_interpreted):
    """`loss_launches` (what `compile_ahead` compiles for the loss) launches, for a dtype and
    vocabulary, every variant a real chunk launches: with and without the gradient, its
    targets on a 16-byte boundary or not (a slice of its adapter's targets)."""
    vocab = 96
    with triton_ops.collecting() as ahead:
        loss_launches(torch.float16, "cpu", vocab, IGNORE_INDEX)
    planned = {_variant(c) for c in ahead}
    assert len(ahead) == 4 and len(planned) == 4
    targets = torch.randint(0, vocab, (40,))
    with triton_ops.collecting() as real:
        for start, n, grad in ((0, 8, True), (3, 5, True), (8, 7, False), (1, 9, False)):
            logits = torch.randn(n, vocab).to(torch.float16)
            cross_entropy_rows(logits, targets[start : start + n], IGNORE_INDEX, grad=grad)
    assert {_variant(c) for c in real} <= planned


def test_nothing_is_launched_ahead_with_the_fused_loss_off(triton_interpreted, monkeypatch):
    monkeypatch.setenv("PLORA_FUSED_LOSS", "0")
    with triton_ops.collecting() as ahead:
        loss_launches(torch.float16, "cpu", 64)
    assert ahead == []


@pytest.mark.gpu
def test_the_compiled_kernel_on_a_large_vocabulary_in_bf16_and_in_a_cuda_graph(monkeypatch):
    """Compiled, bf16, Qwen2.5's vocabulary (five blocks a row): torch's loss and gradient
    (rounded to bf16), eagerly and replayed from a CUDA graph, as a packed step runs it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("PLORA_KERNELS", "auto")
    gen = torch.Generator().manual_seed(11)
    vocab = 151936
    logits = (torch.randn(64, vocab, generator=gen) * 3).to(torch.bfloat16).cuda()
    targets = torch.randint(0, vocab, (65,), generator=gen).cuda()[1:]  # off a 16-byte boundary, as a slice
    targets[5] = IGNORE_INDEX
    want_loss, want_grad = _torch_loss_and_grad(logits, targets)
    loss, grad = cross_entropy_rows(logits, targets, IGNORE_INDEX, grad=True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad.float(), want_grad.to(torch.bfloat16).float(), rtol=0, atol=2e-3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cross_entropy_rows(logits, targets, IGNORE_INDEX, grad=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = cross_entropy_rows(logits, targets, IGNORE_INDEX, grad=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed[0], loss) and torch.equal(replayed[1], grad)


def test_the_fused_heads_backward_imports_no_symbolic_shapes():
    """Feeding the kernel's gradient back through the head must not import ``torch.fx``'s
    symbolic shapes (and sympy): ``torch.autograd.grad`` given a gradient tensor does, 0.44 s
    inside a warm job's first step on an H200. A fresh process, as a job's."""
    import subprocess
    import sys

    code = (
        "import sys, torch, torch.nn.functional as F\n"
        "from plora.train.packed.head_loss import head_loss_sum\n"
        "w = torch.randn(50, 8); h = torch.randn(6, 8, requires_grad=True); t = torch.randint(0, 50, (6,))\n"
        "head_loss_sum(lambda x: F.linear(x, w), h, t, chunk=4).backward()\n"
        "assert h.grad is not None and h.grad.abs().sum() > 0\n"
        "print(sorted(m for m in ('sympy', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules))\n"
    )
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1", "PLORA_KERNELS": "triton"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_fused_losss_chunks_hold_its_logits_and_gradient_in_the_models_dtype(monkeypatch):
    """torch's path holds float32 logits and their gradient (8 bytes a logit); the fused one
    bf16 logits and a bf16 gradient (4), so its chunks are twice as long under the same bound."""
    from plora.train.packed.head_loss import HEAD_CHUNK_BYTES, chunk_rows, head_chunk_rows

    model = torch.nn.Module()
    model.tok_embeddings = torch.nn.Embedding(4, 2).to(torch.bfloat16)
    vocab = 151936
    monkeypatch.setenv("PLORA_KERNELS", "torch")
    assert head_chunk_rows(vocab, model, "cpu") == chunk_rows(vocab) == HEAD_CHUNK_BYTES // (8 * vocab)
    monkeypatch.setenv("PLORA_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert head_chunk_rows(vocab, model, "cpu") == HEAD_CHUNK_BYTES // (4 * vocab)
    monkeypatch.setenv("PLORA_FUSED_LOSS", "0")
    assert head_chunk_rows(vocab, model, "cpu") == chunk_rows(vocab)
