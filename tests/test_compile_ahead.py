"""Compiling a step's kernels ahead: the dry run foresees exactly what the step launches,
runs nothing, and each variant is compiled once, on threads, failures left to the launch.

On CPU the kernels run in Triton's interpreter, which compiles nothing: these tests check
the collection and the bookkeeping; the GPU benchmark (`scripts/bench_first_sweep.py`)
counts what the first step still compiles."""

from __future__ import annotations

import threading

import pytest
import torch

from plora.kernels import build_lora_meta
from plora.kernels import compile_ahead as ca

triton_ops = pytest.importorskip("plora.kernels.triton_ops")
pytest.importorskip("triton")

SHAPES = {(48, 40), (40, 24)}
TOKENS, RANKS = [5, 0, 37, 130], [8, 16, 64, 8]


def _meta():
    return build_lora_meta(TOKENS, RANKS, [2.0, 1.0, 0.5, 1.5], "cpu", merge_tokens=0)


def _recorder(seen: list):
    """A `_launch` that notes each variant it launches, then launches it (interpreted)."""
    launch = triton_ops._launch

    def record(kernel, grid, *args, **kwargs):
        seen.append(ca._variant((kernel, grid, args, kwargs)))
        launch(kernel, grid, *args, **kwargs)

    return record


@pytest.mark.parametrize("accumulate_dx", [True, False])
def test_dry_run_collects_exactly_what_the_ops_launch(monkeypatch, accumulate_dx):
    monkeypatch.setenv("PLORA_KERNELS", "triton")
    meta = _meta()
    seen: list[tuple] = []
    g = torch.Generator().manual_seed(0)
    with monkeypatch.context() as m:
        m.setattr(triton_ops, "_launch", _recorder(seen))
        for d_in, d_out in sorted(SHAPES):
            n, r = meta.num_tokens, meta.total_rank
            x, y = torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)
            a, b = torch.randn(r, d_in, generator=g), torch.randn(r, d_out, generator=g)
            s = triton_ops.lora_forward(x, a, b, meta, y)
            triton_ops.lora_backward(y, x, s, a, b, meta, torch.zeros_like(x) if accumulate_dx else None)
    real = set(seen)
    assert real
    calls = ca.launches_of(_meta(), SHAPES, torch.float32, torch.device("cpu"), backward=True,
                           accumulate_dx=accumulate_dx)
    assert {ca._variant(c) for c in calls} == real  # the scratch views specialize as fresh tensors do
    forward = ca.launches_of(_meta(), SHAPES, torch.float32, torch.device("cpu"), backward=False)
    assert {ca._variant(c) for c in forward} < real


def test_collecting_runs_nothing_and_keeps_side_streams_off():
    meta = _meta()
    y = torch.full((meta.num_tokens, 24), 7.0)
    x, a, b = torch.ones(meta.num_tokens, 40), torch.ones(meta.total_rank, 40), torch.ones(meta.total_rank, 24)
    with triton_ops.collecting() as calls:
        assert not triton_ops._streams_on(torch.device("cuda"))
        triton_ops.lora_forward(x, a, b, meta, y)
    assert calls and torch.all(y == 7.0)
    assert triton_ops._streams_on(torch.device("cuda"))


