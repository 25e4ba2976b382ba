"""Experiment tracking (the space file's ``logging`` section, `plora.tracking`): a TensorBoard
run and a W&B run per adapter, with its loss curve, eval metrics and hyperparameters."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from plora.results.adapter_spans import read_jsonl
from plora.cli import app
from plora.tracking.forward import TRACKED_FILE, Tracker
from test_cli import small_space

runner = CliRunner()


def _losses(run: Path, adapter: str, name: str = "metrics.jsonl", key: str = "loss") -> dict[int, float]:
    """An adapter's values by its own step, as its job wrote them."""
    out = {}
    for job in (run / "jobs").iterdir():
        for r in read_jsonl(job / name):
            if r.get("adapter") == adapter:
                out[int(r["adapter_step"])] = float(r[key])
    return out


def test_tensorboard_run_per_adapter_with_its_curve_metrics_and_hyperparameters(swept_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    frame = pd.read_parquet(swept_run.run / "results.parquet")
    root = swept_run.run / "tensorboard"
    assert sorted(p.name for p in root.iterdir()) == sorted(frame.adapter_id)
    for row in frame.to_dict("records"):
        events = EventAccumulator(str(root / row["adapter_id"]))
        events.Reload()
        curve = {e.step: e.value for e in events.Scalars("train/loss")}
        want = _losses(swept_run.run, row["adapter_id"])
        assert len(want) == 6 and curve == pytest.approx(want)
        evals = {e.step: e.value for e in events.Scalars("eval/loss")}  # eval.every_steps: 3
        assert evals == pytest.approx(_losses(swept_run.run, row["adapter_id"], "evals.jsonl", "eval_loss")) and evals
        for metric in ("eval_loss", "eval_perplexity", "eval_rouge_l", "eval_bleu", "train_loss"):
            [last] = events.Scalars(metric)
            assert last.value == pytest.approx(row[metric]) and last.step == 5
        content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
        assert hparams["rank"].number_value == row["rank"] and hparams["batch_size"].number_value == row["batch_size"]
        assert hparams["learning_rate"].number_value == pytest.approx(row["learning_rate"])
        assert hparams["status"].string_value == "done"


def _wandb_records(path: Path):
    """The records of an offline W&B run file: a LevelDB-style log (7-byte header, 32 KiB
    blocks, records of a 4-byte checksum, 2-byte length and 1-byte kind) of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # the rest of the block is padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def _key(item) -> str:
    """A history, summary or config item's name (W&B writes it whole or as a nested path)."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_per_adapter_with_its_config_and_curve(swept_run):
    pytest.importorskip("wandb")
    frame = pd.read_parquet(swept_run.run / "results.parquet").set_index("adapter_id")
    runs = {}
    for path in (swept_run.run / "wandb").glob("offline-run-*/run-*.wandb"):
        config, history, summary, meta = {}, {}, {}, None
        for r in _wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                meta = r.run
                config.update({_key(u): json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "history":
                items = {_key(i): json.loads(i.value_json) for i in r.history.item}
                history[items["_step"]] = items
            elif kind == "summary":
                summary.update({_key(u): json.loads(u.value_json) for u in r.summary.update})
        runs[meta.display_name] = (meta, config, history, summary)
    assert sorted(runs) == sorted(frame.index)
    for adapter, (meta, config, history, summary) in runs.items():
        row = frame.loc[adapter]
        assert meta.project == "plora-tests" and meta.run_group == "swept" and meta.job_type == "adapter"
        assert {k: config[k] for k in ("rank", "alpha", "batch_size", "seed")} == \
            {"rank": row["rank"], "alpha": row["alpha"], "batch_size": row["batch_size"], "seed": row["seed"]}
        assert config["learning_rate"] == pytest.approx(row["learning_rate"]) and config["adapter_id"] == adapter
        assert {s: h["train/loss"] for s, h in history.items()} == pytest.approx(_losses(swept_run.run, adapter))
        assert summary["eval_perplexity"] == pytest.approx(row["eval_perplexity"]) and summary["status"] == "done"


def test_each_adapter_is_sent_once(swept_run):
    """A resumed sweep, or the next batch of `plora tune`, sends only what is new."""
    sent = read_jsonl(swept_run.run / TRACKED_FILE)
    trackers = {t for t in ("tensorboard", "wandb") if importlib.util.find_spec(t) is not None}  # as swept_run
    if not trackers:
        pytest.skip("neither tensorboard nor wandb is installed")
    ids = sorted(pd.read_parquet(swept_run.run / "results.parquet").adapter_id)
    assert sorted((r["tracker"], r["adapter"]) for r in sent) == sorted((t, a) for t in trackers for a in ids)

    class Counting:
        name = sorted(trackers)[0]
        calls: list = []

        def log_adapter(self, record) -> None:
            self.calls.append(record.adapter_id)

    tracker = Tracker(swept_run.run, [Counting()])
    tracker.close(ids)
    assert Counting.calls == []


@pytest.mark.parametrize("tracker, module, extra", [
    ({"tensorboard": True}, "tensorboard", "plora[tensorboard]"),
    ({"wandb": {"mode": "offline"}}, "wandb", "plora[wandb]"),
    ({"wandb": True}, "wandb", "plora[wandb]"),
])
def test_a_missing_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, tracker, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    field = "logging." + next(iter(tracker))
    result = runner.invoke(app, ["sweep", str(small_space(tmp_path, logging=tracker))], terminal_width=200)
    assert result.exit_code == 2
    text = result.output.strip()
    assert text == f'error: {field}: needs the {module} package: pip install "{extra}"'
    assert not (tmp_path / "runs").exists()


def test_unknown_logging_settings_are_refused_by_name(tmp_path):
    result = runner.invoke(app, ["sweep", str(small_space(tmp_path, logging={"wandb": {"projct": "x"}}))])
    assert result.exit_code == 2 and result.output.strip() == \
        "error: logging.wandb.projct: unknown field (did you mean 'project'?)"
    result = runner.invoke(app, ["plan", str(small_space(tmp_path)), "logging.mlflow=true"])
    assert result.exit_code == 2 and result.output.strip().startswith("error: logging.mlflow: unknown field")
