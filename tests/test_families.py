"""Every model family: plora's model is the `transformers` model, and its adapters are PEFT's.

Each case is a tiny random model written by `transformers` itself (`XConfig(...)` +
`save_pretrained`, 2 layers, hidden 64), so the check covers the real config spelling and
weight names of the installed transformers (5.x writes ``rope_parameters``; the 4.x
spelling is made by rewriting config.json).

Tolerances (float32): plora's logits and transformers' differ only in summation order and
in how RoPE tables are computed, a few ulp of values below ~2: 2e-5 absolute. PEFT's logits
are computed from the same adapter weights by other kernels: 2e-5. A merged export rounds
W + s·B·A once: 1e-4. A wrong layout or ignored setting (RoPE scaling, a norm, soft-capping)
moves logits by 1e-2 and more; `test_ignored_rope_scaling_would_show` checks that the
tolerance sees it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import job_config
from family_models import CASES, hf_model, make_model
from plora.models.loading import ModelError, load_base_model, read_model_info
from plora.train.packed_lora import PackedLoRARecipe
from plora.spec.base import SpecError
from plora.spec.model import resolve_targets

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LOGITS_ATOL = 2e-5
PEFT_ATOL = 2e-5
MERGED_ATOL = 1e-4
PACKED_ATOL = 2e-6  # as tests/test_packed.py argues

FAMILY = {"llama": "llama", "llama-tied-llama3": "llama", "mistral": "mistral", "qwen2": "qwen2",
          "qwen3": "qwen3", "gemma2": "gemma2", "phi3": "phi3", "phi3-longrope-partial": "phi3"}


def _ids(seed: int = 0, shape=(2, 20)) -> torch.Tensor:
    return torch.randint(4, 60, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("families")
    return {name: make_model(name, root / name) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, folders):
    folder = folders[name]
    model, info = load_base_model(folder, max_seq_len=64)
    assert info.family == FAMILY[name]
    x = _ids()
    with torch.no_grad():
        want = hf_model(name, folder)(input_ids=x).logits
        got = model.output(model.norm(_hidden(model, x)))
        assert torch.equal(got, model(x))  # logits are output(norm(h)): the LM head sits in .output
    assert float(want.abs().max()) > 0.1
    assert float((got - want).abs().max()) < LOGITS_ATOL


def _hidden(model, x):
    h = model.tok_embeddings(x)
    for layer in model.layers:
        h = layer(h)
    return h


@pytest.mark.parametrize("name", ["llama-tied-llama3", "qwen2", "phi3"])
def test_transformers_4_spelling(name, tmp_path):
    folder = make_model(name, tmp_path / name, v4_spelling=True)
    cfg = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" not in cfg and "rope_theta" in cfg
    v5 = json.loads(json.dumps(transformers.AutoConfig.from_pretrained(folder).to_dict()))
    info = read_model_info(folder)
    assert info.rope_base == float(CASES[name][2].get("rope_theta", 10000.0))
    model, _ = load_base_model(folder, max_seq_len=64)
    with torch.no_grad():
        want = hf_model(name, folder)(input_ids=_ids(1)).logits
        got = model(_ids(1))
    assert float((got - want).abs().max()) < LOGITS_ATOL
    assert v5  # transformers itself reads the old spelling


def test_v5_rope_theta_is_read(folders):
    cfg = json.loads((folders["qwen2"] / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 1e6 and "rope_theta" not in cfg
    assert read_model_info(folders["qwen2"]).rope_base == 1e6
    info = read_model_info(folders["llama-tied-llama3"])
    assert info.tie_word_embeddings and info.options["rope_scaling"]["factor"] == 8.0


def test_ignored_rope_scaling_would_show(folders, tmp_path):
    """The same weights read without the llama3 scaling give other logits: the tolerance sees it."""
    import shutil

    folder = shutil.copytree(folders["llama-tied-llama3"], tmp_path / "plain")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    scaled, _ = load_base_model(folders["llama-tied-llama3"], max_seq_len=64)
    plain, _ = load_base_model(folder, max_seq_len=64)
    with torch.no_grad():
        assert float((scaled(_ids()) - plain(_ids())).abs().max()) > 100 * LOGITS_ATOL


# ------------------------------------------------------------------ PEFT round trip


def _plora_logits(recipe, x):
    recipe.pm.state.set_batch([0], [x.numel()], "cpu")
    try:
        with torch.no_grad():
            return recipe.pm.model(x)
    finally:
        recipe.pm.state.clear()


@pytest.mark.parametrize("name", list(CASES))
def test_peft_round_trip(name, folders, reverse_data, tmp_path):
    """One adapter on every linear layer of the family, trained packed a few steps, saved,
    loaded by PEFT on the transformers model: same logits; the merged export too."""
    folder, family = folders[name], FAMILY[name]
    targets = resolve_targets("all-linear", family)
    adapter = dict(id="a", rank=4, alpha=8.0, learning_rate=3e-2, batch_size=2, seed=1, steps=4)
    cfg = job_config(folder, reverse_data, tmp_path / "run", [adapter], lora={"targets": targets, "dropout": 0.0})
    cfg["eval"]["max_eval_samples"] = 2
    recipe = PackedLoRARecipe(cfg)
    assert recipe.run()["adapters"] == {"a": "done"}
    saved = tmp_path / "run" / "adapters" / "a"
    conf = json.loads((saved / "adapter_config.json").read_text())
    assert conf["target_modules"] == sorted(targets)
    x = _ids(2)
    ours = _plora_logits(recipe, x)
    hf = hf_model(name, folder)
    with torch.no_grad():
        base = hf(input_ids=x).logits
        with_adapter = peft.PeftModel.from_pretrained(hf, str(saved)).eval()(input_ids=x).logits
    assert float((ours - base).abs().max()) > 1e-3  # the adapter changed the model
    assert float((ours - with_adapter).abs().max()) < PEFT_ATOL

    from plora.train.packed.peft_format import merge_adapter

    merged = merge_adapter(folder, saved, tmp_path / "merged")
    with torch.no_grad():
        got = hf_model(name, merged)(input_ids=x).logits
    assert float((got - with_adapter).abs().max()) < MERGED_ATOL
    if read_model_info(folder).tie_word_embeddings:  # the tied embedding is not touched
        before, after = load_file(str(folder / "model.safetensors")), load_file(str(merged / "model.safetensors"))
        assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])


def test_phi3_adapts_the_fused_modules(folders, reverse_data, tmp_path):
    """qkv_proj/gate_up_proj get one A and one B of the fused output size, as PEFT's."""
    info = read_model_info(folders["phi3"])
    adapter = dict(id="a", rank=2, alpha=2.0, learning_rate=1e-2, batch_size=2, seed=3, steps=1)
    cfg = job_config(folders["phi3"], reverse_data, tmp_path, [adapter],
                     lora={"targets": ["qkv_proj", "gate_up_proj"], "dropout": 0.0})
    cfg["eval"]["max_eval_samples"] = 1
    PackedLoRARecipe(cfg).run()
    w = load_file(str(tmp_path / "adapters" / "a" / "adapter_model.safetensors"))
    qkv = (info.num_heads + 2 * info.num_kv_heads) * info.head_dim
    assert w["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"].shape == (qkv, 2)
    assert w["base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight"].shape == (2 * info.intermediate_dim, 2)
    assert w["base_model.model.model.layers.0.mlp.gate_up_proj.lora_A.weight"].shape == (2, info.embed_dim)
    assert len(w) == 2 * 2 * info.num_layers