class _Kernel:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.threads: list[str] = []
        self.loaded = 0

    def warmup(self, *args, grid, **kwargs):
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("does not compile")
        return self

    def _init_handles(self):  # a compiled kernel's load onto the GPU
        self.loaded += 1


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(ca, "_SEEN", set())
    monkeypatch.setattr(ca, "COMPILED", ca.CompileStats())
    monkeypatch.setattr(triton_ops, "_interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_each_variant_compiles_once_on_threads_and_failures_are_left_to_the_launch(monkeypatch, fresh):
    good, bad = _Kernel(), _Kernel(fail=True)
    calls = [(good, (1,), (torch.empty(4), 32), {"BT": 16}), (good, (2,), (torch.empty(4), 64), {"BT": 16}),
             (good, (1,), (torch.empty(4), 17), {"BT": 16}), (good, (1,), (torch.empty(4), 32), {"BT": 32}),
             (bad, (1,), (torch.empty(4), 32), {"BT": 16})]
    monkeypatch.setattr(ca, "launches_of", lambda *a, **k: list(calls))
    meta = _meta()
    assert ca.compile_ahead(meta, SHAPES, torch.bfloat16, "cuda", backward=True, threads=4) == 3
    # 32 and 64 specialize alike (multiples of 16): one variant
    assert len(good.threads) == 3 and all(t.startswith("plora-compile") for t in good.threads)
    assert good.loaded == 3  # each loaded where it compiled, not at its first launch
    assert ca.COMPILED.to_dict() == {**ca.COMPILED.to_dict(), "kernels": 3, "failed": 1}
    assert ca.compile_ahead(meta, SHAPES, torch.bfloat16, "cuda", backward=True, threads=4) == 0
    assert len(good.threads) == 3 and len(bad.threads) == 1


def test_a_failed_dry_run_or_the_torch_backend_compiles_nothing_and_stops_nothing(monkeypatch, fresh):
    kernel = _Kernel()
    monkeypatch.setattr(ca, "launches_of", lambda *a, **k: [(kernel, (1,), (3,), {})])
    monkeypatch.setenv("PLORA_KERNELS", "torch")  # on CUDA: the torch reference runs, no kernel compiles
    assert ca.compile_ahead(_meta(), SHAPES, torch.bfloat16, "cuda", backward=True, threads=2) == 0
    monkeypatch.delenv("PLORA_KERNELS")

    def broken(*args, **kwargs):
        raise RuntimeError("the dry run broke")

    monkeypatch.setattr(ca, "launches_of", broken)
    assert ca.compile_ahead(_meta(), SHAPES, torch.bfloat16, "cuda", backward=True, threads=2) == 0
    assert ca.COMPILED.failed == 1 and not kernel.threads


def test_nothing_is_compiled_on_cpu_when_off_or_without_tokens(monkeypatch, fresh):
    kernel = _Kernel()
    monkeypatch.setattr(ca, "launches_of", lambda *a, **k: [(kernel, (1,), (3,), {})])
    assert ca.compile_ahead(_meta(), SHAPES, torch.float32, "cpu", backward=True) == 0
    assert ca.compile_ahead(None, SHAPES, torch.float32, "cuda", backward=True) == 0
    empty = build_lora_meta([0, 0], [8, 8], [1.0, 1.0], "cpu")
    assert ca.compile_ahead(empty, SHAPES, torch.float32, "cuda", backward=True) == 0
    monkeypatch.setenv("PLORA_COMPILE_THREADS", "0")
    assert ca.compile_threads() == 0
    assert ca.compile_ahead(_meta(), SHAPES, torch.float32, "cuda", backward=True) == 0
    assert not kernel.threads
    monkeypatch.setenv("PLORA_COMPILE_THREADS", "3")
    assert ca.compile_threads() == 3
    monkeypatch.delenv("PLORA_COMPILE_THREADS")
    assert 1 <= ca.compile_threads() <= ca.MAX_THREADS


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.q_proj = torch.nn.Linear(16, 16, bias=False)
        self.attn.v_proj = torch.nn.Linear(16, 8, bias=False)


def _packed_model():
    from plora.train.packed.inject import inject_packed_lora
    from plora.train.packed.layer import AdapterSpec

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_Block(), _Block()])
    return inject_packed_lora(model, [AdapterSpec("a", 4, 8.0, 1), AdapterSpec("b", 8, 8.0, 2)], ["q_proj", "v_proj"])


def test_a_packed_model_looks_at_each_composition_once(monkeypatch):
    import plora.train.packed.inject as inject

    asked = []
    monkeypatch.setattr(inject, "compiles_here", lambda device: True)  # as on a GPU
    monkeypatch.setattr(inject, "compile_ahead", lambda meta, shapes, dtype, device, **k: asked.append(
        (sorted(shapes), k["backward"], k["accumulate_dx"])) or 1)
    pm = _packed_model()
    assert pm.compile_kernels_ahead(training=True) == 0  # no batch set
    pm.state.set_batch([0, 1], [3, 5], "cpu")
    assert pm.compile_kernels_ahead(training=True) == 1
    assert pm.compile_kernels_ahead(training=True) == 0
    assert pm.compile_kernels_ahead(training=False) == 1
    pm.state.set_batch([0, 1], [4, 5], "cpu")
    assert pm.compile_kernels_ahead(training=True) == 1
    assert asked[0] == ([(16, 8), (16, 16)], True, True) and asked[1][1] is False


def test_the_optimizers_launches_are_collected_and_change_nothing(monkeypatch):
    from plora.train.adapter_pack import AdapterPack

    monkeypatch.setenv("PLORA_KERNELS", "triton")
    pm = _packed_model()

    class _Adapter:
        learning_rate, weight_decay = 1e-3, 0.01

    pack = AdapterPack(pm, [_Adapter(), _Adapter()])
    pack.bank.grads.normal_()
    before = pack.bank.weights.clone()
    seen: list[tuple] = []
    with monkeypatch.context() as m:
        m.setattr(triton_ops, "_launch", _recorder(seen))
        go = torch.ones(2, dtype=torch.bool)
        pack.sq_norms()
        pack.step_where(pack.planned([0, 1]), go, torch.ones(2))
    real = set(seen)
    after_step = [t.clone() for t in (pack.bank.weights, pack.optimizer.exp_avg)]
    assert not torch.equal(after_step[0], before)  # the real step moved the weights
    with triton_ops.collecting() as calls:
        pack.optimizer_launches()
    assert {ca._variant(c) for c in calls} == real and len({id(c[0]) for c in calls}) == 2  # norms, AdamW
    assert torch.equal(pack.bank.weights, after_step[0]) and torch.equal(pack.optimizer.exp_avg, after_step[1])
