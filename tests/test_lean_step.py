"""A job's model in fewer kernels, computing the same function (``PLORA_LEAN_STEP``).

`plora.train.packed.rope`: the same RoPE as the model's own modules, bit for bit, in fewer ops.

Every family's RoPE module (torchtune's interleaved pairs in float32 for Llama and Mistral,
with Llama 3's scaled tables; Hugging Face's rotate-half for Qwen2, Qwen3 and Gemma2; plora's
partial LongRoPE for Phi-3) against `PackedRope` over it: outputs and input gradients equal
(`torch.equal`), in float32 and bfloat16, for a flattened batch whose positions restart at
each row, a padded batch and no positions at all. Then a whole model, with and without the
swap: the same hidden states and the same gradients, and fewer ATen ops per forward and
backward (a step's fixed cost is its count of kernels).

`plora.train.packed.norms`: torchtune's RMSNorms given a float32 scale, so that CUDA runs torch's
fused kernel; on the CPU (no fused kernel) the numbers are the same bit for bit. Both are
applied as a job's model loads (`plora.train.packed.lean_step`, from `plora.train.preload`).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from family_models import make_model
from plora.models.loading import load_base_model
from conftest import job_config
from plora.settings import Settings
from plora.train.packed.lean_step import make_lean
from plora.train.packed.norms import GemmaFusedRMSNorm, fused_rms_norms
from plora.train.packed_lora import PackedLoRARecipe
from plora.train.packed.head_loss import final_hidden
from plora.train.packed.rope import PAIRS, HALVES, PackedRope, install_packed_rope, rope_layout, shared_tables

pytest.importorskip("transformers")

LAYOUT = {"llama": PAIRS, "llama-tied-llama3": PAIRS, "mistral": PAIRS, "qwen2": HALVES, "qwen3": HALVES,
          "gemma2": HALVES, "phi3": HALVES, "phi3-longrope-partial": HALVES}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("rope-families")
    return {name: make_model(name, root / name) for name in LAYOUT}


@pytest.fixture(scope="module")
def models(folders) -> dict[str, torch.nn.Module]:
    return {name: load_base_model(folder, max_seq_len=64)[0] for name, folder in folders.items()}


@pytest.fixture(scope="module")
def bf16_models(folders) -> dict[str, torch.nn.Module]:
    """Loaded in bfloat16, as a GPU job loads them: their RoPE caches are bfloat16 too."""
    return {name: load_base_model(folder, max_seq_len=64, dtype="bfloat16")[0] for name, folder in folders.items()}


def _rope(model: torch.nn.Module) -> torch.nn.Module:
    return next(m.pos_embeddings for m in model.modules() if getattr(m, "pos_embeddings", None) is not None)


def _packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _both_ways(rope, packed, x, input_pos, seed, transposed: bool = False):
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.dtype)
    if transposed:  # the gradient as attention sends it back: [b, h, s, d] memory, seen as [b, s, h, d]
        g = g.transpose(1, 2).contiguous().transpose(1, 2)
    outs = []
    for module in (rope, packed):
        xx = x.detach().clone().requires_grad_(True)
        y = module(xx, input_pos=input_pos)
        y.backward(g)
        outs.append((y.detach(), xx.grad))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(LAYOUT))
def test_same_numbers_as_the_models_own_rope(models, name, dtype):
    rope = _rope(models[name])
    assert rope_layout(rope) == LAYOUT[name]
    packed = PackedRope(rope, LAYOUT[name])
    head_dim = models[name].layers[0].attn.head_dim
    gen = torch.Generator().manual_seed(1)
    cases = [
        (torch.randn(1, 23, 4, head_dim, generator=gen), _packed_positions([9, 5, 9])),  # flattened rows
        (torch.randn(2, 11, 2, head_dim, generator=gen), torch.arange(11).repeat(2, 1)),  # padded rows
        (torch.randn(2, 11, 4, head_dim, generator=gen) * 30, None),  # no positions, larger values
        (torch.randn(3, 1, 4, head_dim, generator=gen), torch.tensor([[4], [0], [17]])),  # a decode step
    ]
    for i, (x, pos) in enumerate(cases):
        (y0, g0), (y1, g1) = _both_ways(rope, packed, x.to(dtype), pos, seed=i)
        assert y1.dtype == y0.dtype and g1.dtype == g0.dtype == dtype
        assert torch.equal(y0, y1), f"{name} {dtype} case {i}: outputs differ by {(y0 - y1).abs().max()}"
        assert torch.equal(g0, g1), f"{name} {dtype} case {i}: gradients differ by {(g0 - g1).abs().max()}"
        with shared_tables():  # tables made once and shared: the same numbers
            (_, _), (y2, g2) = _both_ways(rope, packed, x.to(dtype), pos, seed=i)
        assert torch.equal(y0, y2) and torch.equal(g0, g2)
        with torch.no_grad():  # an eval's forward: no autograd node, the same numbers
            assert torch.equal(packed(x.to(dtype), input_pos=pos), y0)


@pytest.mark.parametrize("name", list(LAYOUT))
def test_same_numbers_from_bfloat16_caches_and_transposed_gradients(bf16_models, name):
    rope = _rope(bf16_models[name])
    assert rope_layout(rope) == LAYOUT[name]
    packed = PackedRope(rope, LAYOUT[name])
    head_dim = bf16_models[name].layers[0].attn.head_dim
    x = torch.randn(1, 23, 4, head_dim, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    for transposed in (False, True):
        (y0, g0), (y1, g1) = _both_ways(rope, packed, x, _packed_positions([9, 5, 9]), seed=2, transposed=transposed)
        assert torch.equal(y0, y1) and torch.equal(g0, g1)
        assert g1.is_contiguous()  # written contiguous: the heads' view before RoPE copies nothing


def test_checkpointed_layers_same_numbers(bf16_models):
    """Recomputed in backward (activation checkpointing), outside the forward's shared tables."""
    from torch.utils.checkpoint import checkpoint

    base = copy.deepcopy(bf16_models["qwen2"])
    lean = copy.deepcopy(base)
    make_lean(lean)
    tokens = torch.randint(4, 60, (1, 17), generator=torch.Generator().manual_seed(4))
    positions = _packed_positions([9, 8])
    results = []
    for model in (base, lean):
        for layer in model.layers:
            layer.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(layer.forward)
        results.append(_forward_backward(model, tokens, positions)[:2])
    (h0, g0), (h1, g1) = results
    assert torch.equal(h0, h1) and torch.equal(g0, g1)


