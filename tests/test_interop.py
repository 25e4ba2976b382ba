"""A saved adapter is a real PEFT adapter: transformers + peft give plora's logits."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import job_config
from plora.train.packed_lora import PackedLoRARecipe

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def trained(tiny_model, reverse_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("interop")
    adapters = [
        dict(id="a", rank=4, alpha=8.0, learning_rate=3e-2, batch_size=4, seed=1, steps=6),
        dict(id="b", rank=2, alpha=1.0, learning_rate=1e-2, batch_size=2, seed=2, steps=4),
    ]
    cfg = job_config(tiny_model, reverse_data, out, adapters, lora={"targets": ALL, "dropout": 0.0})
    recipe = PackedLoRARecipe(cfg)
    recipe.run()
    return recipe, out


def _plora_logits(recipe, k, x):
    recipe.pm.state.set_batch([k], [x.numel()], "cpu")
    try:
        with torch.no_grad():
            return recipe.pm.model(x)
    finally:
        recipe.pm.state.clear()


def test_peft_loads_adapter_with_same_logits(trained, tiny_model):
    recipe, out = trained
    x = torch.randint(4, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    for k, name in enumerate(["a", "b"]):
        cfg = json.loads((out / "adapters" / name / "adapter_config.json").read_text())
        assert cfg["r"] == recipe.runs[k].cfg.rank and cfg["peft_type"] == "LORA"
        hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model)
        with torch.no_grad():
            base_logits = hf(input_ids=x).logits
        model = peft.PeftModel.from_pretrained(hf, str(out / "adapters" / name)).eval()
        with torch.no_grad():
            peft_logits = model(input_ids=x).logits
        ours = _plora_logits(recipe, k, x)
        assert float((ours - base_logits).abs().max()) > 1e-3  # the adapter changes the model
        assert float((ours - peft_logits).abs().max()) < 1e-5


def test_merged_export_matches_peft(trained, tiny_model, tmp_path):
    from plora.train.packed.peft_format import merge_adapter

    _, out = trained
    merged = merge_adapter(tiny_model, out / "adapters" / "a", tmp_path / "merged")
    x = torch.randint(4, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(hf, str(out / "adapters" / "a")).eval()(input_ids=x).logits
        got = transformers.LlamaForCausalLM.from_pretrained(merged)(input_ids=x).logits
    assert float((want - got).abs().max()) < 1e-4
