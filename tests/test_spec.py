"""The space file: validation messages, expansion, ids, and the resolved round trip."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import yaml

import plora.spec.adapter as spec_adapter
import plora.spec.model as spec_model
import plora.spec.schema as spec
from plora.spec.adapter import AdapterConfig
from plora.spec.base import SpecError
from plora.spec.loading import load_spec, parse_spec
from plora.spec.model import resolve_targets
from plora.spec.schema import SweepSpec

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, monkeypatch):
    """A fake assets folder and task list, so these tests depend on no other module's state."""
    assets = tmp_path_factory.mktemp("assets")
    (assets / "tiny-llama").mkdir()
    (assets / "other-model").mkdir()
    monkeypatch.setattr(spec_model, "ASSETS_DIR", assets)
    tasks = types.ModuleType("plora.data.tasks")
    tasks.BUILTIN_TASKS = {"shift": object(), "reverse": object()}
    monkeypatch.setitem(sys.modules, "plora.data.tasks", tasks)


def make(**sections) -> SweepSpec:
    return parse_spec({"name": "t", **sections})


def error_of(data: dict, base_dir: Path | None = None) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(data, base_dir)
    return info.value


def assert_field(err: SpecError, field: str) -> None:
    text = str(err)
    assert "\n" not in text
    assert err.field == field, text
    assert text.startswith(field + ": "), text
    assert len(text) > len(field) + 2


# --------------------------------------------------------------------------- defaults


def test_defaults_match_the_contract():
    s = make()
    assert s.name == "t"
    assert s.model.path == "builtin:tiny-llama" and s.model.family == "auto"
    assert s.model.dtype == "float32" and s.model.max_seq_len == 64
    assert s.data.task == "builtin:shift" and s.data.task_name == "shift" and s.data.train is None
    assert (s.data.input_column, s.data.output_column, s.data.max_eval_samples) == ("input", "output", 256)
    assert s.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj"] and s.lora.dropout == 0.0
    assert s.space.strategy == "grid" and s.space.seed == 0 and s.space.seeds_per_config == 1
    assert (s.space.rank, s.space.alpha, s.space.learning_rate, s.space.batch_size) == ([8], [16.0], [1e-3], [4])
    t = s.training
    assert (t.epochs, t.steps, t.warmup_steps, t.warmup_ratio) == (1.0, None, 0, None)
    assert (t.scheduler, t.grad_clip, t.weight_decay, t.divergence_loss) == ("constant", 1.0, 0.0, None)
    assert s.eval.metrics == ["loss", "exact_match"] and s.eval.objective == "exact_match"
    assert s.eval.max_new_tokens == 16 and not s.eval.minimize
    assert (s.hardware.device, s.hardware.gpus, s.hardware.gpu_memory_gb) == ("auto", 1, 80)
    p = s.planner
    assert (p.max_adapters_per_job, p.solver, p.memory_load_factor, p.objective) == (8, "auto", 0.9, "makespan")
    assert s.output.dir == Path.cwd() / "runs"
    assert s.expand() == [AdapterConfig.make(8, 16, 1e-3, 4, 0)]


def test_null_section_means_defaults():
    assert make(model=None, training=None) == make()


def test_scalar_is_a_one_value_list():
    s = make(space={"rank": 16, "learning_rate": "1e-4"})
    assert s.space.rank == [16] and s.space.learning_rate == [1e-4]


def test_objective_defaults_to_the_measured_metric():
    s = make(eval={"metrics": ["loss"]})
    assert s.eval.objective == "loss" and s.eval.minimize


def test_builtin_model_resolves_into_assets():
    s = make(model={"path": "builtin:other-model"})
    assert s.model.resolved_path() == spec_model.ASSETS_DIR / "other-model"


# --------------------------------------------------------------------------- validation

