"""Bad data is refused before anything runs: one line naming the file, the line or row and
the column; exit code 2 from the CLI; no run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from conftest import tiny_space_file
from plora.cli import app
from plora.data.dataset import DataError, load_split
from plora.job.config import JobData

runner = CliRunner()
GOOD = [{"input": "abc+", "output": "bca"}, {"input": "hello+", "output": "elloh"}, {"input": "xy+", "output": "yx"}]


def jsonl(rows: list) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"


def space_for(tmp_path: Path, train: Path, eval_file: Path | None = None, **over) -> Path:
    data = {"train": str(train), **({"eval": str(eval_file)} if eval_file else {}), **over.pop("data", {})}
    sections = {"space": {"rank": [2], "batch_size": [2]}, "training": {"steps": 2}, **over}
    return tiny_space_file(tmp_path, name="bad", max_seq_len=sections.pop("max_seq_len", 48), data=data, lora=None,
                           **sections)


def refused(tmp_path: Path, space: Path, *expected: str) -> str:
    """Run `plora sweep` and check: exit 2, one line with every expected piece, nothing written."""
    result = runner.invoke(app, ["sweep", str(space)], terminal_width=400)
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert len(text.splitlines()) == 1 and "Traceback" not in text, text
    assert text.startswith("error: "), text
    for piece in expected:
        assert piece in text, (piece, text)
    assert not (tmp_path / "runs").exists()
    return text


# (train file name, its text, pieces of the message)
CASES = {
    "jsonl-does-not-parse": ("train.jsonl", jsonl([GOOD[0], GOOD[1], '{"input": "ab", "output": }']),
                             ["train.jsonl line 3", "not valid JSON"]),
    "not-an-object": ("train.jsonl", jsonl([GOOD[0], ["a", "b"]]), ["train.jsonl line 2", "expected a JSON object"]),
    "null-output": ("train.jsonl", jsonl([GOOD[0], {"input": "ab", "output": None}]),
                    ["train.jsonl line 2, column 'output'", "is null", "no answer"]),
    "nan-output": ("train.jsonl", jsonl([GOOD[0], '{"input": "ab", "output": NaN}']),
                   ["train.jsonl line 2, column 'output'", "is NaN"]),
    "missing-output": ("train.jsonl", jsonl([GOOD[0], GOOD[1], {"input": "ab"}]),
                       ["train.jsonl line 3, column 'output'", "is missing"]),
    "empty-output": ("train.jsonl", jsonl([GOOD[0], {"input": "ab", "output": "  "}]),
                     ["train.jsonl line 2, column 'output'", "is empty"]),
    "list-cell": ("train.jsonl", jsonl([GOOD[0], {"input": ["a", "b"], "output": "x"}]),
                  ["train.jsonl line 2, column 'input'", "expected text, got a list"]),
    "dict-cell": ("train.jsonl", jsonl([{"input": "a", "output": {"text": "x"}}]),
                  ["train.jsonl line 1, column 'output'", "expected text, got an object"]),
    "empty-file": ("train.jsonl", "\n", ["train.jsonl", "has no rows"]),
    "csv-empty-output": ("train.csv", "input,output\nabc+,bca\n\"x\ny\",\nab,ba\n", ["train.csv line 3, column 'output'", "is empty"]),
    "csv-header-only": ("train.csv", "input,output\n", ["train.csv", "has no rows"]),
    "json-null": ("train.json", json.dumps([GOOD[0], {"input": "a", "output": None}]),
                  ["train.json row 2, column 'output'", "is null"]),
    "no-column": ("train.jsonl", jsonl([{"question": "a", "answer": "b"}]),
                  ["train.jsonl", "no column 'input'", "columns: question, answer"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_train_file_is_refused(tmp_path, case):
    name, text, pieces = CASES[case]
    train = tmp_path / name
    train.write_text(text)
    refused(tmp_path, space_for(tmp_path, train), "error: data.train: ", str(train), *pieces)


def test_bad_parquet_row_is_named(tmp_path):
    train = tmp_path / "train.parquet"
    pd.DataFrame({"input": ["a", "b", "c"], "output": ["x", None, "z"]}).to_parquet(train)
    refused(tmp_path, space_for(tmp_path, train), f"data.train: {train} row 2, column 'output'", "is null")


def test_eval_file_without_the_output_column(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(jsonl(GOOD))
    ev = tmp_path / "eval.jsonl"
    ev.write_text(jsonl([{"input": "ab"}, {"input": "cd"}]))
    refused(tmp_path, space_for(tmp_path, train, ev), f"data.eval: {ev}", "no column 'output'", "columns: input")


def test_eval_file_without_rows(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(jsonl(GOOD))
    ev = tmp_path / "eval.jsonl"
    ev.write_text("")
    refused(tmp_path, space_for(tmp_path, train, ev), f"data.eval: {ev}", "has no rows")


def test_every_example_cut_away_by_max_seq_len(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(jsonl([{"input": "abcdefghijklmnop+", "output": "x"}] * 4))
    text = refused(tmp_path, space_for(tmp_path, train, max_seq_len=8), f"data.train: {train} line 1",
                   "cut away entirely by model.max_seq_len 8", "4 of 4 rows", "every row is")
    assert "on_bad_rows" not in text  # dropping cannot help when every row goes


def test_answer_cut_away_refused_with_line_or_dropped(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(jsonl([*GOOD, {"input": "abcdefghijklmnop+", "output": "x"}]))
    refused(tmp_path, space_for(tmp_path, train, max_seq_len=11), f"{train} line 4", "1 of 4 rows",
            "on_bad_rows: drop")
    space = space_for(tmp_path, train, max_seq_len=11, data={"on_bad_rows": "drop"})
    result = runner.invoke(app, ["sweep", str(space), "--dry-run"], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "1 rows dropped (data.on_bad_rows: drop)" in result.output
    assert "rows are longer than model.max_seq_len 11" in result.output  # "hello+" + answer is cut


def test_dropped_rows_do_not_count_in_the_epoch(tmp_path):
    from plora.spec.loading import load_spec
    from plora.sweep import dataset_size

    train = tmp_path / "train.jsonl"
    train.write_text(jsonl([*GOOD, {"input": "a", "output": None}]))
    space = space_for(tmp_path, train, data={"on_bad_rows": "drop"})
    assert dataset_size(load_spec(space)) == 3


def test_chat_rows_on_a_model_without_chat_template(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(jsonl([{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}]))
    refused(tmp_path, space_for(tmp_path, train), f"{train} line 1", "need a chat template", "has none")


@pytest.mark.parametrize("messages, pieces", [
    ("hello", ["expected a list of {role, content} messages, got text"]),
    ([{"role": "user", "content": "a"}], ["no assistant message"]),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}], ["message 1 (assistant)", "null"]),
    ([{"role": "robot", "content": "a"}], ["message 0 has role 'robot'"]),
    ([{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "b"}], ["message 0 has a list content"]),
])
def test_bad_chat_rows(tmp_path, messages, pieces):
    path = tmp_path / "train.jsonl"
    path.write_text(jsonl([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                           {"messages": messages}]))
    with pytest.raises(DataError) as info:
        load_split(JobData(train=str(path)), "train")
    msg = str(info.value)
    assert msg.startswith(f"data.train: {path} line 2, column 'messages': ") and "\n" not in msg
    for piece in pieces:
        assert piece in msg, msg


@pytest.mark.parametrize("data, eval, field", [
    ({"prompt_template": "{input"}, {}, "data.prompt_template"),
    ({"format": "chat", "prompt_template": "{input}"}, {}, "data.prompt_template"),
    ({"on_bad_rows": "skip"}, {}, "data.on_bad_rows"),
    ({}, {"metrics": ["loss", "choice_accuracy"]}, "eval.metrics"),
    ({}, {"metrics": ["loss"], "choices": ["a", "b"]}, "eval.choices"),
    ({}, {"metrics": ["choice_accuracy"], "choices": ["a"]}, "eval.choices"),
    ({}, {"metrics": ["loss", "no_such_module_here:f"]}, "eval.metrics[1]"),
    ({}, {"metrics": ["loss", "json:no_such_function"]}, "eval.metrics[1]"),
    ({}, {"metrics": ["loss", "json:__doc__"]}, "eval.metrics[1]"),
    ({}, {"metrics": ["loss", "meteor"]}, "eval.metrics[1]"),
    ({}, {"metrics": ["loss"], "objective": "exact_match"}, "eval.objective"),
])
def test_bad_data_and_eval_fields(tmp_path, data, eval, field):
    train = tmp_path / "train.jsonl"
    train.write_text(jsonl(GOOD))
    space = space_for(tmp_path, train, data=data, eval=eval)
    refused(tmp_path, space, f"error: {field}")


def test_tune_refuses_bad_data_before_its_study_exists(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(jsonl([GOOD[0], {"input": "ab", "output": None}]))
    result = runner.invoke(app, ["tune", str(space_for(tmp_path, train)), "--trials", "1"], terminal_width=400)
    assert result.exit_code == 2, result.output
    assert f"error: data.train: {train} line 2, column 'output': is null" in result.output
    assert not (tmp_path / "runs").exists()