# ------------------------------------------------------------------ packed equals alone

PHI3_ADAPTERS = [
    dict(id="r2", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=11, steps=8),
    dict(id="r4", rank=4, alpha=2.0, learning_rate=3e-3, batch_size=3, seed=12, steps=5),
    dict(id="r1", rank=1, alpha=1.0, learning_rate=5e-3, batch_size=1, seed=14, steps=6),
]


def test_packed_equals_alone_phi3(folders, reverse_data, tmp_path):
    """The independence invariant on a composed family with fused projections."""
    lora = {"targets": resolve_targets("all-linear", "phi3"), "dropout": 0.0}

    def run(out, adapters):
        cfg = job_config(folders["phi3"], reverse_data, out, adapters, lora=lora)
        cfg["eval"]["max_eval_samples"] = 1
        return PackedLoRARecipe(cfg).run()

    assert set(run(tmp_path / "packed", PHI3_ADAPTERS)["adapters"].values()) == {"done"}
    for a in PHI3_ADAPTERS:
        run(tmp_path / a["id"], [a])
        packed = load_file(str(tmp_path / "packed" / "adapters" / a["id"] / "adapter_model.safetensors"))
        alone = load_file(str(tmp_path / a["id"] / "adapters" / a["id"] / "adapter_model.safetensors"))
        assert packed.keys() == alone.keys()
        assert max(float(v.abs().max()) for v in packed.values()) > 1e-3
        assert max(float((packed[k] - alone[k]).abs().max()) for k in packed) <= PACKED_ATOL, a["id"]


# ------------------------------------------------------------------ refusals