BAD = [
    ({"name": "a b"}, "name"),
    ({"name": None}, "name"),
    ({"model": {"path": "builtin:nope"}}, "model.path"),
    ({"model": {"path": "builtin:"}}, "model.path"),
    ({"model": {"path": "/definitely/not/here"}}, "model.path"),
    ({"model": {"family": "gpt"}}, "model.family"),
    ({"model": {"dtype": "fp8"}}, "model.dtype"),
    ({"model": {"max_seq_len": 4}}, "model.max_seq_len"),
    ({"model": "foo"}, "model"),
    ({"model": {"pth": "x"}}, "model.pth"),
    ({"modle": {}}, "modle"),
    ({"data": {"task": "shift"}}, "data.task"),
    ({"data": {"task": "builtin:nope"}}, "data.task"),
    ({"data": {"train": "missing.jsonl"}}, "data.train"),
    ({"data": {"train": "notes.txt"}}, "data.train"),
    ({"data": {"eval": "e.jsonl"}}, "data.eval"),
    ({"data": {"max_eval_samples": 0}}, "data.max_eval_samples"),
    ({"data": {"num_train": 0}}, "data.num_train"),
    ({"data": {"input_column": ""}}, "data.input_column"),
    ({"lora": {"targets": ["q_proj", "foo"]}}, "lora.targets"),
    ({"lora": {"targets": []}}, "lora.targets"),
    ({"lora": {"targets": "all"}}, "lora.targets"),
    ({"lora": {"dropout": 1.0}}, "lora.dropout"),
    ({"lora": {"dropout": -0.1}}, "lora.dropout"),
    ({"space": {"strategy": "bayes"}}, "space.strategy"),
    ({"space": {"strategy": "random"}}, "space.num_samples"),
    ({"space": {"strategy": "random", "num_samples": 0}}, "space.num_samples"),
    ({"space": {"num_samples": 3}}, "space.num_samples"),
    ({"space": {"seed": -1}}, "space.seed"),
    ({"space": {"seeds_per_config": 0}}, "space.seeds_per_config"),
    ({"space": {"rank": [0]}}, "space.rank"),
    ({"space": {"rank": []}}, "space.rank"),
    ({"space": {"rank": [8, 1.5]}}, "space.rank[1]"),
    ({"space": {"rank": [True]}}, "space.rank"),
    ({"space": {"rank": None}}, "space.rank"),
    ({"space": {"rank": {"low": 0.5, "high": 4, "num": 2}}}, "space.rank.low"),
    ({"space": {"rank": {"low": 4, "high": 16}}}, "space.rank.num"),
    ({"space": {"rank": {"low": 4, "hgh": 16}}}, "space.rank.hgh"),
    ({"space": {"batch_size": [-4]}}, "space.batch_size"),
    ({"space": {"batch_size": {"low": 2, "high": 8.5, "num": 2}}}, "space.batch_size.high"),
    ({"space": {"learning_rate": [0]}}, "space.learning_rate"),
    ({"space": {"learning_rate": [float("nan")]}}, "space.learning_rate[0]"),
    ({"space": {"learning_rate": {"low": -1, "high": 1e-2, "num": 2}}}, "space.learning_rate.low"),
    ({"space": {"learning_rate": {"low": 0, "high": 1e-2, "log": True, "num": 2}}}, "space.learning_rate.low"),
    ({"space": {"learning_rate": {"low": 1e-2, "high": 1e-3, "num": 2}}}, "space.learning_rate.high"),
    ({"space": {"learning_rate": {"low": 1e-3, "high": 1e-2, "num": 0}}}, "space.learning_rate.num"),
    ({"space": {"alpha": [-1]}}, "space.alpha"),
    ({"space": {"alpha": {"relative": [0.5, 0]}}}, "space.alpha.relative"),
    ({"space": {"alpha": {"relative": []}}}, "space.alpha.relative"),
    ({"space": {"strategy": "list"}}, "space.configs"),
    ({"space": {"strategy": "list", "configs": []}}, "space.configs"),
    ({"space": {"configs": [{"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4}]}}, "space.configs"),
    (
        {"space": {"strategy": "list", "rank": [8], "configs": [{"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4}]}},
        "space.rank",
    ),
    (
        {"space": {"strategy": "list", "configs": [
            {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4},
            {"alpha": 16, "learning_rate": 1e-3, "batch_size": 4},
        ]}},
        "space.configs[1].rank",
    ),
    (
        {"space": {"strategy": "list", "configs": [{"rank": 8, "alpha": 16, "learning_rate": 0, "batch_size": 4}]}},
        "space.configs[0].learning_rate",
    ),
    (
        {"space": {"strategy": "list", "configs": [{"rank": 8, "alpha": 16, "learning_rate": 1, "batch_size": 4, "lr": 1}]}},
        "space.configs[0].lr",
    ),
    ({"space": {"rank": {"low": 1, "high": 256, "num": 256}, "learning_rate": {"low": 1e-5, "high": 1, "num": 1000}}}, "space"),
    ({"training": {"epochs": 1, "steps": 10}}, "training"),
    ({"training": {"epochs": 0}}, "training.epochs"),
    ({"training": {"steps": 0}}, "training.steps"),
    ({"training": {"epoch": 2}}, "training.epoch"),
    ({"training": {"warmup_steps": 5, "warmup_ratio": 0.1}}, "training"),
    ({"training": {"warmup_steps": -1}}, "training.warmup_steps"),
    ({"training": {"warmup_ratio": 1.5}}, "training.warmup_ratio"),
    ({"training": {"scheduler": "step"}}, "training.scheduler"),
    ({"training": {"grad_clip": 0}}, "training.grad_clip"),
    ({"training": {"weight_decay": -1}}, "training.weight_decay"),
    ({"training": {"divergence_loss": 0}}, "training.divergence_loss"),
    ({"eval": {"metrics": ["meteor"]}}, "eval.metrics[0]"),
    ({"eval": {"metrics": []}}, "eval.metrics"),
    ({"eval": {"metrics": ["loss", "loss"]}}, "eval.metrics"),
    ({"eval": {"metrics": ["loss"], "objective": "exact_match"}}, "eval.objective"),
    ({"eval": {"max_new_tokens": 0}}, "eval.max_new_tokens"),
    ({"hardware": {"device": "tpu"}}, "hardware.device"),
    ({"hardware": {"gpus": 0}}, "hardware.gpus"),
    ({"hardware": {"gpu_memory_gb": 0}}, "hardware.gpu_memory_gb"),
    ({"planner": {"max_adapters_per_job": 0}}, "planner.max_adapters_per_job"),
    ({"planner": {"solver": "cplex"}}, "planner.solver"),
    ({"planner": {"memory_load_factor": 0}}, "planner.memory_load_factor"),
    ({"planner": {"memory_load_factor": 1.5}}, "planner.memory_load_factor"),
    ({"planner": {"objective": "speed"}}, "planner.objective"),
    ({"training": {"cuda_graphs": "sometimes"}}, "training.cuda_graphs"),
    ({"output": {"dir": None}}, "output.dir"),
]


@pytest.mark.parametrize("data,field", BAD, ids=[f for _, f in BAD])
def test_bad_field_is_named_in_one_line(data, field, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    err = error_of({"name": "t", **data}, tmp_path)
    assert_field(err, field)
    assert isinstance(err, ValueError)


def test_cuda_graphs_take_yaml_switches():
    for text, value in (("off", False), ("on", True), ("auto", "auto"), ("false", False)):
        data = yaml.safe_load(f"name: t\ntraining:\n  cuda_graphs: {text}\n")
        assert parse_spec(data).training.cuda_graphs == value, text
    assert make().training.cuda_graphs == "auto"


def test_missing_name():
    assert_field(error_of({}), "name")
    assert str(error_of({})) == "name: required"


@pytest.mark.parametrize(
    "data,text",
    [
        ({"space": {"learning_rate": {"low": -1, "high": 1e-2, "num": 2}}}, "space.learning_rate.low: must be > 0, got -1"),
        ({"space": {"rank": [0]}}, "space.rank: must be positive integers, got [0]"),
        ({"training": {"epochs": 1, "steps": 10}}, "training: give exactly one of epochs or steps"),
        ({"model": {"path": "/x/y/z"}}, "model.path: directory not found: /x/y/z"),
        ({"model": {"pth": "x"}}, "model.pth: unknown field (did you mean 'path'?)"),
        ({"model": {"path": "builtin:nope"}}, "model.path: unknown built-in model 'nope'; available: other-model, tiny-llama"),
        ({"data": {"task": "builtin:nope"}}, "data.task: unknown built-in task 'nope'; available: reverse, shift"),
    ],
)
def test_exact_messages(data, text):
    assert str(error_of({"name": "t", **data})) == text


def test_unknown_key_without_close_match_lists_the_allowed_ones():
    msg = str(error_of({"name": "t", "hardware": {"zzz": 1}}))
    assert msg == ("hardware.zzz: unknown field; expected one of: device, gpus, gpu_memory_gb, backend, nodes, "
                   "gpus_per_node, ray")


def test_unknown_key_is_reported_before_the_errors_it_causes():
    err = error_of({"name": "t", "space": {"strategy": "random", "num_sample": 4}})
    assert err.field == "space.num_sample"


def test_top_level_must_be_a_mapping():
    assert_field(error_of([1, 2]), "spec")  # type: ignore[arg-type]


def test_local_model_needs_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    err = error_of({"name": "t", "model": {"path": "m"}}, tmp_path)
    assert_field(err, "model.path")
    assert "config.json" in str(err)
    (tmp_path / "m" / "config.json").write_text("{}")
    s = parse_spec({"name": "t", "model": {"path": "m"}}, tmp_path)
    assert s.model.path == str(tmp_path.resolve() / "m") and s.model.resolved_path() == tmp_path.resolve() / "m"


def test_unknown_builtin_model_with_no_assets(monkeypatch, tmp_path):
    monkeypatch.setattr(spec_model, "ASSETS_DIR", tmp_path / "none")
    assert str(error_of({"name": "t"})) == "model.path: unknown built-in model 'tiny-llama'; available: none installed"


def test_any_builtin_task_is_accepted_while_the_tasks_module_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "plora.data.tasks", None)  # makes the import fail
    assert make(data={"task": "builtin:whatever"}).data.task_name == "whatever"


def test_data_files(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for name in ("train.jsonl", "eval.csv"):
        (d / name).write_text("x")
    s = parse_spec({"name": "t", "data": {"train": "data/train.jsonl", "eval": "data/eval.csv"}}, tmp_path)
    assert s.data.train == (d / "train.jsonl").resolve() and s.data.eval == (d / "eval.csv").resolve()
    assert s.data.task is None and s.data.task_name is None
    both = {"name": "t", "data": {"task": "builtin:shift", "train": "data/train.jsonl"}}
    assert_field(error_of(both, tmp_path), "data")
    counted = {"name": "t", "data": {"train": "data/train.jsonl", "num_train": 10}}
    assert_field(error_of(counted, tmp_path), "data.num_train")


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet", ".JSONL"])
def test_supported_data_suffixes(tmp_path, suffix):
    (tmp_path / f"train{suffix}").write_text("x")
    assert parse_spec({"name": "t", "data": {"train": f"train{suffix}"}}, tmp_path).data.train is not None


def test_resolve_targets():
    assert resolve_targets("all-linear") == list(spec_model.KNOWN_TARGETS)
    assert resolve_targets(["v_proj", "q_proj", "v_proj"]) == ["v_proj", "q_proj"]
    assert make(lora={"targets": "all-linear"}).lora.resolved_targets() == list(spec_model.KNOWN_TARGETS)
    assert make(lora={"targets": "q_proj"}).lora.targets == ["q_proj"]
    with pytest.raises(SpecError) as info:
        resolve_targets(["qkv"])
    assert_field(info.value, "lora.targets")


# --------------------------------------------------------------------------- expansion


def test_grid_is_the_cartesian_product_times_seeds():
    s = make(space={
        "rank": [8, 16],
        "alpha": {"relative": [1, 2]},
        "learning_rate": {"low": 1e-4, "high": 1e-2, "num": 3, "log": True},
        "batch_size": [2, 4],
        "seeds_per_config": 2,
        "seed": 7,
    })
    cfgs = s.expand()
    assert len(cfgs) == 2 * 2 * 3 * 2 * 2
    assert {c.seed for c in cfgs} == {7, 8}
    assert {c.learning_rate for c in cfgs} == {1e-4, 1e-3, 1e-2}
    # deterministic order: rank-major, seeds of one config next to each other
    assert [c.rank for c in cfgs[:24]] == [8] * 24
    assert (cfgs[0].seed, cfgs[1].seed) == (7, 8)
    assert cfgs[0].to_dict() | {"id": None} == {
        "id": None, "rank": 8, "alpha": 8.0, "learning_rate": 1e-4, "batch_size": 2, "seed": 7,
    }
    assert s.expand() == cfgs


def test_log_grid_is_clean_and_integer_ranges_round():
    s = make(space={
        "rank": {"low": 4, "high": 64, "log": True, "num": 5},
        "learning_rate": {"low": 1e-5, "high": 1e-2, "log": True, "num": 4},
        "batch_size": {"low": 1, "high": 4, "num": 3},
    })
    assert s.space.values("rank") == [4, 8, 16, 32, 64]
    assert s.space.values("learning_rate") == [1e-5, 1e-4, 1e-3, 1e-2]
    assert s.space.values("batch_size") == [1, 3, 4]  # 2.5 rounds up
    assert len(s.expand()) == 5 * 4 * 3
    assert all(isinstance(c.rank, int) and isinstance(c.batch_size, int) for c in s.expand())


def test_rounding_duplicates_collapse():
    s = make(space={"rank": {"low": 1, "high": 2, "num": 5}})
    assert s.space.values("rank") == [1, 2]
    assert len(s.expand()) == 2


def test_alpha_relative_to_rank():
    s = make(space={"rank": [4, 16], "alpha": {"relative": [0.5, 2]}})
    assert sorted((c.rank, c.alpha) for c in s.expand()) == [(4, 2.0), (4, 8.0), (16, 8.0), (16, 32.0)]
    assert sorted({c.scale for c in s.expand()}) == [0.5, 2.0]


def test_alpha_absolute_range():
    s = make(space={"alpha": {"low": 8, "high": 32, "num": 3}})
    assert [c.alpha for c in s.expand()] == [8.0, 20.0, 32.0]


RANDOM = {
    "strategy": "random",
    "num_samples": 30,
    "seed": 3,
    "rank": {"low": 4, "high": 64, "log": True},
    "alpha": {"relative": [1, 2]},
    "learning_rate": {"low": 1e-5, "high": 1e-2, "log": True},
    "batch_size": [2, 4, 8],
}


def test_random_count_ranges_and_reproducibility():
    a = make(space=RANDOM).expand()
    assert len(a) == 30 and len({c.id for c in a}) == 30
    assert all(4 <= c.rank <= 64 and 1e-5 <= c.learning_rate <= 1e-2 for c in a)
    assert all(c.batch_size in (2, 4, 8) and c.alpha / c.rank in (1, 2) and c.seed == 3 for c in a)
    assert make(space=RANDOM).expand() == a
    assert make(space={**RANDOM, "seed": 4}).expand() != a


def test_random_seeds_per_config():
    cfgs = make(space={**RANDOM, "num_samples": 5, "seeds_per_config": 3}).expand()
    assert len(cfgs) == 15 and [c.seed for c in cfgs[:3]] == [3, 4, 5]


def test_random_in_a_small_space_gives_every_config_once():
    cfgs = make(space={"strategy": "random", "num_samples": 50, "rank": [4, 8], "batch_size": [1, 2]}).expand()
    assert sorted((c.rank, c.batch_size) for c in cfgs) == [(4, 1), (4, 2), (8, 1), (8, 2)]


def test_random_range_with_num_draws_among_its_points():
    s = make(space={"strategy": "random", "num_samples": 40, "learning_rate": {"low": 1e-4, "high": 1e-2, "log": True, "num": 3}})
    assert {c.learning_rate for c in s.expand()} <= {1e-4, 1e-3, 1e-2}


def test_list_strategy_keeps_order_and_refuses_duplicates():
    configs = [
        {"rank": 16, "alpha": 32, "learning_rate": 2e-4, "batch_size": 8},
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4},
    ]
    cfgs = make(space={"strategy": "list", "configs": configs, "seeds_per_config": 2}).expand()
    assert [(c.rank, c.seed) for c in cfgs] == [(16, 0), (16, 1), (8, 0), (8, 1)]
    # `list` trains exactly the entries given: an entry equal to an earlier one is refused
    same = {"rank": 16, "alpha": 32.0, "learning_rate": 0.0002, "batch_size": 8}
    err = error_of({"name": "t", "space": {"strategy": "list", "configs": [*configs, same], "seeds_per_config": 2}})
    assert_field(err, "space.configs[2]")
    assert "same configuration as space.configs[0]" in str(err)


def test_summary_counts():
    s = make(space={"rank": [4, 8], "learning_rate": [1e-3, 1e-4, 1e-5], "seeds_per_config": 2})
    summ = s.summary()
    assert summ["adapters"] == 12 and summ["configs"] == 6 and summ["strategy"] == "grid"
    assert summ["rank"] == {4: 6, 8: 6} and summ["seed"] == {0: 6, 1: 6}
    assert sum(summ["learning_rate"].values()) == 12


# --------------------------------------------------------------------------- ids and helpers


def test_ids_are_stable_and_unique():
    cfg = AdapterConfig.make(8, 16, 1e-3, 4, 0)
    # pinned: a changed id would orphan every existing run directory
    assert cfg.id == AdapterConfig.make_id(8, 16.0, 0.001, 4, 0)
    assert cfg.id.startswith("a-") and len(cfg.id) == 12
    assert cfg.id == "a-" + __import__("hashlib").sha1(
        b'{"alpha":16.0,"batch_size":4,"learning_rate":0.001,"rank":8,"seed":0}'
    ).hexdigest()[:10]
    assert AdapterConfig.make(8, 16, 0.1 + 0.2, 4, 0) == AdapterConfig.make(8, 16, 0.3, 4, 0)
    ids = [c.id for c in make(space={**RANDOM, "num_samples": 100}).expand()]
    assert len(set(ids)) == len(ids)
    assert len({AdapterConfig.make(8, 16, 1e-3, 4, s).id for s in range(10)}) == 10


def test_adapter_config_is_hashable_and_round_trips():
    cfg = AdapterConfig.make(8, 16, 1e-3, 4, 1)
    assert cfg.scale == 2.0
    assert len({cfg, AdapterConfig.make(8, 16, 1e-3, 4, 1)}) == 1
    assert AdapterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        AdapterConfig.from_dict({**cfg.to_dict(), "id": "a-0000000000"})
    with pytest.raises(AttributeError):
        cfg.rank = 4  # type: ignore[misc]


def test_steps_for():
    cfg = AdapterConfig.make(8, 16, 1e-3, 4, 0)
    assert make().steps_for(cfg, 100) == 25
    assert make().steps_for(cfg, 101) == 26
    assert make(training={"epochs": 0.3}).steps_for(AdapterConfig.make(8, 16, 1e-3, 3, 0), 10) == 1  # 0.3*10/3 = 1 exactly
    assert make(training={"epochs": 2.5}).steps_for(cfg, 10) == 7
    assert make(training={"steps": 40}).steps_for(cfg, 10) == 40


def test_warmup_for():
    assert make(training={"warmup_steps": 5}).training.warmup_for(100) == 5
    assert make(training={"warmup_ratio": 0.1}).training.warmup_for(55) == 6  # rounded up, as the job does
    assert make().training.warmup_for(100) == 0


def test_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = parse_spec({"name": "demo", "output": {"dir": "out"}}, tmp_path / "sweeps")
    assert s.run_dir() == tmp_path.resolve() / "out" / "demo"  # output.dir follows the working directory
    assert s.run_dir(tmp_path / "elsewhere") == (tmp_path / "elsewhere").resolve()


# --------------------------------------------------------------------------- files and round trip


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_relative_paths_resolve_against_the_space_file(tmp_path, monkeypatch):
    write(tmp_path / "proj/data/train.parquet", "x")
    write(tmp_path / "proj/model/config.json", "{}")
    f = write(tmp_path / "proj/sweeps/s.yaml", "name: s\nmodel: {path: ../model}\ndata: {train: ../data/train.parquet}\n"
              "output: {dir: out}\n")
    monkeypatch.chdir(tmp_path)
    s = load_spec(f)
    proj = (tmp_path / "proj").resolve()
    assert load_spec(write(tmp_path / "proj/sweeps/d.yaml", "name: d\n")).run_dir() == tmp_path.resolve() / "runs/d"
    assert s.model.path == str(proj / "model")
    assert s.data.train == proj / "data/train.parquet"
    assert s.run_dir() == tmp_path.resolve() / "out/s"  # output.dir: the working directory, not the file's


def _round_trip(s: SweepSpec, tmp_path: Path) -> None:
    text = s.to_yaml()
    assert parse_spec(yaml.safe_load(text)) == s
    other = tmp_path / "elsewhere"
    assert load_spec(write(other / "spec.yaml", text)) == s
    assert parse_spec(yaml.safe_load(text)).to_yaml() == text


@pytest.mark.parametrize(
    "space",
    [
        {},
        RANDOM,
        {"rank": {"low": 4, "high": 64, "log": True, "num": 5}, "alpha": [16, 32.5], "learning_rate": [1e-5, 3e-4]},
        {"strategy": "list", "configs": [{"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4}]},
    ],
    ids=["default", "random", "grid", "list"],
)
def test_to_yaml_round_trip(space, tmp_path):
    s = make(space=space, training={"steps": 20, "warmup_ratio": 0.1}, eval={"metrics": ["loss"]})
    _round_trip(s, tmp_path)
    assert s.expand() == parse_spec(yaml.safe_load(s.to_yaml())).expand()


def test_to_yaml_round_trip_with_files(tmp_path):
    write(tmp_path / "train.csv", "x")
    write(tmp_path / "m/config.json", "{}")
    s = load_spec(write(tmp_path / "s.yaml", "name: s\nmodel: {path: m}\ndata: {train: train.csv}\n"))
    text = s.to_yaml()
    assert str(tmp_path.resolve() / "train.csv") in text
    _round_trip(s, tmp_path)


def test_exponent_without_a_dot_is_a_number(tmp_path):
    # YAML 1.1 reads 1e-3 as a string; the spec must still take it as 0.001.
    s = load_spec(write(tmp_path / "s.yaml", "name: s\nspace:\n  learning_rate: [1e-3, 5e-4]\n"))
    assert s.space.learning_rate == [1e-3, 5e-4]


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    f = write(tmp_path / "bad.yaml", "name: s\nspace:\n  rank: [8, 16\n  alpha: [16]\n")
    with pytest.raises(SpecError) as info:
        load_spec(f)
    msg = str(info.value)
    assert msg.startswith(f"{f}: invalid YAML at line ") and "\n" not in msg


def test_yaml_duplicate_key(tmp_path):
    f = write(tmp_path / "dup.yaml", "name: s\nspace:\n  rank: [8]\n  rank: [16]\n")
    with pytest.raises(SpecError, match=r"invalid YAML at line 4: duplicate key 'rank'"):
        load_spec(f)


@pytest.mark.parametrize("text,needle", [("", "empty file"), ("- 1\n- 2\n", "got list"), ("just text\n", "got str")])
def test_top_level_not_a_mapping(tmp_path, text, needle):
    f = write(tmp_path / "s.yaml", text)
    with pytest.raises(SpecError) as info:
        load_spec(f)
    assert str(info.value).startswith(f"{f}: top level must be a mapping") and needle in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "nope.yaml")
    assert str(info.value) == f"{tmp_path / 'nope.yaml'}: file not found"
    with pytest.raises(SpecError, match="not a file"):
        load_spec(tmp_path)


def test_field_error_from_a_file(tmp_path):
    f = write(tmp_path / "s.yaml", "name: s\ntraining:\n  epochs: 1\n  steps: 5\n")
    with pytest.raises(SpecError, match=r"^training: give exactly one of epochs or steps$"):
        load_spec(f)


def test_example_file_uses_every_field_and_loads():
    path = REPO / "sweeps" / "example-full.yaml"
    s = load_spec(path)
    assert len(s.expand()) == 2 * 2 * 2
    raw = yaml.safe_load(path.read_text())
    for section in spec._SECTIONS:
        given = set(raw[section])
        if section == "data":  # task and train are exclusive: train/eval appear commented out
            given |= {"train", "eval"}
        assert given == set(getattr(SweepSpec.model_fields[section].annotation, "model_fields")), section
    assert math.isclose(s.space.values("learning_rate")[0], 1e-4)


# --------------------------------------------------------------------------- rank limit


def test_rank_over_the_kernels_limit_is_a_spec_error():
    base = {"model": {"path": "builtin:tiny-llama"}, "data": {"task": "builtin:shift"}}
    space = {"alpha": [16], "learning_rate": [1e-3], "batch_size": [4]}
    err = error_of({"name": "t", **base, "space": {**space, "rank": [8, 512]}})
    assert_field(err, "space.rank")
    assert "at most 256" in str(err)
    err = error_of({"name": "t", **base, "space": {**space, "rank": {"low": 8, "high": 300}}})
    assert_field(err, "space.rank.high")
    make(**base, space={**space, "rank": [256]})  # the limit itself is fine


def test_the_rank_limit_is_the_kernels():
    import plora.kernels

    assert spec_adapter.MAX_RANK == plora.kernels.MAX_RANK
