"""Packs that never drain, measured: streaming sweeps, and ``plora tune --async`` against the
synchronous batch loop, on one GPU.

A. Sweeps with ``planner.streaming: true`` (adapters of queued jobs join running ones):

* ``sweep16-stream``: the real-data benchmark's 16 configurations (rank 8/16/32/64 x lr
  1e-4/3e-4 x batch 2/4, alpha 2r, all seven linears, one epoch, cosine, the space of
  ``bench_real_data.space()``: a random-init ``shape:qwen2.5-0.5b`` in bf16, 512 rows of
  about 250 tokens, 32 eval samples), ``max_adapters_per_job`` 16;
* ``sweep16-static``: the same with streaming off, for comparison;
* ``sweep64-stream``: 64 configurations (rank 8/16/32/64 x lr 5e-5/1e-4/2e-4/4e-4 x batch
  2/4 x two seeds), still at most 16 adapters a job: on one GPU most of them must stream
  into the running job.

For each: the makespan (first job start to last job end, from the journal), the seconds the
packed step was running (every job's step phases in its summary.json), their fraction
(target >= 0.90), the sweep's real tokens, the step's real tokens/s over all its steps and
over the phases of the fullest pack (tokens estimated from each step's adapters in
metrics.jsonl and the rows' mean length), and makespan / (tokens / step tokens/s) (target
<= 1.15); per job its process start, load, set-up, first step, evals, saves, joins and graph
captures (where summary.json counts them).

B. ``plora tune`` with 64 TPE trials and a Hyperband pruner, 16 at a time (one pack), on the
same rows, rank 8/16/32/64, lr 3e-5..1e-3 (log), batch 2/4, an intermediate eval loss every
32 adapter steps: ``tune-sync`` (the batch loop) against ``tune-async`` (``--async``). For
each: wall time, trial states, the best eval loss and when it was told, when each run first
reached the worse of the two bests (time to the same best objective), and the GPU-busy
fraction (packed-step seconds / wall). Times are the study's trial completion times
(study.sqlite) from the start of the ``plora tune`` process.

Every part runs in a subprocess of its own; its result is merged into DIR/streaming_bench.json
at once, so an interrupted call keeps the parts before it, and a later call (``--parts``, or
``--missing``) adds the rest. Parts: warmup (an untimed sweep of the 16 configurations on 64
rows: Triton's compilation, the model check and the random-init model's files are paid
there, not by the first timed part), profile, sweep16 (= sweep16-stream sweep16-static),
sweep64 (= sweep64-stream), tune (= tune-sync tune-async), or any of those names.
``--tune-seed`` sets the sampler's seed of both tune parts.

Time on one H100 (0.5B shape), with the profile cached: warmup 45-65 s, sweep16 ~1 min per
sweep, sweep64 ~2.5 min, tune-sync ~2.5 min, tune-async ~1.7 min (the profile ~3 min the
first time, cached in PLORA_CACHE_DIR after); so two calls under 600 s:

    export PLORA_CACHE_DIR=$PWD/runs/plora-cache
    python scripts/bench_streaming.py --out runs/bench-streaming --no-profile --parts warmup sweep16 sweep64
    python scripts/bench_streaming.py --out runs/bench-streaming --no-profile --parts tune

    python scripts/bench_streaming.py --smoke --out DIR    # tiny Qwen2, CPU: ~3.5 minutes on 2 cores

The smoke runs every part with 2 adapters a job (8 and 32 configurations, 8 trials, 4 at
once) so that adapters stream even on the CPU's two slots; its ratios mean nothing.

Writes DIR/streaming_bench.json and DIR/streaming_bench.md; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rows import write_variant

RESULT = "streaming_bench.json"
SETTINGS = "streaming_settings.json"
PARTS = ("warmup", "profile", "sweep16-stream", "sweep16-static", "sweep64-stream", "tune-sync", "tune-async")
GROUPS = {"sweep16": ["sweep16-stream", "sweep16-static"], "sweep64": ["sweep64-stream"],
          "tune": ["tune-sync", "tune-async"], "all": list(PARTS)}
#: settings that change what is measured: a result of other settings is not merged with these
WORKLOAD = ("model", "device", "dtype", "seq", "rows", "row_chars", "answer_chars", "eval_samples", "ranks",
            "lrs16", "lrs64", "seeds64", "max_adapters", "trials", "in_flight", "every_steps", "tune_lr",
            "tune_seed", "metrics", "smoke")
RUNNING_TARGET, TOKEN_TARGET = 0.90, 1.15
#: training rows of the warm-up sweep
WARMUP_ROWS = 64


# ------------------------------------------------------------------ the spaces


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """What every part needs, with the smoke's tiny sizes applied (written to DIR/SETTINGS)."""
    s = {"model": args.model, "device": args.device, "dtype": args.dtype, "seq": args.seq, "rows": args.rows,
         "row_chars": args.row_chars, "answer_chars": args.answer_chars, "eval_samples": args.eval_samples,
         "ranks": [8, 16, 32, 64], "lrs16": [1e-4, 3e-4], "lrs64": [5e-5, 1e-4, 2e-4, 4e-4], "seeds64": 2,
         "max_adapters": 16, "trials": args.trials, "in_flight": args.in_flight, "every_steps": args.every_steps,
         "tune_lr": [3e-5, 1e-3], "tune_seed": args.tune_seed, "metrics": ["loss"], "max_new_tokens": 16,
         "no_profile": args.no_profile,
         "smoke": args.smoke, "out": str(args.out)}
    if args.smoke:
        from bench_real_data import smoke_model

        s.update(model=str(smoke_model(args.out)), device="cpu", dtype="float32", rows=min(args.rows, 24),
                 seq=min(args.seq, 160), row_chars=96, answer_chars=16, eval_samples=min(args.eval_samples, 4),
                 ranks=[8, 16], max_adapters=2, trials=min(args.trials, 8), in_flight=min(args.in_flight, 4),
                 every_steps=min(args.every_steps, 4), max_new_tokens=4)
    return s


