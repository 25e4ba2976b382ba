"""Model folders are checked before anything runs; model errors inside a job are not retried."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from plora.cli import app
from plora.engine.journal import Journal
from plora.models.check import check_model
from plora.models.loading import ASSETS, ModelError

runner = CliRunner()
TINY = ASSETS / "tiny-llama"


def model_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    return folder


def space(tmp_path: Path, model_path: str, **model) -> Path:
    data = {
        "name": "mc",
        "model": {"path": model_path, "max_seq_len": 48, **model},
        "data": {"task": "builtin:shift", "num_train": 16, "num_eval": 4},
        "lora": {"targets": ["q_proj", "v_proj"]},
        "space": {"strategy": "list", "configs": [
            {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
            {"rank": 4, "alpha": 4, "learning_rate": 3e-3, "batch_size": 4},
        ]},
        "training": {"epochs": 1},
        "eval": {"max_new_tokens": 4, "metrics": ["loss"]},
        "hardware": {"device": "cpu"},
        "planner": {"max_adapters_per_job": 2},
        "output": {"dir": str(tmp_path / "runs")},
    }
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _not_json(f: Path) -> str:
    (f / "config.json").write_text("{'model_type': 'llama'}")
    return "config.json: not valid JSON"


def _no_tokenizer(f: Path) -> str:
    (f / "tokenizer.json").unlink()
    return "no tokenizer.json"


def _no_weights(f: Path) -> str:
    (f / "model.safetensors").unlink()
    return "no *.safetensors weights"


def _unsupported(f: Path) -> str:
    cfg = json.loads((f / "config.json").read_text())
    (f / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    return "model_type 'gpt2' is not supported"


def _missing_field(f: Path) -> str:
    cfg = json.loads((f / "config.json").read_text())
    del cfg["hidden_size"]
    (f / "config.json").write_text(json.dumps(cfg))
    return "config.json: missing 'hidden_size'"


def _renamed_weight(f: Path) -> str:
    state = load_file(str(f / "model.safetensors"))
    state["model.layers.0.mlp.upproj.weight"] = state.pop("model.layers.0.mlp.up_proj.weight")
    save_file(state, str(f / "model.safetensors"))
    return "unexpected weight 'model.layers.0.mlp.upproj.weight'"


def _dropped_weight(f: Path) -> str:
    state = load_file(str(f / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(f / "model.safetensors"))
    return "lack 1 tensor(s) the llama model needs: layers.1.attn.k_proj.weight"


def _wrong_shape(f: Path) -> str:
    cfg = json.loads((f / "config.json").read_text())
    (f / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}))
    return "has shape"


def _index_names_missing_shard(f: Path) -> str:
    (f / "model.safetensors").rename(f / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (f / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model-00002-of-00002.safetensors"


def _truncated_weights(f: Path) -> str:
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(data[:40])
    return "not a readable safetensors file"


BREAKAGES = [_not_json, _no_tokenizer, _no_weights, _unsupported, _missing_field, _renamed_weight, _dropped_weight,
             _wrong_shape,
             _index_names_missing_shard, _truncated_weights]


def test_the_shipped_model_passes():
    info = check_model("builtin:tiny-llama")
    assert info.family == "llama"


def test_a_folder_that_passed_is_not_built_again_until_its_files_change(tmp_path, monkeypatch):
    import plora.models.check as mc

    folder = model_copy(tmp_path)
    check_model(folder)
    mc._check_folder.cache_clear()

    def no_build(*_a, **_k):
        raise AssertionError("built again")

    monkeypatch.setattr("plora.models.loading.build_on_meta", no_build)
    assert check_model(folder).family == "llama"  # remembered: torchtune is not needed for it
    config = folder / "config.json"
    config.write_text(config.read_text() + "\n")  # a changed file is checked again
    mc._check_folder.cache_clear()
    with pytest.raises(AssertionError, match="built again"):
        check_model(folder)


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda f: f.__name__.strip("_"))
def test_a_broken_folder_is_one_line_naming_the_problem(tmp_path, breakage):
    folder = model_copy(tmp_path)
    expected = breakage(folder)
    with pytest.raises(ModelError) as err:
        check_model(folder)
    assert expected in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("command", ["plan", "sweep", "profile"])
@pytest.mark.parametrize("breakage", [_not_json, _no_weights, _renamed_weight], ids=lambda f: f.__name__.strip("_"))
def test_cli_refuses_a_broken_model_before_writing_anything(tmp_path, command, breakage):
    folder = model_copy(tmp_path)
    expected = breakage(folder)
    result = runner.invoke(app, [command, str(space(tmp_path, str(folder)))])
    assert result.exit_code == 2, result.output
    assert "model.path" in result.output and expected in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


def test_random_init_shapes_need_no_weights(tmp_path):
    folder = model_copy(tmp_path)
    _no_weights(folder)
    assert check_model(folder, random_init=True).family == "llama"
    result = runner.invoke(app, ["plan", str(space(tmp_path, "shape:qwen2.5-0.5b"))])
    assert result.exit_code == 0, result.output


def test_a_missing_gguf_file_is_refused(tmp_path):
    result = runner.invoke(app, ["plan", str(space(tmp_path, str(tmp_path / "nope.gguf")))])
    assert result.exit_code == 2 and "GGUF file not found" in result.output
    assert not (tmp_path / "runs").exists()


def test_a_model_error_inside_a_job_fails_its_adapters_at_once(tmp_path):
    """Weights that vanish after validation: the job exits 4 and is not retried."""
    from plora.spec.loading import load_spec
    from plora.sweep import prepare, run_prepared, write_run_files

    folder = model_copy(tmp_path)
    prep = prepare(load_spec(space(tmp_path, str(folder))))
    write_run_files(prep)
    _no_weights(folder)
    frame = run_prepared(prep, slots=["cpu:0"], max_retries=2)
    assert set(frame.status) == {"failed"}
    assert frame.reason.str.contains("no \\*.safetensors weights").all(), frame.reason.tolist()
    journal = Journal(prep.run_dir / "journal.sqlite")
    try:
        launched = [subject for _, kind, subject, _ in journal.events() if kind == "launch"]
        assert not [1 for _, kind, _, _ in journal.events() if kind == "retry"]
        assert {r.returncode for r in journal.jobs()} == {4}
    finally:
        journal.close()
    assert len(launched) == len(prep.plan.jobs)


def test_a_sweeps_model_check_builds_the_model_while_the_caller_goes_on(tmp_path, monkeypatch):
    """The slow part (the model built on meta: torchtune's import) runs on a thread; the
    quick checks still raise at once, and the slow part's problem is raised by the wait."""
    import threading

    import plora.models.check as mc
    from plora.spec.base import SpecError
    from plora.spec.loading import load_spec

    folder = model_copy(tmp_path)
    spec = load_spec(space(tmp_path, str(folder)))
    release, building = threading.Event(), threading.Event()
    from plora.models.loading import build_on_meta as real_build

    def slow_build(*a, **k):
        building.set()
        assert release.wait(30)
        return real_build(*a, **k)

    monkeypatch.setattr("plora.models.loading.build_on_meta", slow_build)
    mc._check_folder.cache_clear()
    wait = mc.start_spec_model_check(spec)  # returns while the model is still being built
    assert building.wait(30)
    release.set()
    assert wait().family == "llama"

    mc._check_folder.cache_clear()

    def no_build(*_a, **_k):
        raise AssertionError("built again")

    monkeypatch.setattr("plora.models.loading.build_on_meta", no_build)
    assert mc.start_spec_model_check(spec)().family == "llama"  # passed before: nothing left to run
    monkeypatch.setattr("plora.models.loading.build_on_meta", real_build)

    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copytree(TINY, broken / "model")
    _renamed_weight(broken / "model")
    mc._check_folder.cache_clear()
    wait = mc.start_spec_model_check(load_spec(space(broken, str(broken / "model"))))
    with pytest.raises(SpecError, match="model.path"):
        wait()
    _not_json(broken / "model")
    with pytest.raises(SpecError, match="not valid JSON"):  # a quick check: raised at the start
        mc.start_spec_model_check(load_spec(space(broken, str(broken / "model"))))


def test_a_sweep_refused_before_planning_leaves_no_model_check_behind(tmp_path):
    """A later command of the same process never waits for (or reports) this space's check."""
    import plora.cli as cli

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    path = space(tmp_path, str(model_copy(tmp_path)))
    data = yaml.safe_load(path.read_text())
    data["output"] = {"dir": str(blocker / "runs")}
    path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2, result.output
    assert cli._PENDING_CHECK == []
