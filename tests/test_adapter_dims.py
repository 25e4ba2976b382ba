"""What a space may vary per adapter besides rank, alpha, learning rate and batch size:
LoRA dropout, weight decay, warm-up ratio, scheduler, rsLoRA, target set and epochs.

Each one round-trips through the space file (grid, random, list), through every Optuna
sampler and into the PEFT config; an adapter that does not set one keeps its id; packed
training of adapters that differ in them equals training each alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import adapter_weights, job_config, max_weight_diff, tiny_space_file
from plora.spec.adapter import TRAINING_DIMS, AdapterConfig
from plora.spec.base import SpecError
from plora.spec.loading import load_spec, parse_spec

REPO = Path(__file__).resolve().parents[1]

#: every new dimension at two values
DIMS = {
    "dropout": [0.0, 0.1],
    "weight_decay": [0.0, 0.01],
    "warmup_ratio": [0.0, 0.1],
    "scheduler": ["constant", "cosine"],
    "rslora": [False, True],
    "targets": [["q_proj", "v_proj"], "all-linear"],
    "epochs": [1, 2],
}
#: the values an AdapterConfig holds for them (a target set as its key)
HELD = {**DIMS, "targets": ["q_proj,v_proj", "all-linear"], "epochs": [1.0, 2.0]}


def spec_of(space: dict, **sections):
    return parse_spec({"name": "d", **sections, "space": space})


# --------------------------------------------------------------------------- ids


def test_demo_ids_are_unchanged():
    # pinned: the ids the demo and the full example had before any dimension was added
    assert [c.id for c in load_spec(REPO / "sweeps" / "demo.yaml").expand()] == [
        "a-2f64e7ea8d", "a-4570784461", "a-a8a05e56f3", "a-97a4fc1b89", "a-24e487b038", "a-cc4ff21e92",
        "a-d1a8a5d178", "a-abe201cc4d", "a-d7c61619eb", "a-8905da3d38", "a-18df1cade9", "a-295073775a",
        "a-01c5373595", "a-7408e23702", "a-6c7e62e692", "a-d644614f51"]
    assert [c.id for c in load_spec(REPO / "sweeps" / "example-full.yaml").expand()] == [
        "a-3aba243215", "a-9173c99636", "a-d7c61619eb", "a-18df1cade9", "a-475d8a211d", "a-61e799d9aa",
        "a-ef4e2e6a36", "a-e94beb8774"]


def test_a_dimension_at_the_sweeps_value_keeps_the_id():
    base = spec_of({}).expand()[0]
    assert base.id == AdapterConfig.make(8, 16, 1e-3, 4, 0).id
    for name, values in DIMS.items():
        if name == "targets":  # the sweep's set first
            values = [["q_proj", "k_proj", "v_proj", "o_proj"], "all-linear"]
        cfgs = spec_of({name: values}).expand()
        assert len(cfgs) == 2, name
        assert cfgs[0].id == base.id and getattr(cfgs[0], name) is None, name  # the sweep's own value
        assert cfgs[1].id != base.id and getattr(cfgs[1], name) == HELD[name][1], name
    # the sweep's value is whatever lora/training say: there, 0.1 is the default
    cfgs = spec_of({"dropout": [0.0, 0.1]}, lora={"dropout": 0.1}).expand()
    assert cfgs[1].id == base.id and cfgs[0].dropout == 0.0


def test_the_same_training_is_one_id_however_it_is_spelled():
    a = spec_of({"targets": [["v_proj", "q_proj"]]}).expand()[0]
    b = spec_of({"targets": "q_proj,v_proj"}).expand()[0]
    c = spec_of({}, lora={"targets": ["q_proj", "v_proj"]}).expand()[0]
    assert a.id == b.id and a.targets == "q_proj,v_proj"
    assert c.targets is None and c.id == spec_of({}).expand()[0].id  # sweep-wide: not in the id
    # no warm-up at all is a warm-up ratio of 0
    assert spec_of({"warmup_ratio": 0.0}).expand()[0].id == spec_of({}).expand()[0].id


def test_adapter_config_with_dims_round_trips():
    cfg = AdapterConfig.make(8, 16, 1e-3, 4, 0, dropout=0.05, scheduler="linear", rslora=True,
                             targets=["v_proj", "q_proj"], epochs=2)
    assert AdapterConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["targets"] == "q_proj,v_proj" and "weight_decay" not in cfg.to_dict()
    assert cfg.scale == pytest.approx(16 / 8 ** 0.5)
    row = {**cfg.to_dict(), "weight_decay": float("nan")}  # a table's empty cell
    assert AdapterConfig.from_dict(row) == cfg


# --------------------------------------------------------------------------- space file


def test_grid_crosses_every_dimension():
    s = spec_of({"rank": [4, 8], **DIMS})
    cfgs = s.expand()
    assert len(cfgs) == 2 * 2 ** len(DIMS)
    for name in DIMS:
        assert sorted({s.settings(c)[name] for c in cfgs}, key=str) == sorted(HELD[name], key=str), name
    assert s.space.searched() == list(TRAINING_DIMS)
    again = parse_spec(__import__("yaml").safe_load(s.to_yaml()))
    assert again.expand() == cfgs


def test_random_draws_every_dimension_and_keeps_the_old_draws():
    old = spec_of({"strategy": "random", "num_samples": 6, "rank": [2, 4, 8, 16],
                   "learning_rate": {"low": 1e-4, "high": 1e-2, "log": True}}).expand()
    new = spec_of({"strategy": "random", "num_samples": 6, "rank": [2, 4, 8, 16],
                   "learning_rate": {"low": 1e-4, "high": 1e-2, "log": True},
                   "dropout": {"low": 0.0, "high": 0.3}, "scheduler": ["constant", "linear", "cosine"],
                   "targets": [["q_proj", "v_proj"], "all-linear"]}).expand()
    # a space without them draws what it drew before they existed (pinned)
    assert [c.id for c in old] == ["a-96789f532d", "a-30cd92fd49", "a-c346c16a96", "a-b21cf4e7f9", "a-e568dd4cfb",
                                   "a-e68fa1663b"]
    assert (new[0].rank, new[0].learning_rate) == (old[0].rank, old[0].learning_rate)  # drawn after the four
    assert all(c.dropout is None or 0 <= c.dropout <= 0.3 for c in new)
    assert len({c.dropout for c in new}) > 1
    s = spec_of({"strategy": "random", "num_samples": 6, **DIMS})
    assert parse_spec(__import__("yaml").safe_load(s.to_yaml())).expand() == s.expand()


def test_list_entries_give_dimensions_or_take_the_sweeps():
    s = spec_of({"strategy": "list", "configs": [
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4},
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4, "dropout": 0.1, "weight_decay": 0.01,
         "warmup_ratio": 0.1, "scheduler": "cosine", "rslora": True, "targets": "all-linear", "epochs": 2},
    ]}, training={"scheduler": "linear"})
    plain, tuned = s.expand()
    assert plain.id == AdapterConfig.make(8, 16, 1e-3, 4, 0).id
    assert s.settings(plain)["scheduler"] == "linear" and s.settings(plain)["targets"] == \
        "k_proj,o_proj,q_proj,v_proj"
    assert {n: s.settings(tuned)[n] for n in DIMS} == {n: v[1] for n, v in HELD.items()}
    assert s.space.searched() == list(TRAINING_DIMS)
    assert parse_spec(__import__("yaml").safe_load(s.to_yaml())).expand() == [plain, tuned]
    assert s.steps_for(tuned, 100) == 50 and s.steps_for(plain, 100) == 25  # its own epochs
    assert s.warmup_for(tuned, 50) == 5 and s.warmup_for(plain, 25) == 0


def test_a_list_entry_at_the_sweeps_value_is_the_entry_without_it():
    with pytest.raises(SpecError, match=r"^space\.configs\[1\]: same configuration as space\.configs\[0\]"):
        spec_of({"strategy": "list", "configs": [
            {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4},
            {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4, "scheduler": "constant"}]})


@pytest.mark.parametrize(("space", "field", "text"), [
    ({"dropout": 1.5}, "space.dropout[0]", "must be in [0, 1)"),
    ({"dropout": {"low": 0, "high": 1, "num": 2}}, "space.dropout.high", "must be in [0, 1)"),
    ({"scheduler": "step"}, "space.scheduler[0]", "'constant', 'linear' or 'cosine'"),
    ({"targets": [["q_proj", "qq_proj"]]}, "space.targets[0]", "unknown target 'qq_proj'"),
    ({"weight_decay": [0.0, -0.1]}, "space.weight_decay[1]", "must be >= 0"),
    ({"warmup_ratio": 1.5}, "space.warmup_ratio[0]", "must be in [0, 1]"),
    ({"epochs": 0}, "space.epochs[0]", "must be > 0"),
    ({"rslora": "maybe"}, "space.rslora[0]", "valid boolean"),
    ({"strategy": "list", "configs": [{"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4,
                                       "dropout": 1.5}]}, "space.configs[0].dropout", "must be in [0, 1)"),
    ({"strategy": "list", "dropout": [0.1], "configs": [{"rank": 8, "alpha": 16, "learning_rate": 1e-3,
                                                         "batch_size": 4}]}, "space.dropout", "not used"),
    ({"dropout": {"low": 0, "high": 0.2}}, "space.dropout.num", "required"),
])
def test_malformed_dimension_is_one_line_naming_the_field(space, field, text):
    with pytest.raises(SpecError) as info:
        spec_of(space)
    assert info.value.field == field and text in str(info.value) and "\n" not in str(info.value)


def test_epochs_need_an_epoch_budget():
    with pytest.raises(SpecError, match=r"^space\.epochs: needs an epoch budget"):
        spec_of({"epochs": [1, 2]}, training={"steps": 10, "epochs": None})


@pytest.mark.parametrize("space", [{"dropout": 1.5}, {"scheduler": "step"}, {"targets": ["nope"]},
                                   {"weight_decay": -1}, {"warmup_ratio": 2}])
def test_malformed_dimension_exits_2_from_the_cli(space, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from plora.cli import app

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "space": space, "output": {"dir": str(tmp_path / "runs")}}))
    result = CliRunner().invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2, result.output
    field = f"space.{next(iter(space))}"
    assert field in result.output and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


def test_a_target_set_the_models_family_lacks_exits_2_before_anything_runs(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from plora.cli import app

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "space": {"targets": [["qkv_proj"], "all-linear"]},
                                    "hardware": {"device": "cpu"}, "output": {"dir": str(tmp_path / "runs")}}))
    result = CliRunner().invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2, result.output
    assert "space.targets: the llama family has no 'qkv_proj' layer" in " ".join(result.output.split())
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- Optuna


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid", "cmaes", "gp", "qmc", "nsgaii", "bruteforce"])
def test_every_sampler_draws_every_dimension(sampler):
    optuna = pytest.importorskip("optuna")
    if sampler == "cmaes":
        pytest.importorskip("cmaes")
    from plora.tuning.base import _quiet_optuna
    from plora.tuning.samplers import make_sampler
    from plora.tuning.space import config_from_params, params_of, search_space

    s = spec_of({"rank": [4, 8], **DIMS})
    space = search_space(s)
    assert set(DIMS) <= set(space)
    with _quiet_optuna():
        study = optuna.create_study(sampler=make_sampler(sampler, s, seed=1))
        seen = set()
        for _ in range(6):
            trial = study.ask(space)
            cfg = config_from_params(s, trial.params)
            settings = s.settings(cfg)
            for name in DIMS:
                assert settings[name] in HELD[name], (name, trial.params)
                assert settings[name] == trial.params[name] or (name == "epochs" and settings[name] ==
                                                                float(trial.params[name]))
            params, _ = params_of(s, cfg, space)  # and back
            assert params == trial.params
            seen.add(cfg.id)
            study.tell(trial, 1.0)
    assert len(seen) > 1


def test_async_tuning_does_not_search_target_sets():
    from plora.tuning.asynchronous import tune_async
    from plora.tuning.base import TuneError

    s = spec_of({"targets": [["q_proj", "v_proj"], "all-linear"]})
    with pytest.raises(TuneError, match="space.targets cannot be searched asynchronously"):
        tune_async(s, None, {}, None, n_trials=1, in_flight=1, slots=["cpu:0"], sign=1.0, n_train=8)


def test_ranges_are_float_distributions_and_list_values_are_the_entries():
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    from plora.tuning.space import search_space

    space = search_space(parse_spec({"name": "d", "space": {
        "dropout": {"low": 0.0, "high": 0.2}, "weight_decay": {"low": 1e-4, "high": 0.1, "log": True}}}, sampled=True))
    assert space["dropout"] == FloatDistribution(0.0, 0.2)
    assert space["weight_decay"] == FloatDistribution(1e-4, 0.1, log=True)
    s = spec_of({"strategy": "list", "configs": [
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4},
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4, "targets": "all-linear"}]})
    assert search_space(s)["targets"] == CategoricalDistribution(["all-linear", "k_proj,o_proj,q_proj,v_proj"])


# --------------------------------------------------------------------------- jobs


def test_job_adapters_carry_their_own_settings(tmp_path):
    from plora.planner.plan import Job
    from plora.job.from_spec import job_config as sweep_job_config

    s = spec_of({"strategy": "list", "configs": [
        {"rank": 4, "alpha": 8, "learning_rate": 1e-3, "batch_size": 2},
        {"rank": 4, "alpha": 8, "learning_rate": 1e-3, "batch_size": 2, "dropout": 0.1, "weight_decay": 0.01,
         "warmup_ratio": 0.5, "scheduler": "cosine", "rslora": True, "epochs": 2}]},
        training={"weight_decay": 0.02, "warmup_steps": 1}, hardware={"device": "cpu"})
    a, b = s.expand()
    cfg = sweep_job_config(s, Job("job-000", [a.id, b.id]), [a, b], {a.id: 5, b.id: 10}, tmp_path, eval_base=False)
    ja, jb = cfg.adapters
    assert (ja.dropout, ja.weight_decay, ja.scheduler, ja.rslora, ja.warmup_steps) == (0.0, 0.02, "constant", False, 1)
    assert (jb.dropout, jb.weight_decay, jb.scheduler, jb.rslora, jb.warmup_steps) == (0.1, 0.01, "cosine", True, 5)
    assert jb.hyperparameters()["rslora"] is True


def test_adapters_of_different_target_sets_never_share_a_job():
    from plora.cost.model import AdapterLoad
    from plora.engine.join_choice import RunningPack, choose_joins
    from plora.hardware import Hardware
    from plora.job.from_spec import adapter_targets
    from plora.sweep import plan_jobs

    s = spec_of({"rank": [2, 4], "targets": [["q_proj", "v_proj"], "all-linear"]}, hardware={"device": "cpu"})
    cfgs = s.expand()
    steps = {c.id: 5 for c in cfgs}
    plan = plan_jobs(s, cfgs, steps, hardware=Hardware(False, 2))
    by_id = {c.id: c for c in cfgs}
    assert sorted(a for j in plan.jobs for a in j.adapters) == sorted(steps)
    for job in plan.jobs:
        assert len(s.target_sets([by_id[a] for a in job.adapters])) == 1
    assert any("target sets" in n for n in plan.notes)
    qv = [c for c in cfgs if c.targets == "q_proj,v_proj"]
    assert adapter_targets(s, qv) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="different target sets"):
        adapter_targets(s, cfgs)
    # a waiting adapter joins only a running job of its own set
    pack = RunningPack("job-x", (AdapterLoad("p", 2, 4, 3),), targets="all-linear")
    waiting = [AdapterLoad("w", 2, 4, 50)]
    sets = {"w": "q_proj,v_proj", "p": "all-linear"}
    assert choose_joins([pack], waiting, lambda loads: True, targets=sets.get) == {}
    assert choose_joins([pack], waiting, lambda loads: True, targets={"w": "all-linear"}.get) == {"job-x": ["w"]}


def test_saved_adapter_config_carries_dropout_rslora_and_targets(tmp_path, tiny_model):
    from plora.models.loading import read_model_info
    from plora.train.packed.peft_format import save_peft_adapter

    info = read_model_info(tiny_model)
    out = save_peft_adapter(tmp_path / "a", {}, info, rank=4, alpha=8.0, targets=["v_proj", "q_proj"],
                            dropout=0.05, rslora=True)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["lora_dropout"], cfg["use_rslora"], cfg["target_modules"]) == (0.05, True, ["q_proj", "v_proj"])


# --------------------------------------------------------------------------- packed training

ATOL = 2e-6
#: adapters that differ in every dimension a job takes per adapter: dropout, weight decay,
#: scheduler, warm-up, rsLoRA, and steps (what epochs become)
MIXED = [
    dict(id="d1", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=11, steps=9, dropout=0.2,
         weight_decay=0.1, scheduler="linear", warmup_steps=3),
    dict(id="d2", rank=4, alpha=2.0, learning_rate=3e-3, batch_size=3, seed=12, steps=5, dropout=0.0,
         weight_decay=0.0, scheduler="cosine", warmup_steps=0, rslora=True),
    dict(id="d3", rank=2, alpha=8.0, learning_rate=5e-3, batch_size=2, seed=13, steps=7, dropout=0.5,
         weight_decay=0.01, scheduler="constant", warmup_steps=1),
]


@pytest.fixture(scope="module")
def mixed_run(tiny_model, reverse_data, tmp_path_factory):
    from plora.train.packed_lora import PackedLoRARecipe

    out = tmp_path_factory.mktemp("mixed")
    summary = PackedLoRARecipe(job_config(tiny_model, reverse_data, out, MIXED)).run()
    return out, summary


def test_packed_equals_alone_with_differing_training_settings(mixed_run, tiny_model, reverse_data, tmp_path):
    from plora.train.packed_lora import PackedLoRARecipe

    out, summary = mixed_run
    assert set(summary["adapters"].values()) == {"done"}
    for a in MIXED:
        alone = tmp_path / a["id"]
        PackedLoRARecipe(job_config(tiny_model, reverse_data, alone, [a])).run()
        packed_w, alone_w = adapter_weights(out, a["id"]), adapter_weights(alone, a["id"])
        assert max(float(v.abs().max()) for v in packed_w.values()) > 1e-3
        assert max_weight_diff(packed_w, alone_w) <= ATOL, a["id"]
        m = json.loads((out / "adapters" / a["id"] / "metrics.json").read_text())
        assert m["steps"] == a["steps"]
        assert m["config"]["dropout"] == a["dropout"] and m["config"]["scheduler"] == a["scheduler"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["auto", "flat"])
def test_packed_equals_alone_on_the_gpu(tiny_model, reverse_data, tmp_path, layout):
    """The same on a GPU, with the Triton dropout kernel: in the padded rows of CUDA-graph
    steps (``auto``) and in flattened rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from plora.train.packed_lora import PackedLoRARecipe

    over = dict(device="cuda", num_threads=None,
                training={"scheduler": "cosine", "grad_clip": 1.0, "weight_decay": 0.01, "row_layout": layout})
    packed = tmp_path / "packed"
    summary = PackedLoRARecipe(job_config(tiny_model, reverse_data, packed, MIXED, **over)).run()
    assert set(summary["adapters"].values()) == {"done"}
    for a in MIXED:
        alone = tmp_path / f"alone-{a['id']}"
        PackedLoRARecipe(job_config(tiny_model, reverse_data, alone, [a], **over)).run()
        assert max_weight_diff(adapter_weights(packed, a["id"]), adapter_weights(alone, a["id"])) <= 1e-4, a["id"]