def space_for(part: str, s: dict[str, Any]) -> dict[str, Any]:
    """A part's space file, from the real-data benchmark's (`bench_real_data.space`)."""
    from bench_real_data import space

    out = Path(s["out"])
    ns = SimpleNamespace(device=s["device"], model=s["model"], dtype=s["dtype"], seq=s["seq"],
                         eval_samples=s["eval_samples"], ranks=s["ranks"], metrics=s["metrics"],
                         max_new_tokens=s["max_new_tokens"], out=out)
    sp = space(ns, "fixed", out / "data")
    sp["name"] = part if part != "profile" else "sweep16-stream"
    sp["planner"] = {"max_adapters_per_job": s["max_adapters"], "streaming": part.endswith("-stream")}
    if part == "warmup":  # the 16 configurations on a few rows: the shapes the timed parts compile first
        sp["data"].update(train=str(out / "data-warmup" / "train-fixed.jsonl"),
                          eval=str(out / "data-warmup" / "eval-fixed.jsonl"))
    if part.startswith("sweep64"):
        sp["space"].update(learning_rate=s["lrs64"], seeds_per_config=s["seeds64"])
    elif part.startswith("tune"):
        sp["space"]["learning_rate"] = {"low": s["tune_lr"][0], "high": s["tune_lr"][1], "log": True}
        sp["eval"]["every_steps"] = s["every_steps"]
    return sp


def write_space(part: str, s: dict[str, Any]) -> Path:
    import yaml

    path = Path(s["out"]) / f"{part}.yaml"
    path.write_text(yaml.safe_dump(space_for(part, s), sort_keys=False))
    return path


# ------------------------------------------------------------------ what a run directory says


def step_seconds(phases: dict[str, Any] | None) -> float:
    """Seconds the packed step ran in one job: every pack composition's steps."""
    return sum(float(p.get("first_s", 0.0)) + float(p.get("rest_s", 0.0)) for p in (phases or {}).get("phases", []))