def _edit(folder, tmp_path, **changes):
    import shutil

    out = shutil.copytree(folder, tmp_path / "edited")
    cfg = json.loads((out / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "name, changes, words",
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, ["'yarn'", "llama3"]),
        ("llama", {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}, ["'linear'"]),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, ["low_freq_factor"]),
        ("qwen2", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}}, ["'dynamic'", "qwen2"]),
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, ["partial_rotary_factor 0.5"]),
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, ["longrope short_factor"]),
        ("phi3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, ["'dynamic'", "phi3", "longrope"]),
        ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}}, ["partial_rotary_factor 0.1", "odd rotary dimension"]),
        ("llama", {"attention_bias": True}, ["attention_bias"]),
        ("llama", {"mlp_bias": True}, ["mlp_bias"]),
        ("llama", {"hidden_act": "gelu"}, ["hidden_act", "'gelu'"]),
        ("qwen2", {"head_dim": 32}, ["head_dim 32"]),
        ("gemma2", {"hidden_activation": "relu"}, ["hidden_activation"]),
        ("llama", {"model_type": "falcon"}, ["'falcon'", "supported"]),
        ("llama", {"hidden_size": None}, ["'hidden_size'"]),
    ],
)
def test_unsupported_settings_are_refused_by_name(name, changes, words, folders, tmp_path):
    folder = _edit(folders[name], tmp_path, **changes)
    with pytest.raises(ModelError) as e:
        load_base_model(folder, max_seq_len=64)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("name, changes", [
    ("mistral", {"sliding_window": 32}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}),
    ("gemma2", {"sliding_window": 32}),
    ("phi3", {"sliding_window": 32}),
])
def test_sliding_window_refused_only_where_it_changes_results(name, changes, folders, tmp_path):
    folder = _edit(folders[name], tmp_path, **changes)
    load_base_model(folder, max_seq_len=32)  # rows within the window: the same model
    with pytest.raises(ModelError, match=r"sliding_window 32.*max_seq_len 64"):
        load_base_model(folder, max_seq_len=64)


def test_longrope_long_factors_refused(folders):
    """Beyond original_max_position_embeddings transformers switches to the long factors
    per batch; plora builds the short ones only, so longer rows are refused."""
    load_base_model(folders["phi3-longrope-partial"], max_seq_len=64)
    with pytest.raises(ModelError, match=r"longrope's long factors .*original_max_position_embeddings 64.*max_seq_len 65"):
        load_base_model(folders["phi3-longrope-partial"], max_seq_len=65)


def test_config_that_is_not_json_names_the_file(folders, tmp_path):
    import shutil

    folder = shutil.copytree(folders["llama"], tmp_path / "broken")
    (folder / "config.json").write_text("{model_type: llama")
    with pytest.raises(ModelError, match=r"broken/config\.json: not a readable JSON file"):
        read_model_info(folder)


def test_weights_of_another_architecture_are_refused(folders, tmp_path):
    import shutil

    folder = shutil.copytree(folders["llama"], tmp_path / "mixed")
    shutil.copy(folders["phi3"] / "model.safetensors", folder / "model.safetensors")
    with pytest.raises(ModelError, match=r"unexpected weight 'model\.layers\.0\.\w+\.(qkv|gate_up)_proj\.weight' for the llama family"):
        load_base_model(folder, max_seq_len=64)


def test_targets_resolve_per_family():
    assert resolve_targets("all-linear", "phi3") == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert resolve_targets("all-linear", "qwen3") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert resolve_targets(["qkv_proj"]) == ["qkv_proj"]  # without a model: any family's layer
    with pytest.raises(SpecError, match=r"lora.targets: the phi3 family has no 'q_proj' layer"):
        resolve_targets(["q_proj"], "phi3")
    with pytest.raises(SpecError, match=r"the llama family has no 'gate_up_proj' layer"):
        resolve_targets(["gate_up_proj"], "llama")


def test_injecting_a_layer_the_model_lacks_is_refused(folders):
    from plora.train.packed.inject import inject_packed_lora
    from plora.train.packed.layer import AdapterSpec

    model, _ = load_base_model(folders["phi3"], max_seq_len=32)
    with pytest.raises(ValueError, match=r"LoRA target 'q_proj': this model has no such layer"):
        inject_packed_lora(model, [AdapterSpec("a", 2, 2.0, 0)], ["q_proj"])


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "phi3"])
def test_tensor_parallel_refused_where_not_supported(name, folders):
    from plora.train.packed.inject import inject_packed_lora
    from plora.train.packed.layer import AdapterSpec
    from plora.train.packed.tp import TensorParallel

    model, _ = load_base_model(folders[name], max_seq_len=32)
    pm = inject_packed_lora(model, [AdapterSpec("a", 2, 2.0, 0)], ["o_proj"])
    tp = TensorParallel.__new__(TensorParallel)  # no process group: refused before any collective
    tp.size, tp.rank, tp.group, tp.copies, tp._replicated, tp._kv_copies, tp._splits = 2, 0, None, {}, [], [], {}
    with pytest.raises(NotImplementedError, match=r"supports the llama, mistral, qwen2 families.*tp 1"):
        tp.shard(pm)


def test_unknown_family_named(folders):
    with pytest.raises(ModelError, match=r"unknown model family 'falcon'; supported: llama, mistral, qwen2, qwen3, gemma2, phi3"):
        read_model_info(folders["llama"], family="falcon")
