"""Packed training equals independent training; one diverging adapter hurts no other.

Tolerance: packed and alone runs differ only in the shapes of the base model's matmuls
(rows of other adapters in the batch), which changes float32 summation order inside BLAS —
about one ulp (6e-8 relative) per op, carried through a few dozen AdamW steps. We allow
2e-6 absolute on weights of magnitude ~0.1 (about 30 ulp). A real mistake — another
adapter's rows or gradient leaking in, a shared step counter, a wrong LR or data order —
moves weights by ~lr per step (1e-3 and more); `test_tolerance_catches_a_real_difference`
shows such a difference fails this tolerance by orders of magnitude.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import adapter_weights, job_config, max_weight_diff
from plora.train import hooks
from plora.train.adapter_run import lr_factor
from plora.train.packed_lora import PackedLoRARecipe

ATOL = 2e-6

ADAPTERS = [
    dict(id="r2", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=11, steps=14),
    dict(id="r4", rank=4, alpha=2.0, learning_rate=3e-3, batch_size=3, seed=12, steps=10),
    dict(id="r8", rank=8, alpha=16.0, learning_rate=1e-3, batch_size=5, seed=13, steps=6),
    dict(id="r1", rank=1, alpha=1.0, learning_rate=5e-3, batch_size=1, seed=14, steps=12),
]


@pytest.fixture(scope="module")
def packed_run(tiny_model, reverse_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed")
    summary = PackedLoRARecipe(job_config(tiny_model, reverse_data, out, ADAPTERS)).run()
    return out, summary


def test_packed_equals_alone(packed_run, tiny_model, reverse_data, tmp_path):
    out, summary = packed_run
    assert set(summary["adapters"].values()) == {"done"}
    for a in ADAPTERS:
        alone = tmp_path / a["id"]
        PackedLoRARecipe(job_config(tiny_model, reverse_data, alone, [a])).run()
        packed_w, alone_w = adapter_weights(out, a["id"]), adapter_weights(alone, a["id"])
        assert max(float(v.abs().max()) for v in packed_w.values()) > 1e-3  # it trained
        assert max_weight_diff(packed_w, alone_w) <= ATOL, a["id"]


def test_tolerance_catches_a_real_difference(packed_run, tiny_model, reverse_data, tmp_path):
    out, _ = packed_run
    a = dict(ADAPTERS[0], learning_rate=ADAPTERS[0]["learning_rate"] * 1.01)
    PackedLoRARecipe(job_config(tiny_model, reverse_data, tmp_path, [a])).run()
    assert max_weight_diff(adapter_weights(out, "r2"), adapter_weights(tmp_path, "r2")) > 100 * ATOL


def test_steps_run_with_the_heap_frozen_and_it_is_released_after(tiny_model, reverse_data, tmp_path):
    import gc

    seen = []
    with hooks.installed("after_step", lambda recipe, step: seen.append(gc.get_freeze_count())):
        PackedLoRARecipe(job_config(tiny_model, reverse_data, tmp_path, ADAPTERS[:1])).run()
    assert seen and all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0


def test_each_adapter_runs_its_own_steps(packed_run):
    import json

    out, _ = packed_run
    for a in ADAPTERS:
        m = json.loads((out / "adapters" / a["id"] / "metrics.json").read_text())
        assert m["steps"] == a["steps"] and m["status"] == "done"
        assert m["checkpoint_path"] and math.isfinite(m["eval_loss"])


def test_diverging_adapter_is_isolated(packed_run, tiny_model, reverse_data, tmp_path):
    out, _ = packed_run
    bad = dict(id="absurd", rank=4, alpha=8.0, learning_rate=1e38, batch_size=2, seed=99, steps=14)
    recipe = PackedLoRARecipe(job_config(tiny_model, reverse_data, tmp_path, ADAPTERS + [bad]))

    checked = []

    def check_others_finite(recipe, step):
        for r in recipe.runs:
            if r.id == "absurd":
                continue
            for t in recipe.bank.adapter_views(recipe.bank.weights, r.index) + recipe.optimizer.state_views(r.index):
                assert torch.isfinite(t).all()
        checked.append(step)

    with hooks.installed("after_step", check_others_finite):
        summary = recipe.run()
    assert summary["adapters"]["absurd"] == "diverged"
    assert len(checked) == max(a["steps"] for a in ADAPTERS)
    for a in ADAPTERS:
        assert summary["adapters"][a["id"]] == "done"
        assert max_weight_diff(adapter_weights(out, a["id"]), adapter_weights(tmp_path, a["id"])) <= ATOL
    import json

    m = json.loads((tmp_path / "adapters" / "absurd" / "metrics.json").read_text())
    assert m["status"] == "diverged" and m["checkpoint_path"] is None and "non-finite" in m["reason"]


def test_nan_loss_adapter_is_isolated_in_the_shared_backward(packed_run, tiny_model, reverse_data, tmp_path):
    """An adapter whose forward turns NaN stays in the one backward of the pack (the step
    decides on the device, so it can be replayed from a CUDA graph): its loss is masked
    out, its NaN stays in its own rows, and it leaves as diverged on its loss."""
    import json

    out, _ = packed_run
    extra = dict(id="poisoned", rank=4, alpha=8.0, learning_rate=1e-3, batch_size=2, seed=98, steps=14)
    recipe = PackedLoRARecipe(job_config(tiny_model, reverse_data, tmp_path, ADAPTERS + [extra]))

    def poison_at_step_2(recipe, step):
        if step == 2:
            k = next(r.index for r in recipe.runs if r.id == "poisoned")
            with torch.no_grad():
                for view in recipe.bank.adapter_views(recipe.bank.weights, k):
                    view.fill_(float("nan"))

    with hooks.installed("after_step", poison_at_step_2):
        summary = recipe.run()
    assert summary["adapters"]["poisoned"] == "diverged"
    m = json.loads((tmp_path / "adapters" / "poisoned" / "metrics.json").read_text())
    assert m["reason"].startswith("loss nan") and m["steps"] == 3
    for a in ADAPTERS:
        assert summary["adapters"][a["id"]] == "done"
        assert max_weight_diff(adapter_weights(out, a["id"]), adapter_weights(tmp_path, a["id"])) <= ATOL


def test_activation_checkpointing_changes_nothing(packed_run, tiny_model, reverse_data, tmp_path):
    out, _ = packed_run
    cfg = job_config(tiny_model, reverse_data, tmp_path, ADAPTERS)
    cfg["training"] = dict(cfg["training"], activation_checkpointing=True)
    PackedLoRARecipe(cfg).run()
    for a in ADAPTERS:
        assert max_weight_diff(adapter_weights(out, a["id"]), adapter_weights(tmp_path, a["id"])) <= ATOL


@pytest.mark.parametrize(
    "scheduler, step, expect",
    [("constant", 50, 1.0), ("linear", 10, 1.0), ("linear", 110, 0.0), ("cosine", 60, 0.5), ("cosine", 0, 0.1)],
)
def test_lr_schedule_per_adapter(scheduler, step, expect):
    assert lr_factor(step, total=110, warmup=10, scheduler=scheduler) == pytest.approx(expect, abs=1e-9)


def test_pruned_adapter_leaves_and_others_are_unchanged(packed_run, tiny_model, reverse_data, tmp_path):
    import json

    out, _ = packed_run
    recipe = PackedLoRARecipe(job_config(tiny_model, reverse_data, tmp_path, ADAPTERS))

    def prune_r1_at_step_3(recipe, step):
        if step == 3:
            (recipe.job_dir / "control.json").write_text(json.dumps({"prune": ["r1"]}))

    with hooks.installed("after_step", prune_r1_at_step_3):
        summary = recipe.run()
    assert summary["adapters"]["r1"] == "pruned"
    m = json.loads((tmp_path / "adapters" / "r1" / "metrics.json").read_text())
    assert m["steps"] == 4
    for a in ADAPTERS[:3]:
        assert max_weight_diff(adapter_weights(out, a["id"]), adapter_weights(tmp_path, a["id"])) <= ATOL


def test_job_warmup_is_the_space_files_warmup(tmp_path):
    """A warm-up ratio gives each adapter the warm-up the validated spec computes for its own
    step count (one rounding, in one place): the sweep writes it into each adapter's job
    config, and the job trains with it."""
    from plora.spec.adapter import AdapterConfig
    from plora.spec.loading import parse_spec
    from plora.planner.plan import Job
    from plora.job.from_spec import job_config as sweep_job_config

    spec = parse_spec({"name": "w", "training": {"warmup_ratio": 0.1}, "hardware": {"device": "cpu"}})
    a, b = AdapterConfig.make(4, 8.0, 1e-3, 2, 0), AdapterConfig.make(4, 8.0, 1e-3, 4, 0)
    cfg = sweep_job_config(spec, Job("job-000", [a.id, b.id]), [a, b], {a.id: 55, b.id: 7}, tmp_path, eval_base=False)
    want = [spec.training.warmup_for(55), spec.training.warmup_for(7)]
    assert [x.warmup_steps for x in cfg.adapters] == want == [6, 1]
    recipe = PackedLoRARecipe(cfg.to_dict())
    recipe.setup()
    try:
        assert [r.warmup for r in recipe.runs] == want
    finally:
        recipe.cleanup()


def test_a_packs_initial_a_is_the_same_drawn_on_threads_or_one(monkeypatch):
    """A pack's initial A is drawn on several threads at once: each adapter's A in each layer
    is still its own seeded draw, the same as a pack of it alone makes, bit for bit."""
    from torch import nn

    import plora.train.packed.inject as inject
    from plora.train.packed.layer import AdapterSpec

    def model() -> nn.Module:
        torch.manual_seed(0)
        blocks = nn.ModuleList()
        for _ in range(3):
            block = nn.Module()
            block.attn, block.mlp = nn.Module(), nn.Module()
            block.attn.q_proj = nn.Linear(24, 24, bias=False)
            block.mlp.w2 = nn.Linear(40, 24, bias=False)
            blocks.append(block)
        m = nn.Module()
        m.layers = blocks
        return m

    specs = [AdapterSpec(name=f"a{i}", rank=r, alpha=2.0 * r, seed=100 + i) for i, r in enumerate([2, 4, 8, 4])]
    targets = ["q_proj", "down_proj"]
    monkeypatch.setattr(inject, "_A_THREADS", 1)
    one = inject.inject_packed_lora(model(), specs, targets)
    monkeypatch.setattr(inject, "_A_THREADS", 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    many = inject.inject_packed_lora(model(), specs, targets)
    alone = inject.inject_packed_lora(model(), specs[2:3], targets)
    assert one.layers.keys() == many.layers.keys() and len(one.layers) == 6
    for name, layer in one.layers.items():
        assert torch.equal(layer.a_all, many.layers[name].a_all)
        assert torch.equal(layer.lora_a[2], alone.layers[name].lora_a[0])
        assert not layer.bt_all.any()


@pytest.mark.gpu
def test_on_a_gpu_a_packs_initial_a_is_drawn_there_and_each_adapter_starts_as_alone():
    """On a GPU the initial A is drawn by that GPU (milliseconds, not a CPU draw copied over):
    each adapter's A in each layer is its own seeded draw, the same in a pack of four as in a
    pack of it alone, within kaiming-uniform's bound, and an adapter that joins later
    (`PackedLoRALinear._init_a`) starts from the same A."""
    from torch import nn

    import plora.train.packed.inject as inject
    from plora.train.packed.layer import AdapterSpec

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")

    def model() -> nn.Module:
        blocks = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.attn, block.mlp = nn.Module(), nn.Module()
            block.attn.q_proj = nn.Linear(64, 64, bias=False, device="cuda", dtype=torch.bfloat16)
            block.mlp.w2 = nn.Linear(256, 64, bias=False, device="cuda", dtype=torch.bfloat16)
            blocks.append(block)
        m = nn.Module()
        m.layers = blocks
        return m

    specs = [AdapterSpec(name=f"a{i}", rank=r, alpha=2.0 * r, seed=100 + i) for i, r in enumerate([2, 4, 8, 4])]
    pack = inject.inject_packed_lora(model(), specs, ["q_proj", "down_proj"])
    alone = inject.inject_packed_lora(model(), specs[2:3], ["q_proj", "down_proj"])
    for name, layer in pack.layers.items():
        assert layer.a_all.is_cuda and layer.a_all.dtype == torch.bfloat16
        assert torch.equal(layer.lora_a[2], alone.layers[name].lora_a[0])
        assert not torch.equal(layer.lora_a[1], layer.lora_a[3])  # same rank, own seeds
        assert layer.a_all.abs().max().item() <= 1.0 / math.sqrt(layer.in_features)
        assert torch.equal(layer._init_a(specs[2]).to(torch.bfloat16), layer.lora_a[2])


def test_prewarming_triton_does_nothing_where_nothing_compiles():
    """A spare pays Triton's once-a-process costs ahead only where a step would compile
    Triton kernels: on the CPU (or under the interpreter) it does nothing and says so."""
    from plora.kernels.prewarm import prewarm

    assert prewarm("cpu") == {}
