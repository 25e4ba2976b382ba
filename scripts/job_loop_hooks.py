"""Where a job's main loop spends the time that is not its steps: each step's own time
(`train_step`), the time between one step's end and the next one's start, and the recipe's
between-step calls (their total, count and longest), written when the job leaves.

A diagnostic for the GPU machine, installed through the test-hook variable the engine passes to
every job (`plora.train.hooks`), with the folder its files go to:

    PLORA_TEST_HOOKS=$PWD/scripts/job_loop_hooks.py PLORA_PROFILE_OUT=DIR \
        python scripts/bench_first_sweep.py --parts plora-fixed ...

Writes DIR/<pid>-loop.json: per step its seconds and the gap after it, the calls' totals,
and the moments of the job's first and last step.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from plora.train import hooks

OUT = Path(os.environ.get("PLORA_PROFILE_OUT", "job-loop"))
#: the recipe's calls between steps, timed
CALLS = ("_check_control", "_intermediate_eval", "_epoch_evals", "_finish", "_lane_news", "_capture_ahead",
         "_write_progress", "_lane_idle", "_active")
_state: dict = {"wrapped": False, "steps": [], "calls": {}, "t_end": None, "begun": time.time()}


def _timed(name: str, fn):
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            c = _state["calls"].setdefault(name, {"s": 0.0, "n": 0, "max_s": 0.0})
            c["s"] += dt
            c["n"] += 1
            c["max_s"] = max(c["max_s"], dt)
    return run


def _wrap(recipe) -> None:
    step_fn = recipe.train_step

    def train_step(*args, **kwargs):
        t0 = time.perf_counter()
        if _state["t_end"] is not None and _state["steps"]:
            _state["steps"][-1]["gap_after_s"] = t0 - _state["t_end"]
        out = step_fn(*args, **kwargs)
        t1 = time.perf_counter()
        _state["steps"].append({"s": t1 - t0, "at": time.time()})
        _state["t_end"] = t1
        return out

    recipe.train_step = train_step
    for name in CALLS:
        fn = getattr(recipe, name, None)
        if fn is not None:
            setattr(recipe, name, _timed(name, fn))
    _state["wrapped"] = True


def after_step(recipe, step: int) -> None:
    if not _state["wrapped"]:
        _wrap(recipe)  # from the second step on (the first ran before the hook saw the recipe)


def _write() -> None:
    steps = _state["steps"]
    gaps = [s.get("gap_after_s", 0.0) for s in steps]
    out = {"steps": len(steps), "step_s": sum(s["s"] for s in steps), "gaps_s": sum(gaps),
           "big_gaps": [(i, round(g, 4)) for i, g in enumerate(gaps) if g > 0.005],
           "calls": {k: {"s": round(v["s"], 4), "n": v["n"], "max_s": round(v["max_s"], 4)}
                     for k, v in _state["calls"].items()},
           "first_step_at": steps[0]["at"] if steps else None, "last_step_at": steps[-1]["at"] if steps else None,
           "left_at": time.time(), "per_step": [(round(s["s"], 5), round(s.get("gap_after_s", 0.0), 5)) for s in steps]}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{os.getpid()}-loop.json").write_text(json.dumps(out))


def _exit_after_write(code: int = 0, _exit=os._exit) -> None:
    """A job leaves through `os._exit` (no atexit)."""
    _write()
    _exit(code)


hooks.register("after_step", after_step)
os._exit = _exit_after_write
