"""The makespan of a whole search space on one multi-GPU host (the PLoRA paper's Figure 4):
plora against Min GPU, Max GPU and HF transformers + PEFT run N processes per GPU at once,
all on the same machine, plus whether jobs side by side run at their solo speed.

Parts (each writes its result into DIR/makespan.json, so the parts of several calls merge):

* ``contention``: the 0.5B shape and the real-row benchmark's rows (``bench_rows.py``,
  fixed), ``16 x GPUs`` configurations (rank 8-64 x alpha r/2r x batch 2/4 x one learning
  rate a GPU), packs of at most 16: ``plora sweep`` on every GPU with each job's share of
  the host's cores (`plora.engine.cpu_share`), then the same sweep with
  ``PLORA_CPU_SHARE=0`` (every job process with torch's default threads: every core), then
  each job of the first sweep again, alone on GPU 0 (its job.yaml, streaming off). A first
  sweep before them compiles the kernels and caches the calibration. Per job: wall time
  and the full pack's step time, side by side against alone; the sweep's makespan against
  its prediction; the load average.
* ``plora``: ``plora sweep`` of the Figure 4 space on ``--model`` (a random-init bf16
  shape: ``qwen2.5-3b``, ``qwen2.5-7b``, ``llama-3.2-3b``): rank 8/32/128 x alpha r/2r x lr
  1e-4/3e-4 x batch 1/2/4/8 = 48 configurations, all seven linears, one epoch of
  ``--rows`` varied rows (16-440 tokens), ``--eval-samples`` eval rows each. Whole, always.
* ``min-gpu`` / ``max-gpu``: the baselines through plora's own engine (``planner.baseline``:
  one adapter a job, at the fewest GPUs / at as many as the model splits over), on
  ``--sample`` configurations of each batch size (rank 32, alpha 2r, lr 1e-4: the job type
  is the batch size); the whole space's makespan is the list schedule of its 48 jobs, each
  taking the measured time of its batch size's jobs (stated as extrapolated).
* ``peft``: ``--peft-n`` PEFT processes per GPU at once (`bench_real_data.peft_worker`, a
  fresh process a configuration), ``--peft-sample`` configurations of each batch size; the
  whole space's wall is the mean process time of each batch size's configurations,
  summed over the 48, divided by the processes running at once (extrapolated, stated).

    python scripts/bench_makespan.py --out DIR --parts contention
    python scripts/bench_makespan.py --out DIR --model qwen2.5-3b --parts plora min-gpu max-gpu peft
    python scripts/bench_makespan.py --smoke --out DIR    # tiny model, CPU: the plumbing in a few minutes

Writes DIR/makespan.json and DIR/makespan.md; prints the Figure 4 table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import bench_first_sweep as bfs  # noqa: E402
from plora.models.families.targets import LLAMA_TARGETS  # noqa: E402

TARGETS = list(LLAMA_TARGETS)
FIG4_RANKS, FIG4_ALPHAS, FIG4_LRS, FIG4_BATCHES = [8, 32, 128], [1, 2], [1e-4, 3e-4], [1, 2, 4, 8]
SAMPLE_CONFIG = {"rank": 32, "alpha_factor": 2, "learning_rate": 1e-4}


# ---------------------------------------------------------------------------------- common
def gpu_count(args) -> int:
    if args.smoke:
        return 2
    import torch

    return torch.cuda.device_count()


def hardware(args) -> dict:
    return {"device": "cpu"} if args.smoke else {"device": "cuda", "gpus": gpu_count(args)}


def base_space(args, name: str, model: str, variant: str, space: dict, **extra) -> dict:
    return {
        "name": name,
        "model": {"path": model, "dtype": args.dtype, "max_seq_len": args.seq},
        "data": {"train": str(args.out / "data" / f"train-{variant}.jsonl"),
                 "eval": str(args.out / "data" / f"eval-{variant}.jsonl"), "max_eval_samples": args.eval_samples},
        "lora": {"targets": TARGETS, "dropout": 0.0},
        "space": space,
        "training": {"epochs": 1, "scheduler": "cosine", "grad_clip": 1.0},
        "eval": {"metrics": ["loss"], "max_new_tokens": 16},
        "hardware": hardware(args),
        "planner": {"max_adapters_per_job": args.max_per_job, **extra.pop("planner", {})},
        "output": {"dir": str(args.out / "runs")},
        **extra,
    }


def model_path(args, shape: str) -> str:
    return args.smoke_model if args.smoke else f"shape:{shape}"


def load_average() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


class LoadSampler:
    """The 1-minute load average, sampled while a sweep runs (its peak is what the paper's
    4-GPU run showed: 85 on 64 cores)."""

    def __init__(self) -> None:
        import threading

        self.samples: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(2.0):
            la = load_average()
            if la:
                self.samples.append(la[0])

    def close(self) -> dict:
        self.stop.set()
        self.thread.join()
        return {"load_avg_peak": max(self.samples, default=None), "cores": os.cpu_count()}


def sweep(args, space: dict, label: str, env: dict | None = None) -> dict:
    """`plora sweep` in a fresh process (`bench_first_sweep.run_sweep`), with the run's jobs."""
    path = bfs.write_space(args, label, space)
    saved = dict(os.environ)
    os.environ.update(env or {})
    sampler = LoadSampler()
    try:
        out = bfs.run_sweep(args, path, args.out / "caches", label, fresh=False)
    finally:
        load = sampler.close()
        os.environ.clear()
        os.environ.update(saved)
    out.update(load)
    out["jobs_run"] = job_rows(path)
    return out