def test_gemma_norm_weight_follows_its_scale(bf16_models):
    lean = copy.deepcopy(bf16_models["gemma2"])
    make_lean(lean)
    norm = lean.norm
    assert isinstance(norm, GemmaFusedRMSNorm) and norm.weight().dtype == torch.float32
    assert torch.equal(norm.weight(), 1.0 + norm.scale.float())
    with torch.no_grad():
        norm.scale.add_(0.5)  # a scale loaded again: the weight is made again
    assert torch.equal(norm.weight(), 1.0 + norm.scale.float())


def test_partial_rotary_passes_the_rest_through(models):
    rope = _rope(models["phi3-longrope-partial"])
    head_dim = models["phi3-longrope-partial"].layers[0].attn.head_dim
    assert rope.rotary_dim < head_dim
    x = torch.randn(1, 7, 2, head_dim)
    y = PackedRope(rope, HALVES)(x, input_pos=_packed_positions([4, 3]))
    assert torch.equal(y[..., rope.rotary_dim:], x[..., rope.rotary_dim:])


class _Ops(TorchDispatchMode):
    """ATen ops that compute something (views and allocations left out): about a GPU's kernels."""

    NOT_KERNELS = {"view", "_unsafe_view", "t", "transpose", "reshape", "expand", "unsqueeze", "squeeze", "permute",
                   "slice", "select", "alias", "detach", "split", "split_with_sizes", "as_strided", "unbind",
                   "_reshape_alias", "empty", "empty_strided", "new_empty", "unflatten", "flatten", "promote_types"}

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.NOT_KERNELS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def _forward_backward(model, tokens, positions):
    """The final hidden states, the gradient reaching the embeddings' output, and the ops counted."""
    for p in model.parameters():
        p.requires_grad_(False)
    h0 = model.tok_embeddings(tokens).detach().requires_grad_(True)
    ops = _Ops()
    hook = model.tok_embeddings.register_forward_hook(lambda _m, _i, _o: h0)
    try:
        with ops:
            h = final_hidden(model, tokens, positions)
            h.float().square().sum().backward()
    finally:
        hook.remove()
    return h.detach(), h0.grad, sum(ops.count.values())


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3-longrope-partial", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_model_same_numbers_fewer_ops(models, name, dtype):
    base = copy.deepcopy(models[name]).to(dtype)
    swapped = copy.deepcopy(base)
    layers = len(base.layers)
    assert install_packed_rope(swapped) == layers
    assert install_packed_rope(swapped) == 0  # already swapped: nothing more
    assert len({id(m.pos_embeddings) for m in swapped.modules() if isinstance(getattr(m, "pos_embeddings", None), PackedRope)}) == 1
    tokens = torch.randint(4, 60, (1, 21), generator=torch.Generator().manual_seed(3))
    positions = _packed_positions([8, 6, 7])
    h0, g0, n0 = _forward_backward(base, tokens, positions)
    h1, g1, n1 = _forward_backward(swapped, tokens, positions)
    assert torch.equal(h0, h1) and torch.equal(g0, g1)
    # per layer, q and k: the tables made once, one node each way
    assert n1 < n0 - 6 * layers, (n0, n1)


