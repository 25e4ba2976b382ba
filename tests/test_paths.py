"""Where relative paths point (issue 46): every input path of a space file (model, data
files, user metric modules) is read from the space file's folder, the output folder from
the working directory. Run from another folder than the space file's, as a user does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def plora(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "plora.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def project(tmp_path: Path, **data) -> Path:
    """A space file beside its model, data and metric module, all named relatively."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    shutil.copytree(REPO / "plora" / "assets" / "tiny-llama", folder / "model")
    rows = [{"input": s + "+", "output": s[1:] + s[0]} for s in ("abcd", "hello", "xyz", "plora", "shift", "ab")]
    for name, part in (("train", rows[:4]), ("eval", rows[4:])):
        (folder / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    (folder / "scoring.py").write_text("def first_letter(answers, references):\n"
                                       "    return sum(a[:1] == r[:1] for a, r in zip(answers, references)) / len(answers)\n")
    space = {
        "name": "t",
        "model": {"path": "model", "max_seq_len": 32},
        "data": {"train": "data/train.jsonl", "eval": "data/eval.jsonl", **data},
        "space": {"rank": [2], "batch_size": [2]},
        "training": {"steps": 2},
        "eval": {"metrics": ["loss", "scoring:first_letter"]},
        "hardware": {"device": "cpu"},
        "output": {"dir": "out"},
    }
    (folder / "space.yaml").write_text(yaml.safe_dump(space))
    return folder / "space.yaml"


def test_inputs_from_the_space_folder_outputs_from_the_working_directory(tmp_path):
    space = project(tmp_path)
    here = tmp_path / "elsewhere"
    here.mkdir()
    dry = plora("sweep", str(space), "--dry-run", cwd=here)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"run directory would be {here / 'out' / 't'}" in dry.stdout
    planned = plora("plan", str(space), cwd=here)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert (here / "out" / "t" / "plan.json").is_file() and str(here / "out" / "t") in planned.stdout
    assert not (space.parent / "out").exists()


def test_a_relative_input_not_found_says_where_it_was_looked_for(tmp_path):
    space = project(tmp_path, train="train.jsonl")
    shutil.copy(space.parent / "data" / "train.jsonl", tmp_path / "train.jsonl")  # beside the working directory
    result = plora("sweep", str(space), "--dry-run", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line == (f"error: data.train: file not found: {space.parent / 'train.jsonl'} (a relative path is read "
                    f"from the space file's folder, {space.parent})"), line


def test_the_rule_is_documented():
    readme = (REPO / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| paths |"))
    assert "relative to the space file's folder" in row and "relative to the working directory" in row
    for name in ("model.path", "data.train", "data.eval", "output.dir"):
        assert name in row
    example = (REPO / "sweeps" / "example-full.yaml").read_text()
    assert "relative to the\n# folder of this file" in example and "output.dir is relative to the working" in example