def job_rows(space: Path) -> list[dict]:
    """Each job of the run: adapters, TP, GPUs, wall (launch to exit), the full pack's step."""
    from plora.engine.journal import Journal
    from plora.spec.loading import load_spec

    run = load_spec(space).run_dir(None)
    journal = Journal(run / "journal.sqlite")
    try:
        jobs = journal.jobs()
    finally:
        journal.close()
    rows = []
    for j in jobs:
        if j.started is None or j.ended is None:
            continue
        row = {"job": j.id, "adapters": len(j.adapters), "tp": j.tp, "gpus": j.gpus, "status": j.status,
               "start_s": j.started, "wall_s": j.ended - j.started,
               "predicted_s": (j.predicted_end - j.predicted_start)
               if j.predicted_end is not None and j.predicted_start is not None else None}
        row.update(full_pack_step(run / "jobs" / j.id))
        rows.append(row)
    t0 = min((r["start_s"] for r in rows), default=0.0)
    for r in rows:
        r["start_s"] -= t0
    return rows


def full_pack_step(job_dir: Path) -> dict:
    """The steady step time of the job's fullest pack (its phases in summary.json)."""
    try:
        s = json.loads((job_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    phases = [p for p in s.get("phases", {}).get("phases", []) if p.get("steps", 0) > 2 and p.get("rest_s")]
    if not phases:
        return {}
    full = max(phases, key=lambda p: (sum(p.get("rows", [0])), p["steps"]))
    return {"pack_rows": sum(full.get("rows", [])), "step_s": full["rest_s"] / (full["steps"] - 1),
            "job_wall_s": s.get("wall_time_s")}


def list_schedule(durations: list[tuple[float, int]], gpus: int) -> float:
    """Longest first, each job on the ``tp`` GPUs free earliest: the baselines' schedule."""
    free = [0.0] * gpus
    for d, tp in sorted(durations, key=lambda x: -x[0]):
        chosen = sorted(range(gpus), key=lambda g: free[g])[:tp]
        end = max(free[g] for g in chosen) + d
        for g in chosen:
            free[g] = end
    return max(free, default=0.0)


# ------------------------------------------------------------------------------ contention
def part_contention(args) -> dict:
    g = gpu_count(args)
    lrs = [1e-4, 2e-4, 3e-4, 5e-4, 7e-4, 1e-3, 2e-3, 3e-3][:max(1, g)]
    space = {"strategy": "grid", "rank": [8, 16, 32, 64], "alpha": {"relative": [1, 2]},
             "learning_rate": lrs, "batch_size": [2, 4]}
    data = base_space(args, "contention", model_path(args, "qwen2.5-0.5b"), "fixed", space)
    path = args.out / "makespan.json"
    earlier = (json.loads(path.read_text()).get("contention") or {}) if path.is_file() else {}
    out: dict = {**earlier, "gpus": g, "configs": 16 * len(lrs)}
    runs = args.contention_runs
    if "warm-up" in runs:
        out["warm-up"] = {k: v for k, v in sweep(args, data, "contention-warmup").items() if k in ("wall_s", "makespan_s")}
    if "shared" in runs:
        out["shared"] = sweep(args, data, "contention-shared")
    if "unshared" in runs:
        out["unshared"] = sweep(args, data, "contention-unshared", {"PLORA_CPU_SHARE": "0"})
    if "alone" in runs:
        out["alone"] = alone(args, data, out["shared"]["jobs_run"])
    return out


def alone(args, space: dict, jobs: list[dict]) -> list[dict]:
    """Each job of the shared sweep again, alone on the first GPU: its job.yaml, its own
    output folder, no streaming (nothing joins it)."""
    import yaml

    from plora.engine.local import launch
    from plora.job.config import JobConfig, JobStreaming
    from plora.spec.loading import parse_spec

    run = parse_spec(space, args.out).run_dir(None)
    rows = []
    for j in jobs:
        if j["tp"] != 1:
            continue
        cfg = JobConfig.parse(yaml.safe_load((run / "jobs" / j["job"] / "job.yaml").read_text()))
        folder = args.out / "alone" / j["job"]
        cfg = cfg.model_copy(update={"output_dir": folder, "job_dir": folder / "job", "streaming": JobStreaming(),
                                     "eval_base": False})
        cfg.job_dir.mkdir(parents=True, exist_ok=True)
        cfg.write(cfg.job_dir / "job.yaml")
        t0 = time.time()
        caches = {"PLORA_CACHE_DIR": str(args.out / "caches" / "plora"),  # as the sweeps had them
                  "TRITON_CACHE_DIR": str(args.out / "caches" / "triton")}
        proc = launch(j["job"], cfg.job_dir, "cuda:0", gpus=[] if args.smoke else [0], extra_env=caches)
        code = proc.proc.wait()
        rows.append({"job": j["job"], "exit_code": code, "wall_s": time.time() - t0,
                     **full_pack_step(cfg.job_dir)})
    return rows


# --------------------------------------------------------------------------- the figure's
def fig4_space(args, shape: str, name: str, configs: list[dict] | None = None, **extra) -> dict:
    space = ({"strategy": "list", "configs": configs} if configs is not None else
             {"strategy": "grid", "rank": FIG4_RANKS, "alpha": {"relative": FIG4_ALPHAS},
              "learning_rate": FIG4_LRS, "batch_size": FIG4_BATCHES})
    return base_space(args, name, model_path(args, shape), "varied", space, **extra)


def fig4_configs() -> list[tuple[int, float, float, int]]:
    return [(r, a * r, lr, bs) for r in FIG4_RANKS for a in FIG4_ALPHAS for lr in FIG4_LRS for bs in FIG4_BATCHES]


def part_plora(args, shape: str, label: str) -> dict:
    return sweep(args, fig4_space(args, shape, f"fig4-{shape}-plora"), f"fig4-{shape}-{label}")


def part_baseline(args, shape: str, baseline: str) -> dict:
    """The baseline on a sample (each batch size's jobs, `--sample` of each), extrapolated to
    the whole space's 48 jobs by batch size."""
    c = SAMPLE_CONFIG
    configs = [{"rank": c["rank"], "alpha": c["alpha_factor"] * c["rank"], "learning_rate": lr, "batch_size": bs}
               for bs in FIG4_BATCHES for lr in ([c["learning_rate"], 3e-4, 2e-4, 5e-4][:args.sample])]
    name = f"fig4-{shape}-{baseline.replace('_', '-')}"
    out = sweep(args, fig4_space(args, shape, name, configs, planner={"baseline": baseline, "max_adapters_per_job": 1}),
                name)
    per_bs: dict[int, list[float]] = {}
    tp_of: dict[int, int] = {}
    from plora.spec.loading import parse_spec

    spec = parse_spec(fig4_space(args, shape, name, configs), args.out)
    by_id = {cfg.id: cfg.batch_size for cfg in spec.expand()}
    from plora.engine.journal import Journal

    journal = Journal(spec.run_dir(None) / "journal.sqlite")
    try:
        adapters_of = {j.id: j.adapters for j in journal.jobs()}
    finally:
        journal.close()
    for j in out["jobs_run"]:
        bs = by_id.get(adapters_of.get(j["job"], [None])[0])
        if bs is None or j["status"] not in ("finished", "done"):
            continue
        per_bs.setdefault(bs, []).append(j["wall_s"])
        tp_of[bs] = j["tp"]
    mean = {bs: sum(v) / len(v) for bs, v in per_bs.items()}
    whole = [(mean[bs], tp_of[bs]) for (_, _, _, bs) in fig4_configs() if bs in mean]
    out["job_s_by_batch"] = mean
    out["tp_by_batch"] = tp_of
    out["extrapolated"] = True
    out["makespan_whole_s"] = list_schedule(whole, gpu_count(args)) if len(whole) == len(fig4_configs()) else None
    return out


def part_peft(args, shape: str) -> dict:
    """PEFT, N processes per GPU at once, a fresh process a configuration, on a sample."""
    import bench_real_data as brd
    from plora.spec.loading import parse_spec

    spec = parse_spec(fig4_space(args, shape, f"fig4-{shape}-peft"), args.out)
    folder = args.out / f"peft-{shape}"
    folder.mkdir(exist_ok=True)
    configs = fig4_configs()
    job = {"model": str(spec.model.resolved_path(weights=True)), "random_init": spec.model.random_init, "dtype": args.dtype,
           "device": "cpu" if args.smoke else "cuda", "seq": args.seq,
           "train": str(args.out / "data" / "train-varied.jsonl"), "eval": str(args.out / "data" / "eval-varied.jsonl"),
           "eval_samples": args.eval_samples, "metrics": ["loss"], "max_new_tokens": 16, "ranks": FIG4_RANKS,
           "configs": [list(c) for c in configs], "base": str(args.out / f"peft-base-{shape}"),
           "adapters": str(folder / "adapters")}
    job_path = folder / "job.json"
    job_path.write_text(json.dumps(job))
    env = brd.baseline_env()
    worker = [sys.executable, str(HERE / "bench_real_data.py"), "--peft-worker", str(job_path)]
    t0 = time.time()
    if not (Path(job["base"]) / "config.json").is_file():
        subprocess.run(worker + ["--peft-save-base"], env=env, cwd=str(REPO), check=True)
    out: dict = {"save_base_s": time.time() - t0}
    g = gpu_count(args)
    by_bs: dict[int, list[int]] = {}
    for i, (r, _, lr, bs) in enumerate(configs):
        by_bs.setdefault(bs, []).append(i)
    # a mix of ranks within each batch size: every third configuration of its list
    take = [i for k in range(args.peft_sample) for bs in FIG4_BATCHES for i in by_bs[bs][k * 5 % len(by_bs[bs]):][:1]]
    for n in args.peft_n:
        slots = n * g
        runs, started = bfs.run_pool(worker, env, take, slots, folder / f"n{n}", gpus=0 if args.smoke else g)
        ok = [r for r in runs if "seconds" in r]
        per: dict[int, list[float]] = {}
        for r in ok:
            per.setdefault(int(r["batch_size"]), []).append(r["process_s"])
        mean = {bs: sum(v) / len(v) for bs, v in per.items()}
        whole = sum(mean[bs] for (_, _, _, bs) in configs) / slots if len(mean) == len(FIG4_BATCHES) else None
        out[str(n)] = {"per_gpu": n, "slots": slots, "configs_run": len(ok), "failed": len(take) - len(ok),
                       "measured_wall_s": time.time() - started, "process_s_by_batch": mean,
                       "extrapolated": True, "wall_whole_s": whole, "runs": runs}
        print(f"peft {n}/GPU: {whole if whole is None else round(whole, 1)} s (extrapolated)", flush=True)
    return out


# ------------------------------------------------------------------------------------ main
def figure_table(result: dict) -> list[str]:
    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else "–"

    lines = [f"device: {result.get('device')} x {result.get('gpus')}", "",
             "| model | Min GPU s | Max GPU | plora | concurrent PEFT (best N/GPU) | plora predicted / measured |",
             "| --- | --- | --- | --- | --- | --- |"]
    for shape, r in sorted((result.get("figure4") or {}).items()):
        mn = (r.get("min-gpu") or {}).get("makespan_whole_s")
        mx = (r.get("max-gpu") or {}).get("makespan_whole_s")
        pl = (r.get("plora") or {}).get("makespan_s")
        pw = (r.get("plora") or {}).get("wall_s")
        pred = (r.get("plora") or {}).get("predicted_makespan_s")
        first = r.get("plora-first") or {}
        peft = [(v["wall_whole_s"], n) for n, v in (r.get("peft") or {}).items()
                if isinstance(v, dict) and v.get("wall_whole_s")]
        best = min(peft) if peft else None

        def norm(x):
            return f"{x / mn:.3f}" if mn and x else "–"

        lines.append(f"| {shape} | {f(mn)} (1.0) | {f(mx)} ({norm(mx)}) | makespan {f(pl)} ({norm(pl)}), wall {f(pw)} "
                     f"({norm(pw)}) | {f(best[0]) if best else '–'} ({norm(best[0]) if best else '–'}, N={best[1] if best else '–'}) | "
                     f"{f(pred)} / {f(pl)} |")
        if first:
            lines.append(f"| {shape}, plora first use | | | makespan {f(first.get('makespan_s'))} ({norm(first.get('makespan_s'))}), "
                         f"wall {f(first.get('wall_s'))} ({norm(first.get('wall_s'))}) | | "
                         f"{f(first.get('predicted_makespan_s'))} / {f(first.get('makespan_s'))} |")
    c = result.get("contention")
    if c:
        alone_by = {a["job"]: a for a in c.get("alone", [])}
        lines += ["", "| contention job | adapters | alone s | shared s | shared / alone | step alone ms | step shared ms |"
                  " step unshared ms |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        unshared = {j["job"]: j for j in (c.get("unshared") or {}).get("jobs_run", [])}
        for j in (c.get("shared") or {}).get("jobs_run", []):
            a = alone_by.get(j["job"], {})
            u = unshared.get(j["job"], {})
            ratio = j["wall_s"] / a["wall_s"] if a.get("wall_s") else None
            lines.append(f"| {j['job']} | {j['adapters']} | {f(a.get('wall_s'))} | {f(j['wall_s'])} | {f(ratio, '{:.2f}')} | "
                         f"{f(1e3 * a['step_s'] if a.get('step_s') else None)} | {f(1e3 * j['step_s'] if j.get('step_s') else None)} | "
                         f"{f(1e3 * u['step_s'] if u.get('step_s') else None)} |")
        for kind in ("shared", "unshared"):
            s = c.get(kind)
            if not s:
                continue
            lines.append(f"{kind}: makespan {f(s.get('makespan_s'))} s, predicted {f(s.get('predicted_makespan_s'))} s, "
                         f"wall {f(s.get('wall_s'))} s, load average peak {s.get('load_avg_peak')} on {s.get('cores')} cores")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-makespan"))
    ap.add_argument("--parts", nargs="+", default=["contention"],
                    choices=["contention", "plora", "min-gpu", "max-gpu", "peft"])
    ap.add_argument("--model", default="qwen2.5-3b", help="the Figure 4 parts' shape preset")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few rows, CPU")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=128, help="training rows (one epoch) of every configuration")
    ap.add_argument("--contention-rows", type=int, default=256)
    ap.add_argument("--contention-runs", nargs="+", default=["warm-up", "shared", "unshared", "alone"],
                    choices=["warm-up", "shared", "unshared", "alone"])
    ap.add_argument("--plora-runs", type=int, default=1, choices=[1, 2],
                    help="2: the model's first sweep here, then a warm one (the result)")
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--max-per-job", type=int, default=16)
    ap.add_argument("--sample", type=int, default=1, help="baseline jobs run per batch size")
    ap.add_argument("--peft-n", type=int, nargs="+", default=[2, 4], help="PEFT processes per GPU")
    ap.add_argument("--peft-sample", type=int, default=2, help="PEFT configurations run per batch size")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from bench_real_data import smoke_model

        args.smoke_model = str(smoke_model(args.out))
        args.dtype, args.seq, args.rows, args.contention_rows, args.eval_samples = "float32", 64, 8, 8, 2
        args.peft_n = [1]
    from bench_rows import write_variant

    (args.out / "data").mkdir(exist_ok=True)
    chars = (48, 8) if args.smoke else (250, 48)
    write_variant(args.out / "data", "fixed", rows=args.contention_rows, eval_samples=args.eval_samples,
                  row_chars=chars[0], answer_chars=chars[1], seq=args.seq)
    write_variant(args.out / "data", "varied", rows=args.rows, eval_samples=args.eval_samples,
                  row_chars=chars[0], answer_chars=chars[1], seq=args.seq)
    path = args.out / "makespan.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    result["gpus"] = gpu_count(args)
    try:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        result["device"] = "unknown"
    for part in args.parts:
        t0 = time.time()
        if part == "contention":
            result["contention"] = part_contention(args)
        else:
            fig = result.setdefault("figure4", {}).setdefault(args.model, {})
            if part == "plora":  # the first sweep of the model here, then (--plora-runs 2) a warm one
                for k in range(args.plora_runs):
                    label = "plora" if k == args.plora_runs - 1 else "plora-first"
                    fig[label] = part_plora(args, args.model, label)
                    path.write_text(json.dumps(result, indent=2))
            elif part == "peft":
                fig["peft"] = part_peft(args, args.model)
            else:
                fig[part] = part_baseline(args, args.model, part.replace("-", "_"))
        result.setdefault("part_seconds", {})[f"{part}:{args.model}"] = time.time() - t0
        path.write_text(json.dumps(result, indent=2))
        print(f"{part} done in {time.time() - t0:.0f} s", flush=True)
    lines = figure_table(result)
    (args.out / "makespan.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
