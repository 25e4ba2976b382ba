"""`plora export`: a run's adapter as a self-contained PEFT folder (with the base model's
tokenizer and chat template) or as a merged Hugging Face model, each loadable as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import CHAT_TEMPLATE
from plora.cli import app

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

runner = CliRunner()


def _export(*args: str):
    return runner.invoke(app, ["export", *map(str, args)], terminal_width=200)


def _results(run: Path) -> pd.DataFrame:
    return pd.read_parquet(run / "results.parquet")


def _tokens() -> torch.Tensor:
    return torch.randint(4, 40, (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=x).logits


def _fails_with(result, start: str) -> None:
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert len(text.splitlines()) == 1 and text.startswith(start), text
    assert "Traceback" not in text


def test_best_adapter_as_a_peft_folder_with_the_tokenizer_and_chat_template(swept_run, tmp_path):
    frame = _results(swept_run.run)
    best = frame.sort_values("eval_perplexity").adapter_id.iloc[0]  # the objective: lower is better
    out = tmp_path / "best"
    result = _export(swept_run.run, "--best", "-o", out)
    assert result.exit_code == 0, result.output
    assert best in result.output and str(out) in result.output.replace("\n", "")
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok("abc>")["input_ids"] == transformers.AutoTokenizer.from_pretrained(swept_run.model)("abc>")["input_ids"]
    x = _tokens()
    base = transformers.AutoModelForCausalLM.from_pretrained(swept_run.model)
    want = _logits(peft.PeftModel.from_pretrained(base, str(swept_run.run / "adapters" / best)), x)
    base = transformers.AutoModelForCausalLM.from_pretrained(swept_run.model)
    got = _logits(peft.PeftModel.from_pretrained(base, str(out)), x)
    assert torch.equal(want, got)
    assert float((got - _logits(transformers.AutoModelForCausalLM.from_pretrained(swept_run.model), x)).abs().max()) > 1e-4


def test_merged_export_loads_alone_and_gives_base_plus_adapter_logits(swept_run, tmp_path):
    adapter = _results(swept_run.run).adapter_id.iloc[1]
    out = tmp_path / "merged"
    result = _export(swept_run.run, adapter, "--merge", "-o", out)
    assert result.exit_code == 0, result.output
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert not (out / "adapter_config.json").exists()

    x = _tokens()
    base = transformers.AutoModelForCausalLM.from_pretrained(swept_run.model)
    want = _logits(peft.PeftModel.from_pretrained(base, str(swept_run.run / "adapters" / adapter)), x)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert float((_logits(merged, x) - want).abs().max()) < 1e-4
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == merged.config.eos_token_id


def test_all_adapters_each_in_a_folder(swept_run, tmp_path):
    result = _export(swept_run.run, "--all", "-o", tmp_path / "all")
    assert result.exit_code == 0, result.output
    ids = sorted(_results(swept_run.run).adapter_id)
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ids
    for a in ids:
        assert json.loads((tmp_path / "all" / a / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_best_follows_greater_is_better(swept_run, tmp_path):
    """The same run ranked the other way round (``eval.greater_is_better: true``) exports the
    other adapter: --best follows the sweep's direction, not a fixed one."""
    run = tmp_path / "run"
    shutil.copytree(swept_run.run, run, ignore=shutil.ignore_patterns("wandb", "tensorboard", "jobs", "*.sqlite"))
    spec = yaml.safe_load((run / "spec.yaml").read_text())
    spec["eval"]["greater_is_better"] = True
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    worst = _results(run).sort_values("eval_perplexity").adapter_id.iloc[-1]
    result = _export(run, "--best", "-o", tmp_path / "best")
    assert result.exit_code == 0 and worst in result.output, result.output


def test_bad_requests_are_one_line_exit_2_nothing_written(swept_run, tmp_path):
    adapter = _results(swept_run.run).adapter_id.iloc[0]
    _fails_with(_export(swept_run.run, "-o", tmp_path / "x"), "error: ADAPTER_ID, --best, --all: give exactly one")
    _fails_with(_export(swept_run.run, adapter, "--best", "-o", tmp_path / "x"), "error: ADAPTER_ID, --best, --all")
    _fails_with(_export(swept_run.run, "a-0000000000", "-o", tmp_path / "x"), "error: ADAPTER_ID: no adapter 'a-0000000000'")
    _fails_with(_export(tmp_path, "--best"), f"error: {tmp_path}: not a run directory (no spec.yaml)")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    _fails_with(_export(swept_run.run, adapter, "-o", taken), f"error: --output: {taken} exists and is not an empty folder")
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("")
    _fails_with(_export(swept_run.run, adapter, "-o", tmp_path / "file" / "sub"), "error: --output: cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "taken"]  # no partial folder left anywhere
    assert not (swept_run.run / "exports").exists()


def test_an_adapter_without_weights_is_refused(swept_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(swept_run.run, run, ignore=shutil.ignore_patterns("wandb", "tensorboard", "jobs", "*.sqlite"))
    adapter = _results(run).adapter_id.iloc[0]
    (run / "adapters" / adapter / "adapter_model.safetensors").unlink()  # as a diverged adapter has none
    _fails_with(_export(run, adapter), f"error: ADAPTER_ID: {adapter} has no saved weights to export (status done)")
    result = _export(run, "--all")
    assert result.exit_code == 0 and adapter not in result.output, result.output


def test_a_random_init_base_model_is_not_merged(swept_run, tmp_path):
    """A ``shape:`` model was drawn at random and never saved: its adapter exports, but there
    is no base to merge it into."""
    run = tmp_path / "run"
    adapter = _results(swept_run.run).adapter_id.iloc[0]
    shutil.copytree(swept_run.run / "adapters" / adapter, run / "adapters" / adapter)
    (run / "spec.yaml").write_text(yaml.safe_dump({"name": "shaped", "model": {"path": "shape:qwen2.5-0.5b"}}))
    _fails_with(_export(run, adapter, "--merge"), "error: --merge: the base model shape:qwen2.5-0.5b is random-init")
    assert not (run / "exports").exists()
    result = _export(run, adapter)
    assert result.exit_code == 0, result.output
    assert (run / "exports" / adapter / "adapter_model.safetensors").is_file()
