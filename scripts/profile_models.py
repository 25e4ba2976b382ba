"""Profile random-init model shapes on this GPU and check the cost model on held-out packs.

For each MODEL:SEQ configuration: probe jobs (`plora.cost.profiling.profile.profile_model`) fit the
memory and step-time model; then packs not used in the fit are run as fresh jobs --
random mixes of ranks and batch sizes, and packs the model predicts *just* fit at the load
factor (which shows whether a predicted fit really fits) -- and compared with the
predictions. Each configuration runs in its own process, so a failure (or a CUDA error
that poisons the context) costs only that configuration, and that process' CUDA context is
the only one on the device while it measures.

    python scripts/profile_models.py --out DIR                       # the acceptance run
    python scripts/profile_models.py --out DIR --configs qwen2.5-3b:1024:ac --budget-s 200   # activation checkpointing
    python scripts/profile_models.py --refit DIR                     # fit and tables again
    python scripts/profile_models.py --extract DIR --to scripts/profiles

DIR receives four files: table.md (one row per configuration), packs.md (every pack,
measured and predicted), results.json (the summary, every profile and every raw
measurement) and log.txt. Working files (per-configuration raw JSONL, profiles, logs) go
to --work (default DIR/work). ``--extract`` writes each profile of DIR/results.json as
``<model>-seq<seq>.json`` in profile.json format: `CostModel.load` reads them, e.g.
``scripts/bench_planner.py --profile scripts/profiles/qwen2.5-7b-seq1024.json``.
Without CUDA it profiles on the CPU (for trying the script; use --configs tiny-qwen:32).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = "qwen2.5-0.5b:256,qwen2.5-0.5b:1024,qwen2.5-7b:256,qwen2.5-7b:1024,qwen2.5-3b:1024"
#: share of the time budget per configuration, by model (H200: probes of the 7B shape take
#: ~1.3x those of the 0.5B; builds are random-init on the device, steps ~0.2-0.9 s)
WEIGHT = {"tiny-qwen": 1.0, "qwen2.5-0.5b": 1.0, "qwen2.5-1.5b": 1.1, "qwen2.5-3b": 1.2, "qwen2.5-7b": 1.3}
#: the first configuration also pays for CUDA start-up and kernel compilation
FIRST_EXTRA_S = 20.0
#: validation packs that run even past a configuration's deadline
MIN_CHECKS = 3


def preset(name: str):
    """A `ModelShape` preset, or ``tiny-qwen`` (a toy shape for trying the script on a CPU)."""
    from plora.models.shape import ModelShape

    if name == "tiny-qwen":
        return ModelShape("tiny-qwen", 107_072, 64, 128, 2, 4, 2, 16, 512, 2, True)
    return ModelShape.preset(name)


def parse_config(config: str) -> tuple[str, int, bool]:
    """``MODEL:SEQ`` or ``MODEL:SEQ:ac`` (with activation checkpointing) -> (model, seq, ac)."""
    parts = config.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "ac"):
        raise SystemExit(f"configuration {config!r}: expected MODEL:SEQ or MODEL:SEQ:ac")
    return parts[0], int(parts[1]), len(parts) == 3


def tag_of(config: str) -> str:
    model, seq, ac = parse_config(config)
    return f"{model}-seq{seq}" + ("-ac" if ac else "")


def config_of(tag: str) -> str:
    model, seq = tag.rsplit("-seq", 1)
    if seq.endswith("-ac"):
        return f"{model}:{seq[:-3]}:ac"
    return f"{model}:{seq}"


def _raw_from_results(out: Path, work: Path) -> None:
    """Rebuild the raw JSONL files from OUT/results.json (which keeps every measurement),
    so a run fetched from the GPU machine without its working files can be refitted."""
    data = json.loads((out / "results.json").read_text())
    (work / "raw").mkdir(parents=True, exist_ok=True)
    for tag, raw in data.get("raw", {}).items():
        lines = [json.dumps({"meta": raw.get("meta", {})})] + [json.dumps(m) for m in raw.get("measurements", [])]
        (work / "raw" / f"{tag}.jsonl").write_text("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> int:
    """Profile one configuration in this process; every measurement goes to the raw file
    as it is taken, so a configuration stopped by the budget can still be fitted."""
    import torch

    from plora.models.loading import write_shape_folder
    from plora.cost.profiling.cache import _backend
    from plora.cost.profiling.probes import Measurement
    from plora.cost.profiling.profile import profile_model

    model, seq, ac = parse_config(args.config)
    shape = preset(model)
    tag = tag_of(args.config)
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    gpu_memory = float(torch.cuda.get_device_properties(0).total_memory) if cuda else 16 * 2**30
    raw = args.work / "raw" / f"{tag}.jsonl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "backend": _backend("cuda" if cuda else "cpu", ac),
            "gpu_memory_bytes": gpu_memory, "targets": args.targets, "dtype": args.dtype, "max_tp": args.max_tp,
            "load_factor": args.load_factor, "warmup": args.warmup, "iters": args.iters,
            "max_probe_s": args.max_probe_s, "activation_checkpointing": ac}
    raw.write_text(json.dumps({"meta": meta}) + "\n")

    def record(m: Measurement) -> None:
        with raw.open("a") as f:
            f.write(json.dumps(m.to_dict()) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder(shape, Path(tmp) / model)
        prof = profile_model(
            folder, shape, seq_len=seq, dtype=args.dtype, device="cuda" if cuda else "cpu",
            targets=args.targets, tp_degrees=shape.tp_degrees(args.max_tp), load_factor=args.load_factor,
            kmax=args.kmax, warmup=args.warmup, iters=args.iters, max_probe_s=args.max_probe_s,
            holdout=args.holdout, max_rows=None if cuda else 4, limit=cuda, gpu_memory_bytes=gpu_memory,
            num_threads=None if cuda else 1, deadline=args.deadline, min_checks=MIN_CHECKS,
            activation_checkpointing=ac,
            log=lambda s: print(s, flush=True), on_measurement=record,
        )
    path = prof.save(args.work / "profiles" / f"{tag}.json")
    s = prof.summary()
    print(f"{tag}: profile {path}; held-out time max |err| {_pct(s['time_max_abs_err'])}, "
          f"memory max |err| {_pct(s['memory_max_abs_err'])}; profiling {prof.timings['profiling_s']:.0f} s", flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def run_all(args: argparse.Namespace) -> int:
    from plora.job.step_settings import JOB_ALLOCATOR

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    for sub in ("raw", "profiles"):
        (args.work / sub).mkdir(parents=True, exist_ok=True)
    start = time.time()
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", JOB_ALLOCATOR)  # probes measure what jobs use
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
    notes = []
    log = (args.out / "log.txt").open("a")
    for i, config in enumerate(configs):
        left = args.budget_s - (time.time() - start)
        weights = [WEIGHT.get(c.split(":")[0], 1.5) * (1.3 if c.endswith(":ac") else 1.0) for c in configs[i:]]
        share = (left - (FIRST_EXTRA_S if i == 0 else 0)) * weights[0] / sum(weights) + (FIRST_EXTRA_S if i == 0 else 0)
        if share < 30:
            _say(log, f"== {config}: skipped, {left:.0f} s of the budget left")
            notes.append(f"{config} skipped (budget)")
            continue
        for attempt in range(2):
            _say(log, f"== {config}: {share:.0f} s ({env.get('PLORA_KERNELS', 'auto')} kernels)")
            rc = _run_worker(args, config, share, env, log)
            if (args.work / "profiles" / f"{tag_of(config)}.json").is_file() or attempt == 1:
                break
            # No profile: if the Triton path is what failed, the torch path may still measure.
            _, measured = _read_raw(args.work / "raw" / f"{tag_of(config)}.jsonl")
            if env.get("PLORA_KERNELS") == "torch" or not any(m.error and not m.oom for m in measured):
                break
            share = min(share, args.budget_s - (time.time() - start) - 10)
            if share < 30:
                break
            env["PLORA_KERNELS"] = "torch"
            notes.append(f"the Triton path failed on {config} (rc {rc}); later configurations use PLORA_KERNELS=torch")
            _say(log, f"!! {notes[-1]}")
    log.close()
    return report(args, configs, "; ".join(notes), time.time() - start)


def _say(log, line: str) -> None:
    print(line, flush=True)
    log.write(line + "\n")
    log.flush()


def _run_worker(args: argparse.Namespace, config: str, share: float, env: dict, log) -> int:
    deadline = time.time() + share - 10  # validation packs stop starting 10 s before the share ends
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--config", config, "--out", str(args.out),
           "--work", str(args.work), "--deadline", str(deadline), "--dtype", args.dtype, "--targets", args.targets,
           "--kmax", str(args.kmax), "--warmup", str(args.warmup), "--iters", str(args.iters),
           "--max-probe-s", str(args.max_probe_s), "--holdout", str(args.holdout), "--max-tp", str(args.max_tp),
           "--load-factor", str(args.load_factor)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    hard = time.time() + share + 40
    while True:
        if time.time() > hard:
            proc.kill()
            _say(log, f"!! {config}: stopped after {share + 40:.0f} s")
            break
        if not sel.select(timeout=1.0):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        if not line.startswith(("Skipping import", "Writing model")):
            _say(log, line.rstrip("\n"))
    return proc.wait()


# ----------------------------------------------------------------------------- report


def _read_raw(path: Path):
    """(meta, measurements) of a raw JSONL file written by a worker."""
    from plora.cost.profiling.probes import Measurement

    if not path.is_file():
        return {}, []
    meta, out = {}, []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            if "meta" in d:
                meta = d["meta"]
            else:
                out.append(Measurement.from_dict(d))
    return meta, out


def fit_config(work: Path, config: str, refit: bool):
    """The configuration's profile: the worker's, or fitted anew from its raw measurements
    (when the worker was stopped before writing it, or when ``refit`` asks)."""
    from plora.cost.profiling.cache import profile_key
    from plora.cost.profiling.errors import ProfileError
    from plora.cost.profiling.fit import fit_cost_model
    from plora.cost.profiling.record import Profile

    path = work / "profiles" / f"{tag_of(config)}.json"
    prof = Profile.load(path) if path.is_file() else None
    if prof is not None and not refit:
        return prof, "ok"
    meta, measured = _read_raw(work / "raw" / f"{tag_of(config)}.jsonl")
    if not measured:
        return None, "no measurements"
    model, seq, ac = parse_config(config)
    shape = preset(model)
    fit = [m for m in measured if m.probe.role == "fit"]
    held = [m for m in measured if m.probe.role != "fit"]
    info = {k: meta[k] for k in ("device", "backend", "dtype", "warmup", "iters") if k in meta}
    info["seq_len"] = int(seq)
    if ac:
        info["activation_checkpointing"] = True
    if "note" in meta:
        info["note"] = meta["note"]
    try:
        cm = fit_cost_model(fit, shape, int(seq), float(meta["gpu_memory_bytes"]), targets=meta.get("targets"),
                            tp_degrees=shape.tp_degrees(int(meta.get("max_tp", 8))), meta=info)
    except (ProfileError, KeyError) as e:
        return None, f"cannot fit: {e}"
    key = prof.key if prof is not None else profile_key(
        shape, seq_len=int(seq), dtype=meta.get("dtype", "bfloat16"), device_name=meta.get("device", "?"),
        backend=meta.get("backend", "?"), targets=cm.meta["targets"], activation_checkpointing=ac)
    timings = prof.timings if prof is not None else dict(meta.get("timings", {}))
    new = Profile(cm, fit, held, key, float(meta.get("load_factor", 0.9)), timings)
    new.cost_model = new.cost_model.with_meta(holdout=new.summary())
    new.save(path)
    return new, "refitted" if prof is not None or refit else "fitted from raw measurements"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def report(args: argparse.Namespace, configs: list[str], note: str, wall_s: float, refit: bool = False) -> int:
    from plora.cost.profiling.validate import summarize_errors

    rows, packs = [], []
    results = {"note": note, "wall_s": wall_s, "configs": {}, "profiles": {}, "raw": {}}
    device = backend = "?"
    for config in configs:
        prof, how = fit_config(args.work, config, refit)
        meta, measured = _read_raw(args.work / "raw" / f"{tag_of(config)}.jsonl")
        results["raw"][tag_of(config)] = {"meta": meta, "measurements": [m.to_dict() for m in measured]}
        if prof is None:
            rows.append(f"| {config} | {how} |" + " |" * 9)
            results["configs"][config] = {"error": how}
            continue
        cm = prof.cost_model
        device, backend = cm.meta.get("device", device), cm.meta.get("backend", backend)
        errs = prof.errors()
        held = [r for r in errs if r["role"] != "limit"]
        lim = [r for r in errs if r["role"] == "limit"]
        sh, sl, s = summarize_errors(held), summarize_errors(lim), prof.summary()

        def share(r):
            got = "OOM" if r["oom"] else "failed" if r["measured_bytes"] is None else \
                f"{100 * r['measured_bytes'] / cm.gpu_memory_bytes:.0f}%"
            return f"{100 * r['predicted_share']:.0f}%→{got}"

        prof_s = prof.timings.get("profiling_s")
        rows.append(
            f"| {config} | {len(prof.measurements)} | {'-' if prof_s is None else f'{prof_s:.0f} s'} | {len(held)} "
            f"| {_pct(sh['time_max_abs_err'])} ({_pct(sh['time_mean_abs_err'])}) "
            f"| {_pct(sh['memory_max_abs_err'])} ({_pct(sh['memory_mean_abs_err'])}) "
            f"| {_pct(sl['time_max_abs_err'])} | {_pct(sl['memory_max_abs_err'])} "
            f"| {', '.join(share(r) for r in lim) or '-'} | {s['predicted_fit_oom']} | {how} |")
        for r in prof.fit_errors() + errs:
            packs.append(
                f"| {config} | {r['probe']} | {r['role']} | {r['label']} | {r['tokens']} "
                f"| {_ms(r['measured_s'])} | {_ms(r['predicted_s'])} | {_pct(r['time_err'])} "
                f"| {_gib(r['measured_bytes'])} | {_gib(r['predicted_bytes'])} | {_pct(r['memory_err'])} "
                f"| {_gib(r['allocated_bytes'])} | {'yes' if r['fits'] else 'no'} | {'OOM' if r['oom'] else ''} |")
        results["configs"][config] = {"profiling_s": prof_s, "validation_s": prof.timings.get("validation_s"),
                                      "holdout": sh, "limit": sl, "all": s, "how": how}
        results["profiles"][tag_of(config)] = prof.to_dict()
    head = (f"Device: {device} ({backend} kernels). Held-out: packs not used in the fit, each a fresh job; "
            "limit: packs predicted to just fit at the load factor. Errors: max |pred/meas - 1| (mean). "
            "Memory: the job's device footprint (CUDA reserved peak + context).\n\n"
            "| model:seq | fit probes | profiling | held-out packs | step time err | peak memory err "
            "| limit: time err | limit: memory err | limit: predicted→measured share of GPU memory "
            "| predicted-fit OOMs | fit |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    table = "\n".join([head, *rows]) + ("\n\n" + note if note else "")
    pack_table = "\n".join([
        "| model:seq | pack | role | adapters | tokens | measured ms | predicted ms | time err | measured GiB "
        "| predicted GiB | memory err | allocated GiB | fits | |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *packs])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "packs.md").write_text(pack_table + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + pack_table)
    print(f"\nwall {wall_s:.0f} s")
    print(table)
    return 0


def extract(src: Path, dest: Path) -> int:
    """Each profile of SRC/results.json as DEST/<model>-seq<seq>.json."""
    data = json.loads((src / "results.json").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for tag, prof in data["profiles"].items():
        (dest / f"{tag}.json").write_text(json.dumps(prof, indent=1) + "\n")
        print(dest / f"{tag}.json")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("profile-out"))
    ap.add_argument("--work", type=Path, default=None, help="working files (default OUT/work)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="MODEL:SEQ,... (ModelShape presets)")
    ap.add_argument("--budget-s", type=float, default=510.0, help="wall-clock budget of the whole run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--targets", default="all-linear")
    ap.add_argument("--kmax", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-probe-s", type=float, default=4.0, help="cap on a probe's timed steps (seconds)")
    ap.add_argument("--holdout", type=int, default=6)
    ap.add_argument("--max-tp", type=int, default=8)
    ap.add_argument("--load-factor", type=float, default=0.9)
    ap.add_argument("--refit", type=Path, default=None, help="fit again from DIR's raw measurements, re-tabulate")
    ap.add_argument("--extract", type=Path, default=None, help="write the profiles of DIR/results.json to --to")
    ap.add_argument("--to", type=Path, default=REPO / "scripts" / "profiles")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.extract is not None:
        return extract(args.extract, args.to)
    if args.refit is not None:
        args.out = args.refit
    if args.work is None:
        args.work = args.out / "work"
    if args.worker:
        return worker(args)
    if args.refit is not None:
        if not (args.work / "raw").is_dir() and (args.out / "results.json").is_file():
            _raw_from_results(args.out, args.work)
        tags = sorted(p.stem for p in (args.work / "raw").glob("*.jsonl"))
        return report(args, [config_of(t) for t in tags], "refitted from the raw measurements", 0.0, refit=True)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