def test_dropout_changes_training_and_each_setting_matters(mixed_run, tiny_model, reverse_data, tmp_path):
    """The settings are not ignored: the same adapter without its dropout (or with the job's
    weight decay) trains to other weights."""
    from plora.train.packed_lora import PackedLoRARecipe

    out, _ = mixed_run
    for change in ({"dropout": 0.0}, {"weight_decay": 0.0}, {"scheduler": "constant"}):
        a = {**MIXED[0], **change}
        PackedLoRARecipe(job_config(tiny_model, reverse_data, tmp_path / next(iter(change)), [a])).run()
        diff = max_weight_diff(adapter_weights(out, "d1"), adapter_weights(tmp_path / next(iter(change)), "d1"))
        assert diff > 100 * ATOL, change


def test_dropout_masks_follow_the_adapter_not_the_pack():
    """A token's mask depends on its adapter's key and step and its index in the adapter's
    own rows: the same rows give the same mask wherever the adapter sits in the pack."""
    from plora.train.packed.dropout import adapter_key, hash_dropout, token_keys

    x = torch.randn(10, 16, dtype=torch.float64)
    keys = torch.tensor([adapter_key(1), adapter_key(2)])
    probs = torch.tensor([0.0, 0.5])
    steps = torch.tensor([3, 7])
    h, p = token_keys(torch.tensor([0, 4, 10]), 10, 10, keys, steps, probs, None)
    y = hash_dropout(x, h, p, 123)
    assert torch.equal(y[:4], x[:4])  # p = 0 keeps everything
    dropped = (y[4:] == 0).double().mean()
    assert 0.3 < float(dropped) < 0.7
    assert torch.allclose(y[4:][y[4:] != 0], 2 * x[4:][y[4:] != 0])
    # the second adapter alone: the same mask on its rows
    h2, p2 = token_keys(torch.tensor([0, 6]), 6, 6, keys[1:], steps[1:], probs[1:], None)
    assert torch.equal(hash_dropout(x[4:], h2, p2, 123), y[4:])
    # another step, or another layer: another mask
    h3, p3 = token_keys(torch.tensor([0, 6]), 6, 6, keys[1:], steps[1:] + 1, probs[1:], None)
    assert not torch.equal(hash_dropout(x[4:], h3, p3, 123), y[4:])
    assert not torch.equal(hash_dropout(x[4:], h2, p2, 124), y[4:])
    # backward draws the mask again
    xg = x[4:].clone().requires_grad_(True)
    hash_dropout(xg, h2, p2, 123).sum().backward()
    assert torch.equal(xg.grad, (y[4:] != 0).double() * 2)


