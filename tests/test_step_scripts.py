"""The step and eval diagnostics' plumbing on the CPU (their `--smoke` paths): each runs the
recipe's own step or eval and writes the report it promises. The numbers mean something
only on a GPU (`scripts/compare_row_layouts.py`, `scripts/profile_eval.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _run(script: str, *args: str) -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / script), "--smoke", *args], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_compare_row_layouts_tells_rows_and_layouts_apart(tmp_path):
    _run("compare_row_layouts.py", "--out", str(tmp_path), "--cases", "fixed:padded", "varied:balanced",
         "varied:balanced:own-attention")
    result = json.loads((tmp_path / "row_layouts.json").read_text())
    cases = [r["case"] for r in result["results"]]
    assert cases == ["fixed:padded", "varied:balanced", "varied:balanced:own-attention"]
    for r in result["results"]:
        assert r["real_tokens_per_step"] > 0 and r["stepped_tokens_per_step"] >= r["real_tokens_per_step"]
        assert 0 <= r["padding"] < 1
    assert result["vs_first"]["fixed:padded"] == 1.0


def test_profile_eval_times_the_final_eval_and_its_parts(tmp_path):
    _run("profile_eval.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "eval_profile.json").read_text())
    assert result["first_s"] > 0 and len(result["warm_s"]) == 1
    assert set(result["parts_s"]) == {"loss", "exact_match"}
    assert "greedy_generate" in (tmp_path / "eval_cprofile.txt").read_text()