def read_summary(job_dir: Path) -> dict[str, Any]:
    try:
        out = json.loads((job_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def captures_of(phases: dict[str, Any]) -> Any:
    """Graph captures where summary.json counts them (None where it does not)."""
    for key in ("captures", "graph_captures"):
        if key in phases:
            v = phases[key]
            return len(v) if isinstance(v, list) else v
    return None


def job_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every job of the journal, with what its summary.json says about where its time went."""
    from plora.engine.journal import Journal

    path = run_dir / "journal.sqlite"
    if not path.is_file():
        return []
    journal = Journal(path)
    try:
        jobs = journal.jobs()
    finally:
        journal.close()
    t0 = min((j.started for j in jobs if j.started is not None), default=None)
    rows = []
    for j in jobs:
        summary = read_summary(run_dir / "jobs" / j.id)
        ph = summary.get("phases") or {}
        packs = ph.get("phases") or []
        rows.append({
            "job": j.id, "status": j.status, "attempts": j.attempt, "adapters": len(j.adapters),
            "at_s": j.started - t0 if j.started is not None and t0 is not None else None,
            "wall_s": j.ended - j.started if j.started is not None and j.ended is not None else None,
            "start_s": ph.get("start_s"), "load_s": ph.get("load_s"), "setup_s": ph.get("setup_s"),
            "first_step_s": packs[0].get("first_s") if packs else None,
            "steps": summary.get("steps"), "step_s": step_seconds(ph) if packs else None,
            "packs": len(packs) if packs else None,
            "evals": len(ph.get("evals", [])) if ph else None,
            "eval_s": sum(float(e.get("seconds", 0.0)) for e in ph.get("evals", [])) if ph else None,
            "saves": len(ph.get("saves", [])) if ph else None,
            "save_s": sum(float(e.get("seconds", 0.0)) for e in ph.get("saves", [])) if ph else None,
            "joins": len(summary.get("joined") or {}) if summary else None,
            "captures": captures_of(ph),
        })
    return rows


def pack_phases(run_dir: Path, row_tokens: float, batch_of: dict[str, int]) -> list[dict[str, Any]]:
    """Every job's pack compositions with their estimated real tokens: each step's adapters
    (metrics.jsonl, the job's last attempt) times their batch size times the rows' mean length."""
    out = []
    for job_dir in sorted((run_dir / "jobs").glob("*")):
        packs = (read_summary(job_dir).get("phases") or {}).get("phases") or []
        if not packs:
            continue
        per_step: dict[int, float] = {}
        rows = []
        if (job_dir / "metrics.jsonl").is_file():
            for line in (job_dir / "metrics.jsonl").read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
        last = max((int(r.get("attempt") or 0) for r in rows), default=0)
        for r in rows:
            if int(r.get("attempt") or 0) == last and "step" in r and "adapter" in r:
                tokens = batch_of.get(r["adapter"], 0) * row_tokens
                per_step[int(r["step"])] = per_step.get(int(r["step"]), 0.0) + tokens
        step = min(per_step, default=0)
        for p in packs:
            n = int(p.get("steps", 0))
            tokens = sum(per_step.get(k, 0.0) for k in range(step, step + n))
            step += n
            out.append({"job": job_dir.name, "adapters": int(p.get("adapters", 0)), "steps": n,
                        "seconds": float(p.get("first_s", 0.0)) + float(p.get("rest_s", 0.0)), "tokens": tokens})
    return out


def fullest_pack(phases: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The phases of the most adapters at once, together: their steps, seconds, tokens/s."""
    if not phases:
        return None
    most = max(p["adapters"] for p in phases)
    full = [p for p in phases if p["adapters"] == most]
    seconds, tokens = sum(p["seconds"] for p in full), sum(p["tokens"] for p in full)
    return {"adapters": most, "phases": len(full), "steps": sum(p["steps"] for p in full), "seconds": seconds,
            "tokens": tokens, "tokens_per_s": tokens / seconds if seconds > 0 else None}


def ratio(a: Any, b: Any) -> float | None:
    return float(a) / float(b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


# ------------------------------------------------------------------ the parts


def plora_cmd(args: list[str], log: Path, timeout: float | None = None) -> tuple[int, float]:
    """``plora ARGS`` in a process of its own, its output to ``log``: (exit code, seconds)."""
    t0 = time.time()
    with open(log, "w") as f:
        try:
            proc = subprocess.run([sys.executable, "-m", "plora.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.time() - t0


def profile_first(path: Path, s: dict[str, Any], part: str) -> float | None:
    """``plora profile`` (cached after its first run), timed apart from what it precedes."""
    if s["no_profile"]:
        return None
    code, seconds = plora_cmd(["profile", str(path)], Path(s["out"]) / f"{part}-profile.log")
    if code != 0:
        raise RuntimeError(f"plora profile exited {code} (see {part}-profile.log)")
    return seconds


def run_warmup(s: dict[str, Any]) -> dict[str, Any]:
    """An untimed sweep of every rank and batch size on a few rows, so that no timed part
    pays what a fresh machine pays once: Triton's kernel compilation (kept in its on-disk
    cache), the random-init model's files and the model check (kept in PLORA_CACHE_DIR)."""
    (Path(s["out"]) / "data-warmup").mkdir(parents=True, exist_ok=True)
    write_variant(Path(s["out"]) / "data-warmup", "fixed", rows=WARMUP_ROWS, eval_samples=s["eval_samples"],
                  row_chars=s["row_chars"], answer_chars=s["answer_chars"], seq=s["seq"])
    path = write_space("warmup", s)
    code, seconds = plora_cmd(["sweep", str(path), "--restart", "--no-profile"], Path(s["out"]) / "warmup-sweep.log")
    if code != 0:
        raise RuntimeError(f"the warm-up sweep exited {code} (see warmup-sweep.log)")
    return {"warmup_s": seconds}


def run_profile(s: dict[str, Any]) -> dict[str, Any]:
    return {"profile_s": profile_first(write_space("profile", s), s, "profile"), "no_profile": s["no_profile"]}


def run_sweep(part: str, s: dict[str, Any]) -> dict[str, Any]:
    import pandas as pd
    from bench_real_data import real_tokens

    from plora.engine.journal import measured_makespan
    from plora.planner.plan import Plan
    from plora.spec.loading import load_spec

    path = write_space(part, s)
    spec = load_spec(path)
    run_dir = spec.run_dir(None)
    profile_s = profile_first(path, s, part)
    code, wall = plora_cmd(["sweep", str(path), "--restart", "--no-profile"], Path(s["out"]) / f"{part}-sweep.log")
    configs = pd.read_parquet(run_dir / "configs.parquet") if (run_dir / "configs.parquet").is_file() else None
    n_configs = len(configs) if configs is not None else len(spec.expand())
    tokens, rows = real_tokens(spec)
    row_tokens = tokens / rows if rows else 0.0
    batch_of = dict(zip(configs["id"], configs["batch_size"])) if configs is not None and "id" in configs else {}
    jobs = job_rows(run_dir)
    running = sum(j["step_s"] or 0.0 for j in jobs)
    span = measured_makespan(run_dir)
    sweep_tokens = tokens * n_configs
    step_tps = sweep_tokens / running if running else None
    full = fullest_pack(pack_phases(run_dir, row_tokens, batch_of))
    plan = Plan.of_run(run_dir)
    # the sweep's one process start: the first job's wait for its process (imports, CUDA), paid
    # once per sweep whatever streams into it (the ratios are also given without it)
    first = min((j for j in jobs if j["at_s"] is not None), key=lambda j: j["at_s"], default=None)
    start_s = float(first["start_s"] or 0.0) if first else 0.0
    worker = span - start_s if span is not None else None
    status = {}
    if (run_dir / "results.csv").is_file():
        status = pd.read_csv(run_dir / "results.csv")["status"].value_counts().to_dict()
    return {
        "streaming": spec.planner.streaming, "configs": n_configs, "exit_code": code, "wall_s": wall,
        "profile_s": profile_s, "makespan_s": span, "predicted_makespan_s": plan.expected_makespan if plan else None,
        "jobs_planned": len(plan.jobs) if plan else None,
        "jobs_ran": sum(1 for j in jobs if j["at_s"] is not None),
        "jobs_streamed": sum(1 for j in jobs if j["status"] == "streamed"),
        "adapters": {str(k): int(v) for k, v in status.items()},
        "step_running_s": running, "running_fraction": ratio(running, span),
        "real_tokens": sweep_tokens, "rows": rows, "row_tokens": row_tokens,
        "step_tokens_per_s": step_tps, "full_pack": full,
        "makespan_over_token_time": ratio(span, ratio(sweep_tokens, step_tps)),
        "makespan_over_full_pack_time": ratio(span, ratio(sweep_tokens, (full or {}).get("tokens_per_s"))),
        "process_start_s": start_s, "after_start_s": worker, "running_fraction_after_start": ratio(running, worker),
        "after_start_over_token_time": ratio(worker, ratio(sweep_tokens, step_tps)),
        "jobs": jobs, "run_dir": str(run_dir),
    }


def trial_times(study_path: Path, name: str, t0: float) -> dict[str, Any]:
    """The study's trials: states, and each finished trial's value and when it was told
    (seconds since ``t0``), in that order."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{study_path}")
    states: dict[str, int] = {}
    told = []
    for t in study.get_trials(deepcopy=False):
        states[t.state.name.lower()] = states.get(t.state.name.lower(), 0) + 1
        if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None and t.datetime_complete:
            told.append([t.datetime_complete.timestamp() - t0, float(t.value)])
    told.sort()
    minimize = study.direction == optuna.study.StudyDirection.MINIMIZE
    best = (min if minimize else max)((v for _, v in told), default=None)
    best_at = next((t for t, v in told if v == best), None)
    return {"states": states, "told": told, "minimize": minimize, "best": best, "best_at_s": best_at}


def run_tune(part: str, s: dict[str, Any]) -> dict[str, Any]:
    from plora.engine.journal import measured_makespan
    from plora.spec.loading import load_spec

    path = write_space(part, s)
    spec = load_spec(path, sampled=True)
    run_dir = spec.run_dir(None)
    shutil.rmtree(run_dir, ignore_errors=True)  # a tune re-opens an existing study: start afresh
    profile_s = profile_first(write_space("profile", s), s, part)  # a tune's ranges are no grid to profile
    cmd = ["tune", str(path), "--sampler", "tpe", "--trials", str(s["trials"]), "--batch", str(s["in_flight"]),
           "--pruner", "hyperband"] + (["--async"] if part == "tune-async" else [])
    if s.get("tune_seed") is not None:
        cmd += ["--seed", str(s["tune_seed"])]
    t0 = time.time()
    code, wall = plora_cmd(cmd, Path(s["out"]) / f"{part}.log")
    jobs = job_rows(run_dir)
    running = sum(j["step_s"] or 0.0 for j in jobs)
    span = measured_makespan(run_dir)
    out = {"mode": "async" if part == "tune-async" else "sync", "exit_code": code, "wall_s": wall,
           "profile_s": profile_s, "makespan_s": span, "step_running_s": running,
           "gpu_busy_fraction": ratio(running, wall), "busy_over_makespan": ratio(running, span),
           "jobs": jobs, "run_dir": str(run_dir)}
    if (run_dir / "study.sqlite").is_file():
        out.update(trial_times(run_dir / "study.sqlite", spec.optuna.study_name or spec.name, t0))
    return out


def run_part(part: str, s: dict[str, Any]) -> dict[str, Any]:
    """One part, in this process (the ``--part`` child); its result with the device."""
    device = "cpu"
    if s["device"] != "cpu":
        import torch

        device = torch.cuda.get_device_name()
    t0 = time.time()
    if part == "warmup":
        res = run_warmup(s)
    elif part == "profile":
        res = run_profile(s)
    elif part.startswith("sweep"):
        res = run_sweep(part, s)
    else:
        res = run_tune(part, s)
    return {"device": device, "part_s": time.time() - t0, "finished_at": time.time(), **res}


# ------------------------------------------------------------------ comparing and printing


def same_best(sync: dict[str, Any] | None, asyn: dict[str, Any] | None) -> dict[str, Any] | None:
    """Time to the same best objective: the worse of the two runs' bests (which both reached),
    and when each first reached it; also when each reached the other's best (None: never)."""
    if not sync or not asyn or sync.get("best") is None or asyn.get("best") is None:
        return None
    minimize = sync.get("minimize", True)
    worse = max if minimize else min
    target = worse(sync["best"], asyn["best"])

    def reached(run: dict[str, Any], value: float) -> float | None:
        ok = (lambda v: v <= value) if minimize else (lambda v: v >= value)
        return next((t for t, v in run.get("told", []) if ok(v)), None)

    at_sync, at_async = reached(sync, target), reached(asyn, target)
    return {"target": target, "sync_s": at_sync, "async_s": at_async, "sync_over_async": ratio(at_sync, at_async),
            "sync_reaches_async_best_s": reached(sync, asyn["best"]),
            "async_reaches_sync_best_s": reached(asyn, sync["best"])}


def fmt(v: Any, spec: str = "{:.1f}") -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "-"
    return spec.format(v)


def mark(v: Any, target: float, at_least: bool) -> str:
    """A ratio with whether it meets its target."""
    if not isinstance(v, (int, float)):
        return "-"
    ok = v >= target if at_least else v <= target
    return f"{v:.2f} {'ok' if ok else 'MISSED'}"


def sweep_table(parts: dict[str, Any]) -> list[str]:
    lines = [("| sweep | streaming | configs | done | jobs ran / streamed | makespan s | step running s | "
             f"running / makespan (>= {RUNNING_TARGET:.2f}) | real tokens | step tok/s | full-pack tok/s "
             f"(adapters) | makespan / (tokens / step tok/s) (<= {TOKEN_TARGET:.2f}) | same at full-pack tok/s | "
             "process start s | running / (makespan - start) | (makespan - start) / (tokens / step tok/s) |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("sweep16-stream", "sweep16-static", "sweep64-stream"):
        r = parts.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |" + " |" * 14)
            continue
        full = r.get("full_pack") or {}
        adapters = r.get("adapters") or {}
        lines.append(
            f"| {name} | {'on' if r.get('streaming') else 'off'} | {r.get('configs', '-')} | "
            f"{adapters.get('done', '-')} | {r.get('jobs_ran', '-')} / {r.get('jobs_streamed', '-')} | "
            f"{fmt(r.get('makespan_s'))} | {fmt(r.get('step_running_s'))} | "
            f"{mark(r.get('running_fraction'), RUNNING_TARGET, True)} | {fmt(r.get('real_tokens'), '{:,.0f}')} | "
            f"{fmt(r.get('step_tokens_per_s'), '{:,.0f}')} | {fmt(full.get('tokens_per_s'), '{:,.0f}')} "
            f"({full.get('adapters', '-')}) | {mark(r.get('makespan_over_token_time'), TOKEN_TARGET, False)} | "
            f"{mark(r.get('makespan_over_full_pack_time'), TOKEN_TARGET, False)} | {fmt(r.get('process_start_s'))} | "
            f"{mark(r.get('running_fraction_after_start'), RUNNING_TARGET, True)} | "
            f"{mark(r.get('after_start_over_token_time'), TOKEN_TARGET, False)} |")
    return lines if len(lines) > 2 else []


def job_table(name: str, r: dict[str, Any]) -> list[str]:
    jobs = r.get("jobs") or []
    if not jobs:
        return []
    cols = ("job", "status", "adapters", "at_s", "wall_s", "start_s", "load_s", "setup_s", "first_step_s",
            "steps", "step_s", "packs", "evals", "eval_s", "saves", "save_s", "joins", "captures")
    lines = [f"{name}: jobs", "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for j in jobs:
        cells = [fmt(j.get(c), "{:.2f}") if isinstance(j.get(c), float) else
                 ("-" if j.get(c) is None else str(j.get(c))) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def tune_table(parts: dict[str, Any]) -> list[str]:
    sync, asyn = parts.get("tune-sync"), parts.get("tune-async")
    if sync is None and asyn is None:
        return []
    both = same_best(sync if sync and "error" not in sync else None, asyn if asyn and "error" not in asyn else None)
    lines = [("| tune | wall s | trials (complete / pruned / failed) | best | best told at s | step running s | "
             "GPU-busy (step / wall) | step / makespan | time to the same best s |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in (("tune-sync", sync), ("tune-async", asyn)):
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |" + " |" * 7)
            continue
        st = r.get("states") or {}
        to_same = (both or {}).get("sync_s" if name == "tune-sync" else "async_s")
        lines.append(f"| {name} | {fmt(r.get('wall_s'))} | {st.get('complete', 0)} / {st.get('pruned', 0)} / "
                     f"{st.get('fail', 0)} | {fmt(r.get('best'), '{:.4f}')} | {fmt(r.get('best_at_s'))} | "
                     f"{fmt(r.get('step_running_s'))} | {fmt(r.get('gpu_busy_fraction'), '{:.2f}')} | "
                     f"{fmt(r.get('busy_over_makespan'), '{:.2f}')} | {fmt(to_same)} |")
    if both:
        lines += ["", (f"same best objective {both['target']:.4f} (the worse of the two bests): sync at "
                      f"{fmt(both['sync_s'])} s, async at {fmt(both['async_s'])} s "
                      f"(sync / async {fmt(both['sync_over_async'], '{:.2f}')}); sync reaches async's best at "
                      f"{fmt(both['sync_reaches_async_best_s'])} s, async reaches sync's at "
                      f"{fmt(both['async_reaches_sync_best_s'])} s")]
    return lines


def head_line(result: dict[str, Any]) -> str:
    s = result.get("settings") or {}
    devices = sorted({str(p["device"]) for p in (result.get("parts") or {}).values() if p.get("device")})
    prof = (result.get("parts") or {}).get("profile") or {}
    return (f"{s.get('model', '-')} on {', '.join(devices) or '-'}, {s.get('dtype', '-')}, {s.get('rows', '-')} rows "
            f"of ~{s.get('row_chars', '-')} tokens, {s.get('eval_samples', '-')} eval samples, at most "
            f"{s.get('max_adapters', '-')} adapters a job; tune: {s.get('trials', '-')} TPE trials, Hyperband, "
            f"{s.get('in_flight', '-')} at once, eval every {s.get('every_steps', '-')} steps"
            + (f"; profile {fmt(prof.get('profile_s'))} s" if prof.get("profile_s") is not None else ""))


def table(result: dict[str, Any]) -> list[str]:
    """The short tables printed last (any part may be missing or have failed)."""
    parts = result.get("parts") or {}
    lines = sweep_table(parts)
    tune = tune_table(parts)
    if lines and tune:
        lines.append("")
    return lines + tune


def report(result: dict[str, Any]) -> str:
    parts = result.get("parts") or {}
    body = [head_line(result), ""]
    for name in PARTS:
        if name in parts and "error" not in parts[name]:
            body += job_table(name, parts[name])
    return "\n".join(body + table(result)) + "\n"


# ------------------------------------------------------------------ main


def wanted_parts(names: list[str]) -> list[str]:
    out: list[str] = []
    for n in names:
        for p in GROUPS.get(n, [n]):
            if p not in PARTS:
                raise SystemExit(f"unknown part {n!r}; parts: {', '.join([*GROUPS, *PARTS])}")
            if p not in out:
                out.append(p)
    return [p for p in PARTS if p in out]


def load_result(out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The results so far in DIR, or a fresh record when they were measured on another workload."""
    try:
        old = json.loads((out / RESULT).read_text())
    except (OSError, ValueError):
        old = {}
    same = all((old.get("settings") or {}).get(k) == settings.get(k) for k in WORKLOAD)
    if old.get("parts") and not same:
        print(f"note: {out / RESULT} was measured with other settings; starting a new record", flush=True)
        (out / RESULT).rename(out / f"{RESULT}.old")
        old = {}
    return {"settings": settings, "parts": dict(old.get("parts") or {})}


def save(out: Path, result: dict[str, Any]) -> None:
    (out / RESULT).write_text(json.dumps(result, indent=2))
    (out / "streaming_bench.md").write_text(report(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-streaming"))
    ap.add_argument("--parts", nargs="+", default=["all"], help=f"any of {', '.join([*GROUPS, *PARTS])}")
    ap.add_argument("--missing", action="store_true", help="only the parts DIR has no result of (or a failed one)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few rows, CPU")
    ap.add_argument("--model", default="shape:qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--row-chars", type=int, default=250, help="characters (~tokens) per row")
    ap.add_argument("--answer-chars", type=int, default=48)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=16, help="tune: trials training at once (the --batch)")
    ap.add_argument("--every-steps", type=int, default=32, help="tune: an intermediate eval every N adapter steps")
    ap.add_argument("--tune-seed", type=int, default=None, help="tune: the sampler's seed (default: the space's)")
    ap.add_argument("--no-profile", action="store_true",
                    help="plan with a cached profile or the analytic cost model (no `plora profile` first)")
    ap.add_argument("--part-timeout", type=float, default=None, help="seconds a part may run")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part is not None:  # the child: one part, settings from DIR
        s = json.loads((args.out / SETTINGS).read_text())
        (args.out / "parts").mkdir(exist_ok=True)
        (args.out / "parts" / f"{args.part}.json").write_text(json.dumps(run_part(args.part, s), indent=2))
        return

    if args.smoke:
        os.environ.setdefault("PLORA_CACHE_DIR", str(args.out / "cache"))
    settings = settings_from(args)
    (args.out / SETTINGS).write_text(json.dumps(settings, indent=2))
    (args.out / "data").mkdir(exist_ok=True)
    write_variant(args.out / "data", "fixed", rows=settings["rows"], eval_samples=settings["eval_samples"],
                  row_chars=settings["row_chars"], answer_chars=settings["answer_chars"], seq=settings["seq"])
    result = load_result(args.out, settings)
    parts = wanted_parts(args.parts)
    if args.missing:
        parts = [p for p in parts if p not in result["parts"] or "error" in result["parts"][p]]
    for part in parts:
        print(f"--- {part}", flush=True)
        done = args.out / "parts" / f"{part}.json"
        done.unlink(missing_ok=True)
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--out", str(args.out),
                                   "--part", part], timeout=args.part_timeout, check=False)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
        if code == 0 and done.is_file():
            result["parts"][part] = json.loads(done.read_text())
        else:
            result["parts"][part] = {"error": f"exit code {code}", "finished_at": time.time()}
        brief = {k: v for k, v in result["parts"][part].items() if k not in ("jobs", "told")}
        print(json.dumps(brief), flush=True)
        save(args.out, result)
    save(args.out, result)
    for name in PARTS:  # the jobs first, the short table last
        if name in result["parts"] and "error" not in result["parts"][name]:
            print("\n".join(job_table(name, result["parts"][name])))
    print(head_line(result) + "\n")
    print("\n".join(table(result)))

if __name__ == "__main__":
    main()
