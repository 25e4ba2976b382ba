"""The parametric cost model: job time with shrinking packs, memory under TP, serialization."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from plora.cost.model import AdapterLoad, CostModel, MemoryCoeffs, TimeCoeffs

from plora.models.families.targets import resolve_lora_targets

from plora.models.shape import ModelShape

GIB = 2**30


def toy_model(degrees=(1, 2)) -> CostModel:
    """Round numbers so that expected values can be worked out by hand."""
    time = {d: TimeCoeffs(c0=1.0 / d, c_tok=0.01 / d, c_rtok=0.001 / d, c_ad=0.5) for d in degrees}
    memory = {d: MemoryCoeffs(base=10.0 / d, adapter=1.0, rank=0.5 / d, tok=0.1 / d, rank_tok=0.0) for d in degrees}
    return CostModel(gpu_memory_bytes=100.0, seq_len=10, time=time, memory_coeffs=memory, name="toy")


def test_step_time_is_the_linear_model():
    cm = toy_model()
    a = AdapterLoad("a", rank=4, batch_size=2, steps=10)
    b = AdapterLoad("b", rank=8, batch_size=1, steps=10)
    # c0 + c_tok * sum(bs*seq) + c_rtok * sum(r*bs*seq) + c_ad * K
    expected = 1.0 + 0.01 * (20 + 10) + 0.001 * (4 * 20 + 8 * 10) + 0.5 * 2
    assert cm.step_time([a, b], 1) == pytest.approx(expected)
    assert cm.step_time([], 1) == pytest.approx(1.0)


def test_job_time_with_adapters_finishing_at_different_steps():
    cm = toy_model()
    a = AdapterLoad("a", rank=4, batch_size=2, steps=10)
    b = AdapterLoad("b", rank=8, batch_size=1, steps=30)
    c = AdapterLoad("c", rank=8, batch_size=1, steps=30)
    d = AdapterLoad("d", rank=16, batch_size=4, steps=50)
    jobs = [a, b, c, d]
    # 10 steps with all four, 20 more with b, c, d, then 20 with d alone.
    expected = 10 * cm.step_time(jobs, 1) + 20 * cm.step_time([b, c, d], 1) + 20 * cm.step_time([d], 1)
    assert cm.job_time(jobs, 1) == pytest.approx(expected)
    # Order of the input does not matter, and a lone adapter is steps * step time.
    assert cm.job_time(list(reversed(jobs)), 1) == pytest.approx(expected)
    assert cm.job_time([d], 2) == pytest.approx(50 * cm.step_time([d], 2))
    # Closed form of the linear model: c0 * max steps + sum_k steps_k * (what k adds to a step).
    closed = cm.step_base(1) * 50 + sum(x.steps * cm.step_per_adapter(x, 1) for x in jobs)
    assert cm.job_time(jobs, 1) == pytest.approx(closed)
    assert cm.job_time([], 1) == 0.0


def test_job_overhead_is_paid_once_per_job(tmp_path):
    cm = toy_model()
    cm = replace(cm, job_overhead_s=7.0)
    a, b = AdapterLoad("a", 4, 2, 10), AdapterLoad("b", 8, 1, 30)
    assert cm.job_time([a, b], 1) == pytest.approx(7.0 + 10 * cm.step_time([a, b], 1) + 20 * cm.step_time([b], 1))
    assert cm.job_time([], 1) == 0.0
    cm.save(tmp_path / "m.json")
    assert CostModel.load(tmp_path / "m.json").job_overhead_s == 7.0


def test_fits_uses_load_factor_and_known_degrees():
    cm = toy_model()
    a = AdapterLoad("a", rank=4, batch_size=2, steps=10)
    m = cm.memory([a], 1)  # 10 + 1 + 2 + 0.1*20 = 15
    assert m == pytest.approx(15.0)
    assert cm.fits([a], 1, load_factor=0.15)
    assert not cm.fits([a], 1, load_factor=0.14)
    assert not cm.fits([a], 4, load_factor=1.0)  # degree the model does not have


def test_memory_scaling_with_tp_degree():
    shape = ModelShape.preset("qwen2.5-7b")
    cm = CostModel.analytic(shape, 1024, 80 * GIB)
    assert cm.degrees == (1, 2, 4)  # 4 KV heads: TP 8 would split a head
    overhead = cm.memory_coeffs[1].base - shape.n_params * shape.dtype_bytes
    for d in cm.degrees:
        # the frozen weights are sharded exactly 1/d, the fixed overhead is not
        assert cm.memory_base(d) - overhead == pytest.approx(shape.n_params * shape.dtype_bytes / d)
    job = [AdapterLoad("a", 64, 8, 100), AdapterLoad("b", 128, 16, 100)]
    mems = [cm.memory(job, d) for d in cm.degrees]
    assert mems[0] > mems[1] > mems[2]
    # Only part of an adapter's footprint is sharded, so it shrinks by less than d.
    a = job[1]
    assert cm.memory_per_adapter(a, 2) > cm.memory_per_adapter(a, 1) / 2
    assert cm.memory_per_adapter(a, 2) < cm.memory_per_adapter(a, 1)
    # Per adapter: LoRA params + grads + AdamW state grow with rank, activations with rows.
    small = AdapterLoad("s", 8, 8, 100)
    assert cm.memory_per_adapter(a, 1) > cm.memory_per_adapter(small, 1)
    assert cm.memory_per_adapter(AdapterLoad("r", 128, 8, 1), 1) > cm.memory_per_adapter(AdapterLoad("r", 8, 8, 1), 1)


def test_analytic_time_prefers_packing_and_charges_tp():
    cm = CostModel.analytic(ModelShape.preset("qwen2.5-7b"), 1024, 80 * GIB)
    a = AdapterLoad("a", 16, 1, 1000)
    # Packing shares the fixed step cost: two together beat two apart.
    assert cm.step_time([a, a], 1) < 2 * cm.step_time([a], 1)
    # TP speeds a step up but costs more GPU-seconds (communication).
    big = [AdapterLoad("b", 16, 32, 10)]
    assert cm.step_time(big, 2) < cm.step_time(big, 1)
    assert 2 * cm.step_time(big, 2) > cm.step_time(big, 1)
    t = cm.time[1]
    assert t.c0 > 0 and t.c_tok > 0 and t.c_rtok > 0 and t.c_ad > 0


def test_json_round_trip(tmp_path):
    cm = CostModel.analytic(ModelShape.preset("qwen2.5-0.5b"), 512, 40 * GIB, targets="all-linear")
    data = json.loads(json.dumps(cm.to_dict()))
    back = CostModel.from_dict(data)
    assert back == cm
    path = tmp_path / "profile.json"
    cm.save(path)
    loaded = CostModel.load(path)
    job = [AdapterLoad("a", 8, 4, 100), AdapterLoad("b", 64, 2, 300)]
    for d in cm.degrees:
        assert loaded.memory(job, d) == cm.memory(job, d)
        assert loaded.job_time(job, d) == cm.job_time(job, d)
    # A profile file may wrap the model next to its measurements.
    path.write_text(json.dumps({"cost_model": cm.to_dict(), "measurements": []}))
    assert CostModel.load(path) == cm


def test_lora_params_per_rank():
    s = ModelShape.preset("qwen2.5-7b")
    qkvo = (3584 + 3584) + (3584 + 512) + (3584 + 512) + (3584 + 3584)
    assert s.lora_params_per_rank(["q_proj", "k_proj", "v_proj", "o_proj"]) == 28 * qkvo
    mlp = 3 * (3584 + 18944)
    assert s.lora_params_per_rank("all-linear") == 28 * (qkvo + mlp)
    rep, shard = s.lora_split_per_rank("all-linear")
    assert rep + shard == s.lora_params_per_rank("all-linear")
    assert resolve_lora_targets(None) == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(ValueError):
        resolve_lora_targets(["qkv"])


@pytest.mark.parametrize("name", ModelShape.presets())
def test_preset_shapes_add_up_to_their_parameter_count(name):
    s = ModelShape.preset(name)
    linear = sum(i * o for i, o in s.linear_dims().values())
    qkv_bias = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim if name.startswith("qwen") else 0
    per_layer = linear + qkv_bias + 2 * s.hidden  # + two RMSNorm weights
    embeddings = s.vocab * s.hidden * (1 if s.tied_embeddings else 2)
    assert s.n_layers * per_layer + embeddings + s.hidden == s.n_params
    for d in s.tp_degrees():
        assert s.n_heads % d == 0 and s.n_kv_heads % d == 0


def test_unknown_preset():
    with pytest.raises(KeyError, match="unknown model preset"):
        ModelShape.preset("gpt-5")


def test_each_rank_bucket_adds_its_cost_while_it_is_in_the_pack():
    """Ranks 8 and 16 share the kernels' bucket 16; 32 and 128 are buckets of their own."""
    from plora.cost.model import AdapterLoad, CostModel, MemoryCoeffs, TimeCoeffs, rank_bucket

    from plora.kernels import rank_bucket as kernels_rank_bucket

    assert [rank_bucket(r) for r in (1, 8, 16, 17, 32, 100, 128, 256)] == [16, 16, 16, 32, 32, 128, 128, 256]
    assert all(rank_bucket(r) == kernels_rank_bucket(r) for r in range(1, 257))  # the twin stays in step
    cm = CostModel(1e12, 10, {1: TimeCoeffs(c0=1.0, c_tok=0.0, c_rtok=0.0, c_ad=0.0, c_bkt=0.5)},
                   {1: MemoryCoeffs(0, 0, 0, 0, 0)})
    a = AdapterLoad("a", 8, 1, steps=10)
    b = AdapterLoad("b", 16, 1, steps=20)
    c = AdapterLoad("c", 128, 1, steps=5)
    assert cm.step_time([a, b], 1) == 1.5  # one bucket
    assert cm.step_time([a, b, c], 1) == 2.0  # two
    # c's bucket is paid for its 5 steps, a/b's for 20: 20 * 1.0 + 20 * 0.5 + 5 * 0.5
    assert cm.job_time([a, b, c], 1) == 20 + 10 + 2.5
    back = CostModel.from_dict(cm.to_dict())
    assert back.time[1].c_bkt == 0.5
    old = cm.to_dict()
    for coeffs in old["time"].values():
        del coeffs["c_bkt"]
    assert CostModel.from_dict(old).time[1].c_bkt == 0.0  # profiles saved before the term load
