"""Data and models as users have them (issue 46): ShareGPT rows, folders written by
`datasets`' ``save_to_disk``, and Hub model ids read from the local Hugging Face cache.
Each through the `plora` command, bad input included: one line naming the field, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import TINY_MODEL, tiny_space_file
from plora.cli import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "plora" / "assets" / "tiny-llama"
#: a chat template in the shipped model's alphabet: user turns end with "=", assistant turns with eos
TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
            "{% else %}{{ m.content }}={% endif %}{% endfor %}")


def write_space(tmp_path: Path, data: dict, model: str = TINY_MODEL, name: str = "space.yaml") -> Path:
    return tiny_space_file(tmp_path, name, model_path=model, max_seq_len=32, data=data, lora=None,
                           space={"rank": [2], "batch_size": [2]}, training={"steps": 2}, eval={"metrics": ["loss"]})


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert len(text.splitlines()) == 1 and text.startswith("error: ") and "Traceback" not in text, text
    return text


def dry_run(space: Path):
    result = runner.invoke(app, ["sweep", str(space), "--dry-run"])
    assert result.exit_code == 0, result.output
    return result


# --------------------------------------------------------------------------- ShareGPT rows


@pytest.fixture
def chat_model(tmp_path) -> Path:
    folder = tmp_path / "tiny-chat"
    shutil.copytree(SHIPPED, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def sharegpt(tmp_path: Path, column: str = "conversations", turns: list | None = None) -> Path:
    rows = [{column: turns or [{"from": "system", "value": "rotate"}, {"from": "human", "value": s + "+"},
                               {"from": "gpt", "value": s[1:] + s[0]}]} for s in ("abcd", "hello", "xyz", "plora")]
    path = tmp_path / f"{column}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def samples(space: Path):
    from plora.data.dataset import TextTokenizer, prepare_data
    from plora.data.check import data_config, eval_config
    from plora.models.loading import read_model_info
    from plora.spec.loading import load_spec

    spec = load_spec(space)
    info = read_model_info(spec.model.resolved_path())
    tok = TextTokenizer(info.path, info.eos_token_id, info.pad_token_id)
    return [(s.tokens, s.labels) for s in prepare_data(data_config(spec), eval_config(spec), tok, 32).train]


def test_sharegpt_rows_train_as_the_chat_rows_they_stand_for(tmp_path, chat_model):
    """Detected from the conversations column, named as the format, or read by chat from a
    column of {from, value} turns: the same tokens and labels as {role, content} messages."""
    rows = sharegpt(tmp_path)
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    messages = tmp_path / "messages.jsonl"
    messages.write_text("".join(json.dumps({"messages": [{"role": roles[t["from"]], "content": t["value"]}
                                                         for t in json.loads(line)["conversations"]]}) + "\n"
                                for line in rows.read_text().splitlines()))
    want = samples(write_space(tmp_path, {"train": str(messages)}, str(chat_model), "m.yaml"))
    for data in ({"train": str(rows)}, {"train": str(rows), "format": "sharegpt"},
                 {"train": str(rows), "format": "chat", "messages_column": "conversations"},
                 {"train": str(sharegpt(tmp_path, "dialog")), "format": "sharegpt", "conversations_column": "dialog"}):
        space = write_space(tmp_path, data, str(chat_model))
        dry_run(space)
        assert samples(space) == want, data
    user_assistant = sharegpt(tmp_path, turns=[{"from": "user", "value": "ab+"}, {"from": "assistant", "value": "ba"}])
    dry_run(write_space(tmp_path, {"train": str(user_assistant)}, str(chat_model)))


@pytest.mark.parametrize("turn, message", [
    ({"from": "bot", "value": "ba"}, "message 1 is from 'bot' (expected one of human, gpt, system, user, assistant, tool)"),
    ({"speaker": "gpt", "text": "ba"}, "message 1 is not a {role, content} or {from, value} object"),
    ({"from": "gpt", "value": None}, "message 1 (assistant) has null content: no answer"),
])
def test_bad_sharegpt_turns_are_one_line(tmp_path, chat_model, turn, message):
    rows = sharegpt(tmp_path, turns=[{"from": "human", "value": "ab+"}, turn])
    text = one_error_line(runner.invoke(app, ["sweep", str(write_space(tmp_path, {"train": str(rows)}, str(chat_model)))]))
    assert text.startswith(f"error: data.train: {rows} line 1, column 'conversations': {message}"), text
    assert not (tmp_path / "runs").exists()


def test_sharegpt_with_a_prompt_template_is_refused(tmp_path, chat_model):
    space = write_space(tmp_path, {"train": str(sharegpt(tmp_path)), "format": "sharegpt", "prompt_template": "{x}"},
                        str(chat_model))
    assert one_error_line(runner.invoke(app, ["sweep", str(space)])).startswith("error: data.prompt_template: not used")


# --------------------------------------------------------------------------- save_to_disk folders


ROWS = [{"input": s + "+", "output": s[1:] + s[0]} for s in ("abcd", "hello", "xyz", "plora", "shift", "ab", "cat")]


@pytest.fixture
def saved(tmp_path) -> dict[str, Path]:
    """A Dataset folder, and DatasetDict folders with the usual split names and with others."""
    from datasets import Dataset, DatasetDict

    out = {"single": tmp_path / "single", "dict": tmp_path / "dict", "odd": tmp_path / "odd"}
    Dataset.from_list(ROWS).save_to_disk(str(out["single"]))
    DatasetDict({"train": Dataset.from_list(ROWS[:5]), "validation": Dataset.from_list(ROWS[5:6]),
                 "test": Dataset.from_list(ROWS[5:])}).save_to_disk(str(out["dict"]))
    DatasetDict({"a": Dataset.from_list(ROWS[:3]), "b": Dataset.from_list(ROWS[3:])}).save_to_disk(str(out["odd"]))
    return out


def test_saved_dataset_folders_are_data(tmp_path, saved):
    from plora.data.check import check_data
    from plora.spec.loading import load_spec

    cases = [({"train": str(saved["single"])}, 7, 0, None, None),
             ({"train": str(saved["dict"]), "eval": str(saved["dict"])}, 5, 1, "train", "validation"),
             ({"train": "dict", "eval": "dict", "eval_split": "test"}, 5, 2, "train", "test"),  # beside the space file
             ({"train": str(saved["odd"]), "train_split": "b", "eval": str(saved["odd"]), "eval_split": "a"}, 4, 3, "b", "a")]
    for data, n_train, n_eval, train_split, eval_split in cases:
        space = write_space(tmp_path, data)
        dry_run(space)
        spec = load_spec(space)
        assert (spec.data.train_split, spec.data.eval_split) == (train_split, eval_split), data
        report = check_data(spec)
        assert (report.num_train, report.num_eval) == (n_train, n_eval), data


@pytest.mark.parametrize("data, message", [
    ({"train": "odd"}, "data.train_split: {odd} has the splits a, b: name the one to train on"),
    ({"train": "dict", "eval": "dict", "eval_split": "dev"}, "data.eval_split: no split 'dev' in {dict} (its splits: "
                                                             "train, validation, test)"),
    ({"train": "single", "train_split": "train"}, "data.train_split: {single} holds one dataset, not splits"),
    ({"train": "rows.jsonl", "train_split": "train"}, "data.train_split: only for a folder of splits"),
    ({"train": "plain"}, "data.train: {plain} is a folder, but not one written by datasets' save_to_disk"),
])
def test_bad_saved_dataset_input_is_one_line(tmp_path, saved, data, message):
    (tmp_path / "plain").mkdir()
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    text = one_error_line(runner.invoke(app, ["sweep", str(write_space(tmp_path, data))]))
    names = {k: str(v) for k, v in saved.items()} | {"plain": str(tmp_path / "plain")}
    assert text.startswith("error: " + message.format(**names)), text


# --------------------------------------------------------------------------- Hub model ids


def fake_hub_cache(root: Path, repo_id: str) -> Path:
    """The layout huggingface_hub writes: models--owner--name/{refs/main, snapshots/<hash>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(SHIPPED, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return snapshot


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_is_read_from_the_local_cache(tmp_path, monkeypatch, variable):
    from plora.spec.loading import load_spec

    root = tmp_path / "hf"
    cache = root if variable == "HF_HUB_CACHE" else root / "hub"
    snapshot = fake_hub_cache(cache, "acme/tiny-llama")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, str(root))
    space = write_space(tmp_path, {"task": "builtin:shift", "num_train": 8, "num_eval": 2}, "acme/tiny-llama")
    dry_run(space)
    assert load_spec(space).model.resolved_path() == snapshot


def test_a_hub_id_not_in_the_cache_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    space = write_space(tmp_path, {"task": "builtin:shift"}, "HuggingFaceTB/SmolLM2-135M-Instruct")
    text = one_error_line(runner.invoke(app, ["sweep", str(space)]))
    assert text == (f"error: model.path: no folder {tmp_path / 'HuggingFaceTB' / 'SmolLM2-135M-Instruct'}, and "
                    f"HuggingFaceTB/SmolLM2-135M-Instruct is not in the local Hugging Face cache "
                    f"({tmp_path / 'empty-cache'}); nothing is downloaded at run time: run "
                    f"`hf download HuggingFaceTB/SmolLM2-135M-Instruct` first"), text
    assert not (tmp_path / "runs").exists()


def test_a_folder_beside_the_space_file_wins_over_a_hub_id(tmp_path, monkeypatch):
    from plora.spec.loading import load_spec

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    fake_hub_cache(tmp_path / "hf", "acme/tiny-llama")
    shutil.copytree(SHIPPED, tmp_path / "acme" / "tiny-llama")
    space = write_space(tmp_path, {"task": "builtin:shift"}, "acme/tiny-llama")
    assert load_spec(space).model.resolved_path() == tmp_path / "acme" / "tiny-llama"