# --------------------------------------------------------------------------- PEFT interop


def test_rslora_adapter_loads_in_peft_with_plora_logits(tiny_model, reverse_data, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from plora.train.packed_lora import PackedLoRARecipe

    adapters = [dict(id="rs", rank=4, alpha=8.0, learning_rate=3e-2, batch_size=4, seed=1, steps=6, rslora=True,
                     dropout=0.1)]
    targets = ["q_proj", "v_proj", "down_proj"]
    recipe = PackedLoRARecipe(job_config(tiny_model, reverse_data, tmp_path, adapters,
                                         lora={"targets": targets, "dropout": 0.0}))
    recipe.run()
    cfg = json.loads((tmp_path / "adapters" / "rs" / "adapter_config.json").read_text())
    assert cfg["use_rslora"] is True and cfg["lora_dropout"] == 0.1 and cfg["target_modules"] == sorted(targets)
    x = torch.randint(4, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    recipe.pm.model.eval()
    recipe.pm.state.set_batch([0], [x.numel()], "cpu")
    try:
        with torch.no_grad():
            ours = recipe.pm.model(x)
    finally:
        recipe.pm.state.clear()
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        base = hf(input_ids=x).logits
    model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapters" / "rs")).eval()
    with torch.no_grad():
        theirs = model(input_ids=x).logits
    assert float((ours - base).abs().max()) > 1e-3
    assert float((ours - theirs).abs().max()) < 1e-5
    # the merged export scales by alpha/sqrt(r) too
    from plora.train.packed.peft_format import merge_adapter

    merged = merge_adapter(tiny_model, tmp_path / "adapters" / "rs", tmp_path / "merged")
    with torch.no_grad():
        got = transformers.LlamaForCausalLM.from_pretrained(merged)(input_ids=x).logits
    assert float((got - theirs).abs().max()) < 1e-4


def test_triton_dropout_kernel_draws_the_torch_bits():
    """The CUDA path's kernel (run by Triton's interpreter without a GPU) keeps exactly the
    elements the torch path keeps, scaled alike."""
    pytest.importorskip("triton")
    import os

    from plora.train.packed.dropout import _mask, adapter_key, token_keys

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or Triton's interpreter")
    from plora.kernels.triton_ops import kernels_module

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(37, 200, device=dev)
    keys = torch.tensor([adapter_key(1), adapter_key(2)], device=dev)
    h, p = token_keys(torch.tensor([0, 20, 37], device=dev), 37, 37, keys, torch.tensor([3, 7], device=dev),
                      torch.tensor([0.1, 0.5], device=dev), None)
    want = x * _mask(tuple(x.shape), h, p, 0x9ABCDEF1, 64, x.dtype)
    got = torch.empty_like(x)
    kernels_module("_triton_dropout_kernels.py").hash_dropout_kernel[(2, 2)](
        x, got, h, p.float(), 37, 200, 0x9ABCDEF1, 64, BT=32, BF=128)
    assert torch.equal(got == 0, want == 0)
    assert float((got - want).abs().max()) <= 1e-6


def test_killed_job_of_differing_adapters_resumes_to_an_uninterrupted_runs_weights(tmp_path, monkeypatch):
    """Adapters with their own dropout, weight decay, schedule, warm-up and epochs, SIGKILLed
    at step 12 (checkpoints every 5 steps): the resumed job draws the masks and rates it
    would have drawn, and ends where a run never interrupted ends."""
    import yaml
    from safetensors.torch import load_file

    from conftest import inject_fault
    from plora.planner.plan import Job, Plan
    from plora.train.packed_lora import PackedLoRARecipe
    from plora.sweep import prepare, run_prepared, write_run_files

    inject_fault(monkeypatch, "kill@job-000@12@1")
    path = tiny_space_file(
        tmp_path, name="ck", lora={"targets": ["q_proj", "v_proj"], "dropout": 0.1},
        space={"strategy": "list", "configs": [
            {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4, "epochs": 3, "scheduler": "cosine",
             "warmup_ratio": 0.2, "weight_decay": 0.05},
            {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 2, "dropout": 0.3, "rslora": True}]},
        training={"epochs": 2, "checkpoint_every_steps": 5, "checkpoint_every_minutes": None},
        eval={"max_new_tokens": 2, "metrics": ["loss"]})
    prep = prepare(load_spec(path))
    assert [prep.steps[c.id] for c in prep.configs] == [18, 24]  # each its own epochs
    prep.plan = Plan([Job("job-000", [c.id for c in prep.configs])], grouping="one job for the test")
    write_run_files(prep)
    frame = run_prepared(prep, slots=["cpu:0"])
    assert set(frame.status) == {"done"}, frame[["adapter_id", "status", "reason"]]
    assert list(frame.columns[6:12]) == ["dropout", "weight_decay", "warmup_ratio", "scheduler", "rslora", "epochs"]
    run, job_dir = prep.run_dir, prep.run_dir / "jobs" / "job-000"
    # step 12 ends an epoch of both (24 rows at batch 4 and 2), where a job checkpoints too
    assert json.loads((job_dir / "summary.json").read_text())["resumed_from"] == {c.id: 12 for c in prep.configs}
    cfg = yaml.safe_load((job_dir / "job.yaml").read_text())
    ref = tmp_path / "ref"
    cfg.update(output_dir=str(ref), job_dir=str(ref / "jobs" / "job-000"), eval_base=False)
    cfg["training"]["checkpoint_every_steps"] = None
    PackedLoRARecipe(cfg).run()
    for c in prep.configs:
        got = load_file(run / "adapters" / c.id / "adapter_model.safetensors")
        want = load_file(ref / "adapters" / c.id / "adapter_model.safetensors")
        for k in got:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
