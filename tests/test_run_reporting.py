"""What a sweep or a tune tells its user while it runs and after (issue 46): counts that
agree with each other, a run directory that holds one space at a time, progress in a log,
numbers shown as the user knows them.

Each test drives the `plora` command as a user does (typer's CliRunner, whose output is not
a terminal), or the function that renders a line where a real run would be too slow.
"""

from __future__ import annotations

import shutil

from typer.testing import CliRunner

from plora.cli import app
from test_new_user import one_error_line, write_space

runner = CliRunner()


# --------------------------------------------------------------------------- JSON errors


def test_json_errors_name_the_position_once(tmp_path, tiny_model):
    train = tmp_path / "train.jsonl"
    train.write_text('{"input": "abc+", "output": "bca"}\n{"input": "abc+", "output": "bca}\n')
    text = one_error_line(runner.invoke(app, ["sweep", str(write_space(tmp_path, data={"train": str(train)}))]))
    assert "train.jsonl line 2: not valid JSON (Unterminated string starting at column 29)" in text, text

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "config.json").write_text('{"model_type": "llama", "name": "tiny}')
    space = write_space(tmp_path, "m.yaml", model={"path": str(model), "max_seq_len": 48})
    text = one_error_line(runner.invoke(app, ["sweep", str(space)]))
    assert "config.json: not valid JSON (Unterminated string starting at line 1 column 33)" in text, text
