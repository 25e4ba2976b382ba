"""The README's PEFT snippet, run exactly as printed on a real sweep (issue 46): plain
`transformers` + `peft` code scores a plora adapter as plora reported it.

The snippet once used an undefined ``base_dir``, and plora put ``<bos>`` before every row
while the demo model's tokenizer put none there: an adapter plora scored 0.955 scored 0 in
transformers. Now rows are framed as the model's own tokenizer frames a text.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

pytest.importorskip("peft")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


def readme_snippet() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("Load any adapter with PEFT"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_snippet_reproduces_the_reported_exact_match(tmp_path):
    demo = yaml.safe_load((REPO / "sweeps" / "demo.yaml").read_text())
    # the demo sweep, shortened to one configuration on fewer rows (the snippet scores the
    # demo's own 200 eval rows, so those stay)
    demo["data"]["num_train"] = 600
    demo["space"] = {"strategy": "list", "configs": [{"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4}]}
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(demo))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    sweep = subprocess.run([sys.executable, "-m", "plora.cli", "sweep", "demo.yaml"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    [row] = pd.read_parquet(tmp_path / "runs" / "demo" / "results.parquet").itertuples()
    assert 0.05 < row.eval_exact_match < 1.0  # a score that says something either way

    snippet = readme_snippet()
    assert snippet.count("<id>") == 1
    run = subprocess.run([sys.executable, "-c", snippet.replace("<id>", row.adapter_id)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == f"exact match {row.eval_exact_match:.3f}", (run.stdout, row.eval_exact_match)
