"""scripts/bench_streaming.py's bookkeeping (a test of the benchmark, beside it: the library's tests in
`tests/` import only the library), without running a sweep: its tables are built
from whatever parts a resumed benchmark has (missing, failed or partial), and its token
estimate of the fullest pack reads each step's adapters from metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench_streaming.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_streaming", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tables_take_missing_failed_and_partial_parts():
    bench = _bench()
    assert bench.table({}) == []
    assert bench.report({})  # a header line even with nothing measured
    parts = {
        "sweep16-stream": {"streaming": True, "configs": 16, "makespan_s": 40.0, "step_running_s": 37.0,
                           "running_fraction": 0.925, "makespan_over_token_time": 1.2},  # no full pack, no jobs
        "sweep16-static": {"error": "exit code 1"},
        "tune-async": {"wall_s": 100.0, "states": {"complete": 60, "pruned": 4}, "best": 2.5,
                       "told": [[10.0, 3.0], [50.0, 2.5]], "minimize": True},
    }
    lines = bench.table({"parts": parts})
    text = "\n".join(lines)
    assert "| sweep16-stream | on | 16 |" in text and "0.93 ok" in text and "1.20 MISSED" in text
    assert "sweep16-static | error: exit code 1" in text
    assert "| tune-async | 100.0 | 60 / 4 / 0 | 2.5000 |" in text
    assert "tune-sync" not in text and "same best objective" not in text  # one tune run: nothing to compare
    assert "sweep64" not in text


def test_same_best_is_the_worse_of_the_two_bests():
    bench = _bench()
    sync = {"best": 2.0, "minimize": True, "told": [[30.0, 2.4], [90.0, 2.0]]}
    asyn = {"best": 2.2, "minimize": True, "told": [[20.0, 2.3], [40.0, 2.2], [70.0, 2.25]]}
    both = bench.same_best(sync, asyn)
    assert both["target"] == 2.2
    assert both["sync_s"] == 90.0 and both["async_s"] == 40.0
    assert both["async_reaches_sync_best_s"] is None and both["sync_reaches_async_best_s"] == 90.0
    assert bench.same_best(sync, {"error": "exit code 1"}) is None
    assert "time to the same best" in "\n".join(bench.tune_table({"tune-sync": sync, "tune-async": asyn}))


def test_fullest_pack_tokens_from_each_steps_adapters(tmp_path):
    bench = _bench()
    job = tmp_path / "jobs" / "job-000"
    job.mkdir(parents=True)
    phases = [{"adapters": 2, "steps": 2, "first_s": 1.0, "rest_s": 1.0},
              {"adapters": 1, "steps": 1, "first_s": 0.5, "rest_s": 0.0}]
    (job / "summary.json").write_text(json.dumps({"phases": {"phases": phases}}))
    rows = [{"step": 0, "adapter": "a", "attempt": 1}, {"step": 0, "adapter": "b", "attempt": 1},
            {"step": 1, "adapter": "a", "attempt": 1}, {"step": 1, "adapter": "b", "attempt": 1},
            {"step": 2, "adapter": "a", "attempt": 1}, {"step": 0, "adapter": "b", "attempt": 0}]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    packs = bench.pack_phases(tmp_path, 10.0, {"a": 2, "b": 4})
    assert [p["tokens"] for p in packs] == [120.0, 20.0]  # (2 + 4) rows x 10 tokens x 2 steps; then a alone
    full = bench.fullest_pack(packs)
    assert full["adapters"] == 2 and full["tokens_per_s"] == 60.0
    assert bench.step_seconds({"phases": phases}) == 2.5