def test_tables_made_once_per_forward(models, monkeypatch):
    model = copy.deepcopy(models["qwen2"])
    install_packed_rope(model)
    made = []
    real = PackedRope._make_tables
    monkeypatch.setattr(PackedRope, "_make_tables", lambda self, *a: made.append(1) or real(self, *a))
    tokens = torch.randint(4, 60, (1, 12))
    with torch.no_grad():
        final_hidden(model, tokens, _packed_positions([5, 7]))
    assert len(made) == 1  # two layers, q and k: one set of tables
    with torch.no_grad():
        model(tokens)  # outside a packed forward: each call makes its own
    assert len(made) == 1 + 2 * len(model.layers)


def test_an_unknown_rope_is_left_alone():
    class Other(torch.nn.Module):
        def forward(self, x, *, input_pos=None):
            return x

    holder = torch.nn.Module()
    holder.pos_embeddings = Other()
    assert rope_layout(holder.pos_embeddings) is None
    assert install_packed_rope(holder) == 0 and isinstance(holder.pos_embeddings, Other)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2"])
def test_norms_on_the_fused_kernel_keep_their_numbers(models, name):
    base = copy.deepcopy(models[name]).to(torch.bfloat16)
    lean = copy.deepcopy(base)
    norms = [m for m in lean.modules() if type(m).__name__ in ("RMSNorm", "GemmaRMSNorm")]
    # llama: 2 a layer and the last; qwen3: q and k norms too; gemma2: 4 a layer
    assert fused_rms_norms(lean) == len(norms) >= 2 * len(lean.layers) + 1
    if name == "gemma2":
        fused = [m for m in lean.modules() if isinstance(m, GemmaFusedRMSNorm)]
        assert len(fused) == len(norms) and not any(type(m).__name__ == "GemmaRMSNorm" for m in lean.modules())
        assert {n for n, _ in lean.named_parameters()} == {n for n, _ in base.named_parameters()}
    else:
        assert all(m.scale.dtype == torch.float32 and not m.scale.requires_grad for m in norms)
    assert fused_rms_norms(lean) == 0
    install_packed_rope(lean)
    tokens = torch.randint(4, 60, (1, 19), generator=torch.Generator().manual_seed(5))
    positions = _packed_positions([10, 9])
    h0, g0, _ = _forward_backward(base, tokens, positions)
    h1, g1, _ = _forward_backward(lean, tokens, positions)
    assert torch.equal(h0, h1) and torch.equal(g0, g1)


@pytest.mark.parametrize("lean", ["1", "0"])
def test_a_job_installs_them_unless_switched_off(tiny_model, reverse_data, tmp_path, monkeypatch, lean):
    monkeypatch.setenv("PLORA_LEAN_STEP", lean)
    cfg = job_config(tiny_model, reverse_data, tmp_path / "out", [{"id": "a", "rank": 4, "alpha": 8.0,
                                                                  "learning_rate": 1e-3, "batch_size": 2, "steps": 2,
                                                                  "seed": 0}])
    cfg["model"]["dtype"] = "bfloat16"
    recipe = PackedLoRARecipe(cfg)
    try:
        recipe.setup()
        model = recipe.pm.model
        ropes = {type(m.pos_embeddings) for m in model.modules() if getattr(m, "pos_embeddings", None) is not None}
        assert (ropes == {PackedRope}) == (lean == "1")
        assert (model.norm.scale.dtype == torch.float32) == (lean == "1")
    finally:
        recipe.cleanup()


def test_a_held_model_is_lean_before_its_job(tiny_model, monkeypatch):
    """A spare's model is made lean as it loads: its GPU warm-up runs the job's kernels."""
    from plora.train import preload

    monkeypatch.delenv("PLORA_LEAN_STEP", raising=False)
    key = preload.ModelKey.of(tiny_model, "auto", 64, "bfloat16", "cpu", False)
    preload.hold(key)
    try:
        model = preload.held_model(key)
        assert isinstance(model.layers[0].attn.pos_embeddings, PackedRope)
        assert model.norm.scale.dtype == torch.float32
    finally:
        preload.release()


def test_switch():
    assert Settings.from_env({}).lean_step
    assert not Settings.from_env({"PLORA_LEAN_STEP": "0"}).lean_step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(LAYOUT))
def test_on_cuda_rope_equal_and_fused_norms_close(bf16_models, name):
    """On a GPU: the RoPE still equal bit for bit; the fused norms round their own way in float32."""
    base = copy.deepcopy(bf16_models[name]).cuda()
    rope_only = copy.deepcopy(base)
    install_packed_rope(rope_only)
    lean = copy.deepcopy(base)
    make_lean(lean)
    tokens = torch.randint(4, 60, (1, 37), generator=torch.Generator().manual_seed(6)).cuda()
    positions = _packed_positions([16, 9, 12]).cuda()
    h0, g0, _ = _forward_backward(base, tokens, positions)
    h1, g1, _ = _forward_backward(rope_only, tokens, positions)
    assert torch.equal(h0, h1) and torch.equal(g0, g1)
    h2, g2, _ = _forward_backward(lean, tokens, positions)
    for a, b in ((h0, h2), (g0, g2)):
        a, b = a.float(), b.float()
        assert (a - b).norm() <= 0.02 * a.norm(), f"{name}: relative difference {(a - b).norm() / a.norm():.4f}"
