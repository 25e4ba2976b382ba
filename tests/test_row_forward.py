"""Attention over flattened rows straight to the flash kernel (`plora.train.packed.row_forward`):
the same function as each family's own attention, and the module's own forward wherever the
kernel does not run.

On the CPU the flash varlen kernel is stood in for by causal SDPA row by row with each
key-value head repeated for its query heads (what the kernel computes); the model whose
attentions keep their own forward runs torchtune's expand and the per-row path. Hidden
states and every gradient must agree, for each way a family lays out its attention:
torchtune's (Llama's RoPE pairs, Qwen2's halves) and plora's `HFOrderAttention` (Qwen3's
q/k norms before RoPE, Phi-3's fused qkv).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from family_models import make_model
from plora.models.loading import load_base_model
from plora.train.packed import row_forward
from plora.train.packed.head_loss import final_hidden
from plora.train.packed.row_forward import RowsForward
from plora.train.packed.varlen_attention import RowAttention, install_row_attention

pytest.importorskip("transformers")

FAMILIES = ["llama", "qwen2", "qwen3", "phi3"]
LENGTHS = [8, 5, 11, 3]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("row-forward")
    return {name: load_base_model(make_model(name, root / name), max_seq_len=64)[0] for name in FAMILIES}


def rows_reference(calls: list):
    """The flash varlen kernel's function on the CPU: ``[T, H, D]`` queries, ``[T, KV, D]``
    keys and values, each row causal, query head h on key-value head h // (H / KV)."""

    def attend(q, k, v, cu, max_len):
        calls.append((tuple(q.shape), tuple(k.shape), int(max_len)))
        rep = q.shape[1] // k.shape[1]
        bounds = cu.tolist()
        outs = []
        for a, b in zip(bounds, bounds[1:]):
            qq = q[a:b].transpose(0, 1)
            kk = k[a:b].repeat_interleave(rep, dim=1).transpose(0, 1)
            vv = v[a:b].repeat_interleave(rep, dim=1).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1))
        return torch.cat(outs)

    return lambda: attend


@pytest.fixture
def cpu_kernel(monkeypatch):
    """Flattened rows go 'straight to the kernel' on the CPU; the kernel's calls are recorded."""
    calls: list = []
    monkeypatch.setattr(row_forward, "flash_varlen", rows_reference(calls))
    monkeypatch.setattr(RowAttention, "direct",
                        lambda self, x: self.lengths is not None and self.cu_seqlens is not None
                        and self.cache is None and x.shape[0] == 1)
    return calls


def _run(model, state, lengths, seed=0):
    """Hidden states and gradients (embedding output, every attention parameter) of one
    forward and backward over flattened rows of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tokens = torch.randint(4, 60, (1, total), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    params = [p for n, p in model.named_parameters() if ".attn." in n]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
        p.grad = None
    h0 = model.tok_embeddings(tokens).detach().requires_grad_(True)
    hook = model.tok_embeddings.register_forward_hook(lambda _m, _i, _o: h0)
    try:
        with state.rows(lengths, cu_seqlens=cu, max_len=max(lengths) + 4):
            h = final_hidden(model, tokens, positions)
            h.square().sum().backward()
    finally:
        hook.remove()
    return h.detach(), h0.grad, [p.grad.clone() for p in params]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_same_function_as_the_models_own_attention(models, cpu_kernel, name):
    own = copy.deepcopy(models[name])
    lean = copy.deepcopy(models[name])
    own_state = install_row_attention(own, lean=False)
    lean_state = install_row_attention(lean, lean=True)
    layers = len(lean.layers)
    assert all(isinstance(layer.attn.__dict__.get("forward"), RowsForward) for layer in lean.layers)
    assert not any(isinstance(layer.attn.__dict__.get("forward"), RowsForward) for layer in own.layers)
    h_own, g_own, p_own = _run(own, own_state, LENGTHS)
    assert cpu_kernel == []  # the model's own attention: expand, then row by row
    h_lean, g_lean, p_lean = _run(lean, lean_state, LENGTHS)
    assert len(cpu_kernel) == layers  # one kernel call a layer, key-value heads as they are
    heads, kv_heads = lean.layers[0].attn.num_heads, lean.layers[0].attn.num_kv_heads
    assert kv_heads < heads  # the tiny families are grouped-query: the expand is what is skipped
    assert all(q[1] == heads and k[1] == kv_heads and m == max(LENGTHS) + 4 for q, k, m in cpu_kernel)
    # float32 sums in another order (a group's key gradients: the kernel's sum, not the expand's)
    for a, b in [(h_lean, h_own), (g_lean, g_own), *zip(p_lean, p_own)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_installed_once_and_off_with_the_lean_switch(models, monkeypatch):
    model = copy.deepcopy(models["qwen2"])
    state = install_row_attention(model)
    forwards = [layer.attn.__dict__["forward"] for layer in model.layers]
    assert all(isinstance(f, RowsForward) for f in forwards)
    assert install_row_attention(model) is state
    assert [layer.attn.__dict__["forward"] for layer in model.layers] == forwards  # not wrapped twice
    monkeypatch.setenv("PLORA_LEAN_STEP", "0")
    off = copy.deepcopy(models["qwen2"])
    install_row_attention(off)
    assert not any(isinstance(layer.attn.__dict__.get("forward"), RowsForward) for layer in off.layers)


def test_the_modules_own_forward_wherever_the_kernel_does_not_run(models, cpu_kernel):
    model = copy.deepcopy(models["qwen2"])
    state = install_row_attention(model, lean=True)
    tokens = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        final_hidden(model, tokens)  # padded rows: no rows set
    assert cpu_kernel == []
    model.layers[0].attn.attn_dropout = 0.1  # dropout on attention, in training: its own forward
    model.train()
    _run(model, state, LENGTHS)
    assert len(cpu_kernel) == len(model.layers) - 1


def test_never_direct_on_the_cpu(models):
    """Without the stand-in: the CPU has no flash kernel, so its rows take the per-row path."""
    model = copy.deepcopy(models["qwen2"])
    state = install_row_attention(model, lean=True)
    x = torch.zeros(1, 4, 8)
    with state.rows([2, 2], cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32)):
        assert not state.direct(x)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_on_cuda_close_to_the_models_own_attention_in_bfloat16(tmp_path, name):
    folder = make_model(name, tmp_path / name)
    base = load_base_model(folder, max_seq_len=64, dtype="bfloat16")[0].cuda()
    own, lean = copy.deepcopy(base), copy.deepcopy(base)
    own_state, lean_state = install_row_attention(own, lean=False), install_row_attention(lean, lean=True)

    def run(model, state):
        lengths = [17, 9, 30, 8]
        tokens = torch.randint(4, 60, (1, sum(lengths)), generator=torch.Generator().manual_seed(0)).cuda()
        positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32).cuda()
        for p in model.parameters():
            p.requires_grad_(False)
        h0 = model.tok_embeddings(tokens).detach().requires_grad_(True)
        hook = model.tok_embeddings.register_forward_hook(lambda _m, _i, _o: h0)
        try:
            with state.rows(lengths, cu_seqlens=cu, max_len=64):
                assert state.direct(h0)
                h = final_hidden(model, tokens, positions)
                h.float().square().sum().backward()
        finally:
            hook.remove()
        return h.float(), h0.grad.float()

    h_own, g_own = run(own, own_state)
    h_lean, g_lean = run(lean, lean_state)
    torch.testing.assert_close(h_lean, h_own, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g_lean, g_own, rtol=5e-2, atol=5e-2)
