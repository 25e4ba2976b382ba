"""QLoRA (``model.quantize: nf4``): the block linears of the base held in torchao's NF4.

Tolerances:
- packed against alone, both on the same NF4 base (the recipe, float32, a few AdamW steps):
  the invariant of `test_packed` (2e-6 absolute on the adapters' weights). The quantized
  base is the same tensor in both runs (NF4 is deterministic), so only summation order can
  differ; on this CPU the two come out bit-equal.
- the packed layer against torchtune's own QLoRA layer (`LoRALinear(..., quantize_base=True)`,
  the same NF4 weight: the codes are compared bit for bit): relative to the largest
  reference value, float32 within `REL32` (measured: y 0, dx 3e-7, dA 3e-7, dB 8e-8),
  bfloat16 within `REL16` (measured: y 4.4e-3, dx 4.2e-3, dA 3.4e-3, dB 5.3e-3, about one
  bfloat16 ulp: the packed kernels accumulate their token sums in float32 and add the LoRA
  term into the base output, torchtune rounds each product to bfloat16 and then adds).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import adapter_weights, job_config, max_weight_diff

ATOL = 2e-6
REL32 = 1e-5
REL16 = 2e-2

ADAPTERS = [
    dict(id="r2", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=11, steps=6),
    dict(id="r4", rank=4, alpha=2.0, learning_rate=3e-3, batch_size=3, seed=12, steps=4),
    dict(id="r8", rank=8, alpha=16.0, learning_rate=1e-3, batch_size=1, seed=13, steps=5),
]


def _nf4_cfg(model, data, out, adapters, **over):
    cfg = job_config(model, data, out, adapters, **over)
    cfg["eval"]["max_eval_samples"] = 4
    cfg["model"]["quantize"] = "nf4"
    return cfg


# ------------------------------------------------------------------ the spec field
def test_spec_field_round_trips_and_a_bad_value_is_one_line():
    import yaml

    from plora.spec.base import SpecError
    from plora.spec.loading import parse_spec

    s = parse_spec({"name": "q", "model": {"quantize": "nf4"}})
    assert s.model.quantize == "nf4"
    dumped = yaml.safe_load(yaml.safe_dump(s.model_dump(mode="json")))
    assert dumped["model"]["quantize"] == "nf4"
    assert parse_spec(dumped).model.quantize == "nf4"
    assert parse_spec({"name": "q"}).model.quantize is None  # off by default
    assert parse_spec({"name": "q", "model": {"quantize": "none"}}).model.quantize is None
    for bad in ("int4", "fp4", 4):
        with pytest.raises(SpecError) as e:
            parse_spec({"name": "q", "model": {"quantize": bad}})
        text = str(e.value)
        assert text.startswith("model.quantize") and len(text.splitlines()) == 1, text


# ------------------------------------------------------------------ the layer
def _against_torchtune(dtype):
    from torchao.dtypes.nf4tensor import to_nf4
    from torchtune.modules.peft import LoRALinear

    from plora.train.packed.layer import AdapterSpec, PackedLoRALinear, PackState
    from plora.quantize.nf4 import to_nf4_weight

    d_in, d_out = 128, 256  # 32768 weights: torchao's default blocks (64, 256) as they are
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(d_out, d_in, generator=g) * 0.05).to(dtype)
    ref = LoRALinear(d_in, d_out, rank=4, alpha=8.0, quantize_base=True)
    ref.weight = nn.Parameter(to_nf4(w), requires_grad=False)  # what torchtune's builders hold
    ref.lora_a.weight.data = (torch.randn(4, d_in, generator=g) * 0.1).to(dtype)
    ref.lora_b.weight.data = (torch.randn(d_out, 4, generator=g) * 0.1).to(dtype)

    lin = nn.Linear(d_in, d_out, bias=False).to(dtype)
    lin.weight = nn.Parameter(to_nf4_weight(w), requires_grad=False)
    assert torch.equal(lin.weight.quantized_data, ref.weight.quantized_data)
    assert torch.equal(lin.weight.quantized_scalers, ref.weight.quantized_scalers)
    state = PackState(adapters=[AdapterSpec("a", 2, 4.0, 1), AdapterSpec("b", 4, 8.0, 2), AdapterSpec("c", 8, 8.0, 3)])
    layer = PackedLoRALinear(lin, state, "layers.0.attn.q_proj")
    assert layer.a_all.dtype == dtype and type(layer.a_all) is nn.Parameter  # adapters: plain, the model's dtype
    with torch.no_grad():
        layer.lora_a[1].copy_(ref.lora_a.weight)
        layer.lora_bt[1].copy_(ref.lora_b.weight.t())
        for k in (0, 2):
            layer.lora_bt[k].copy_(torch.randn(layer.lora_bt[k].shape, generator=g) * 0.1)
    rows = [3, 5, 2]  # adapter "b" owns rows 3:8
    x = torch.randn(sum(rows), d_in, generator=g).to(dtype)
    state.set_batch([0, 1, 2], rows, "cpu")
    xp, xr = x.clone().requires_grad_(True), x[3:8].clone().requires_grad_(True)
    y, yr = layer(xp), ref(xr)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(dy)
    yr.backward(dy[3:8])

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).abs().max() / b.abs().max())

    return {"y": rel(y[3:8], yr), "dx": rel(xp.grad[3:8], xr.grad), "dA": rel(layer.a_all.grad[2:6], ref.lora_a.weight.grad),
            "dB": rel(layer.bt_all.grad[2:6], ref.lora_b.weight.grad.t())}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, REL32), (torch.bfloat16, REL16)])
def test_packed_layer_matches_torchtunes_qlora_layer(dtype, tol):
    errs = _against_torchtune(dtype)
    print(dtype, errs)
    assert max(errs.values()) <= tol, errs


def test_quantize_base_holds_every_block_linear_in_nf4(tiny_model):
    from torchao.dtypes.nf4tensor import NF4Tensor

    from plora.models.loading import load_base_model
    from plora.train.packed.inject import inject_packed_lora
    from plora.train.packed.layer import AdapterSpec
    from plora.quantize.nf4 import dense_weight, quantize_base

    model, _ = load_base_model(tiny_model, max_seq_len=32)
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    pm = inject_packed_lora(model, [AdapterSpec("a", 2, 4.0, 1)], ["q_proj", "v_proj"])
    import gc
    import weakref

    gone = [weakref.ref(pm.layers["layers.0.attn.q_proj"].base.weight), weakref.ref(pm.model.layers[1].mlp.w2.weight)]
    report = quantize_base(pm.model, "nf4")
    gc.collect()
    assert all(r() is None for r in gone)  # the dense weights are freed, not kept beside the NF4 ones
    assert len(report.quantized) == 2 * 7 and not report.dense  # targeted or not, like torchtune's builders
    assert report.bytes_after < 0.2 * report.bytes_before  # float32 -> about 0.52 byte a weight (+ tiny tensors)
    for name, p in pm.model.named_parameters():
        if name.endswith("lora_a") or "a_all" in name or "bt_all" in name:
            assert not isinstance(p, NF4Tensor) and p.dtype == torch.float32 and p.requires_grad
    q = pm.layers["layers.0.attn.q_proj"].base.weight
    assert isinstance(q, NF4Tensor) and not q.requires_grad
    assert isinstance(pm.model.layers[1].mlp.w2.weight, NF4Tensor)  # not targeted: quantized too
    assert not isinstance(pm.model.output.weight, NF4Tensor)  # the head and embeddings stay
    assert not isinstance(pm.model.tok_embeddings.weight, NF4Tensor)
    err = float((dense_weight(q) - dense["layers.0.attn.q_proj.weight"]).abs().max())
    assert 0 < err < 0.2 * float(dense["layers.0.attn.q_proj.weight"].abs().max())  # 4-bit, not a copy


# ------------------------------------------------------------------ packed = alone
@pytest.fixture(scope="module")
def nf4_packed(tiny_model, reverse_data, tmp_path_factory):
    from plora.train.packed_lora import PackedLoRARecipe

    out = tmp_path_factory.mktemp("nf4-packed")
    recipe = PackedLoRARecipe(_nf4_cfg(tiny_model, reverse_data, out, ADAPTERS))
    summary = recipe.run()
    return out, summary, recipe


def test_packed_qlora_equals_qlora_alone(nf4_packed, tiny_model, reverse_data, tmp_path):
    from plora.train.packed_lora import PackedLoRARecipe

    out, summary, recipe = nf4_packed
    assert set(summary["adapters"].values()) == {"done"}
    assert recipe.quantized.quantized and not recipe.quantized.dense
    worst = 0.0
    for a in ADAPTERS:
        PackedLoRARecipe(_nf4_cfg(tiny_model, reverse_data, tmp_path / a["id"], [a])).run()
        packed_w, alone_w = adapter_weights(out, a["id"]), adapter_weights(tmp_path / a["id"], a["id"])
        assert max(float(v.abs().max()) for v in packed_w.values()) > 1e-3  # it trained
        worst = max(worst, max_weight_diff(packed_w, alone_w))
    print("packed vs alone (nf4):", worst)
    assert worst <= ATOL
    # the same adapter on the dense base is another adapter: the base really was 4-bit
    dense = tmp_path / "dense"
    cfg = _nf4_cfg(tiny_model, reverse_data, dense, ADAPTERS[:1])
    cfg["model"].pop("quantize")
    PackedLoRARecipe(cfg).run()
    assert max_weight_diff(adapter_weights(out, "r2"), adapter_weights(dense, "r2")) > 100 * ATOL


def test_adapters_of_a_quantized_base_say_so_and_load_in_peft(nf4_packed, tiny_model):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from plora.quantize.export import NOTE_FILE, read_base_note

    out = nf4_packed[0] / "adapters" / "r4"
    note = read_base_note(out)
    assert note["quant_method"] == "nf4" and note["bits"] == 4 and note["load_in_4bit"] is True
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and NOTE_FILE not in cfg  # an ordinary PEFT config
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model)
    model = peft.PeftModel.from_pretrained(base, str(out))
    x = torch.randint(4, 40, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(input_ids=x).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=x).logits
    assert float((got - plain).abs().max()) > 1e-5  # the adapter is applied


def test_tensor_parallel_jobs_refuse_a_quantized_base(tiny_model, reverse_data, tmp_path):
    from pydantic import ValidationError

    from plora.job.config import JobConfig

    with pytest.raises(ValidationError, match="tensor parallelism"):
        JobConfig.parse(dict(_nf4_cfg(tiny_model, reverse_data, tmp_path, ADAPTERS[:1]), tp=2))
    JobConfig.parse(dict(_nf4_cfg(tiny_model, reverse_data, tmp_path, ADAPTERS[:1]), tp=1))


# ------------------------------------------------------------------ the cost model
def test_cost_model_prices_the_nf4_base_and_plans_one_gpu_jobs():
    from dataclasses import replace

    from plora.cost.model import AdapterLoad, CostModel
    from plora.models.shape import ModelShape
    from plora.quantize.cost import base_weight_bytes, nf4_bytes_per_weight, quantized_params

    assert nf4_bytes_per_weight(2) == pytest.approx(0.5 + 1 / 64 + 2 / 16384)
    bf16 = ModelShape.preset("qwen2.5-7b")
    nf4 = replace(bf16, quantize="nf4")
    assert bf16.tp_degrees() == (1, 2, 4) and nf4.tp_degrees() == (1,)  # TP refused for nf4
    assert 0.85 < quantized_params(bf16) / bf16.n_params < 0.95  # the block linears; head and embeddings stay
    assert base_weight_bytes(nf4) < 0.4 * base_weight_bytes(bf16)
    gpu = 80 * 2**30
    dense_cm = CostModel.analytic(bf16, 512, gpu, "all-linear")
    nf4_cm = CostModel.analytic(nf4, 512, gpu, "all-linear")
    assert nf4_cm.degrees == (1,)
    saved = dense_cm.memory_base(1) - nf4_cm.memory_base(1)
    assert 8e9 < saved < base_weight_bytes(bf16)  # ~10 GB of 15 GB freed (less the dequantize workspace)
    a = AdapterLoad("a", 16, 1, 100)
    fits = {name: max(k for k in range(1, 400) if cm.fits([a] * k, 1)) for name, cm in
            (("bf16", dense_cm), ("nf4", nf4_cm))}
    assert fits["nf4"] > fits["bf16"]
    assert nf4_cm.step_time([a] * 4, 1) > dense_cm.step_time([a] * 4, 1)  # the dequantize is priced
    # the profile and calibration cache keys tell the two apart; an unquantized key is as before
    from plora.cost.profiling.cache import cache_path, profile_key

    kw = dict(seq_len=512, dtype="bfloat16", device_name="H100", backend="triton", targets=["q_proj"])
    assert "quantize" not in bf16.to_dict()
    assert cache_path(profile_key(bf16, **kw)) != cache_path(profile_key(nf4, **kw))
    assert ModelShape.from_dict(nf4.to_dict()) == nf4


def test_profile_probes_run_on_the_quantized_base(tiny_model, monkeypatch):
    import plora.quantize.nf4 as nf4
    from plora.cost.profiling.measure import probe_job_config, run_probe
    from plora.cost.profiling.probes import Probe

    calls = []
    real = nf4.quantize_base
    monkeypatch.setattr(nf4, "quantize_base", lambda model, method: calls.append(method) or real(model, method))
    probe = Probe("p", (2, 4), (1, 2))
    cfg = probe_job_config(tiny_model, probe, seq_len=32, dtype="float32", device="cpu", targets=["q_proj"],
                           quantize="nf4")
    assert cfg.model.quantize == "nf4"
    m = run_probe(tiny_model, probe, seq_len=32, dtype="float32", device="cpu", targets=["q_proj", "v_proj"],
                  warmup=1, iters=2, num_threads=1, quantize="nf4")
    assert calls == ["nf4"] and not m.oom and not m.error and m.step_time > 0


def test_a_sweeps_cost_model_and_cache_follow_model_quantize(tmp_path):
    import yaml

    from plora.cost.profiling.cache import calibration_path, sweep_cache_path
    from plora.spec.loading import load_spec
    from plora.cost.sweep_model import analytic_prior
    from plora.hardware import hardware_for

    def spec(**model):
        data = {"name": "q", "model": {"path": "builtin:tiny-llama", "max_seq_len": 48, **model},
                "hardware": {"device": "cpu"}}
        path = tmp_path / f"space-{len(model)}.yaml"
        path.write_text(yaml.safe_dump(data))
        return load_spec(path)

    dense, nf4 = spec(), spec(quantize="nf4")
    assert sweep_cache_path(dense) != sweep_cache_path(nf4)
    assert calibration_path(dense) != calibration_path(nf4)
    hw = hardware_for(dense)
    assert analytic_prior(nf4, hw).memory_base(1) < analytic_prior(dense, hw).memory_base(1)


# ------------------------------------------------------------------ a whole sweep
@pytest.fixture(scope="module")
def nf4_sweep(tmp_path_factory):
    import yaml
    from typer.testing import CliRunner

    from plora.cli import app

    tmp = tmp_path_factory.mktemp("nf4-sweep")
    space = {
        "name": "qlora",
        "model": {"path": "builtin:tiny-llama", "max_seq_len": 48, "quantize": "nf4"},
        "data": {"task": "builtin:shift", "num_train": 16, "num_eval": 4},
        "lora": {"targets": "all-linear"},
        "space": {"strategy": "list", "configs": [
            {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
            {"rank": 4, "alpha": 4, "learning_rate": 3e-3, "batch_size": 8}]},
        "training": {"steps": 3},
        "eval": {"max_new_tokens": 2, "metrics": ["loss", "exact_match"]},  # generation on the NF4 base too
        "hardware": {"device": "cpu"},
        "output": {"dir": str(tmp / "runs")},
    }
    path = tmp / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLORA_CACHE_DIR", str(tmp / "cache"))
        result = CliRunner().invoke(app, ["sweep", str(path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    return tmp / "runs" / "qlora"


def test_a_sweep_with_an_nf4_base_exports_adapters_peft_loads(nf4_sweep, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import pandas as pd
    import yaml
    from typer.testing import CliRunner

    from plora.cli import app
    from plora.quantize.export import read_base_note
    from plora.spec.model import ASSETS_DIR

    run = nf4_sweep
    assert yaml.safe_load((run / "spec.yaml").read_text())["model"]["quantize"] == "nf4"
    frame = pd.read_parquet(run / "results.parquet")
    assert set(frame.status) == {"done"} and len(frame) == 2
    adapter = frame.adapter_id.iloc[0]
    jobs = [yaml.safe_load(p.read_text()) for p in (run / "jobs").glob("*/job.yaml")]
    assert jobs and all(j["model"]["quantize"] == "nf4" and (j.get("tp") or 1) == 1 for j in jobs)

    out = tmp_path / "peft"
    result = CliRunner().invoke(app, ["export", str(run), adapter, "-o", str(out)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert read_base_note(out)["quant_method"] == "nf4"
    base_dir = ASSETS_DIR / "tiny-llama"
    x = torch.randint(4, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_adapter = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base_dir), str(out)).eval()(input_ids=x).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()(input_ids=x).logits
    assert float((with_adapter - plain).abs().max()) > 1e-5

    # merged: into the unquantized base weights of the model folder (a full-precision model)
    merged_dir = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", str(run), adapter, "--merge", "-o", str(merged_dir)],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    assert read_base_note(merged_dir) is None
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert merged.dtype == torch.float32
    with torch.no_grad():
        assert float((merged(input_ids=x).logits - with_adapter).abs().max()) < 1e-4


# ------------------------------------------------------------------ the benchmark's path
def test_bench_qlora_smoke(tmp_path, monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    from plora.job.step_settings import CUDA_GRAPHS_ENV

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_qlora.py"
    spec = importlib.util.spec_from_file_location("bench_qlora", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "off")  # restored after: the script sets it
    monkeypatch.setattr(sys, "argv", ["bench_qlora.py", "--smoke", "--smoke-oom-above", "2", "--out", str(tmp_path)])
    bench.main()
    result = json.loads((tmp_path / "qlora.json").read_text())
    (cap,) = result["caps"]
    for name in ("bf16", "nf4"):
        v = cap["variants"][name]
        assert v["largest"] == 2 and v["predicted"] >= 1
        assert any("oom" in t for t in v["tries"])  # the out-of-memory path ran and was survived
        assert cap["common"][name]["ok"] and cap["common"][name]["per_row_ms"] > 0
    assert cap["largest_ratio"] == 1.0 and "per_row_ratio" in cap
    assert "| nf4 |" in (tmp_path / "qlora.md").read_text()


def test_the_planner_never_gives_a_quantized_base_tensor_parallelism(tmp_path):
    import yaml

    from plora.spec.loading import load_spec
    from plora.hardware import Hardware
    from plora.sweep import prepare

    def plan(quantize, baseline=None):
        data = {"name": "p", "model": {"path": "shape:qwen2.5-7b", "max_seq_len": 512,
                                       **({"quantize": quantize} if quantize else {})},
                "data": {"task": "builtin:shift", "num_train": 64, "num_eval": 4}, "lora": {"targets": "all-linear"},
                "space": {"strategy": "grid", "rank": [16], "alpha": [32], "learning_rate": [1e-4, 2e-4, 3e-4, 4e-4],
                          "batch_size": [1, 2]},
                "training": {"epochs": 1}, "eval": {"metrics": ["loss"]}, "hardware": {"device": "cuda", "gpus": 4},
                "planner": {"baseline": baseline} if baseline else {}, "output": {"dir": str(tmp_path / "runs")}}
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
        prep = prepare(load_spec(tmp_path / "s.yaml"), hardware=Hardware(True, 4, 80 * 2**30, local=False))
        return [j.tp for j in prep.plan.jobs], prep.cost_model.degrees

    # the same sweep on a bfloat16 base is planned on several GPUs a job (packed: TP 4 here)
    tps, degrees = plan(None)
    assert degrees == (1, 2, 4) and max(tps) > 1
    assert set(plan(None, "max_gpu")[0]) == {4}
    tps, degrees = plan("nf4")
    assert degrees == (1,) and set(tps) == {1}
    assert set(plan("nf4", "max_gpu")[0]) == {1}
