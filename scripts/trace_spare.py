"""Where a spare job process's time goes before its job can start, each stage timed in a fresh
interpreter as `plora.train.spare` pays it: the imports up to ``ready``, then the model's
preload, Triton's prewarm (its parts) and the GPU warm-up, either side by side as the spare
runs them (the prewarm on a thread beside the preload) or one after another.

A sweep's first job waits at its hand-over for whatever of this is not done yet; on an H200 a
warm 0.5B sweep's job waited 1.75 s for it. This says which stage to shorten.

    python scripts/trace_spare.py --out DIR                 # on the GPU machine
    python scripts/trace_spare.py --device cpu --model shape:tiny-llama   # here: the imports only

Writes DIR/spare_trace.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODES = ("spare", "serial", "profile")


def child(mode: str, model: str, device: str, seq: int, born: float) -> dict:
    """One spare's start in this process: seconds from ``born``, when its parent started it
    (a process's creation time as the kernel reports it is whole seconds off)."""
    marks: dict = {}

    def mark(name: str) -> None:
        marks[name] = round(time.time() - born, 3)

    mark("interpreter")
    import torch

    mark("torch")
    from plora.models.torchtune_imports import import_job_modules, lean_job_imports

    lean_job_imports()
    from torchtune import config  # noqa: F401

    mark("torchtune")
    import plora.engine.spare  # noqa: F401
    import plora.train.packed_lora  # noqa: F401
    import plora.train.preload  # noqa: F401

    mark("recipe")
    import_job_modules()
    mark("ready")
    import gc

    gc.collect()
    gc.freeze()
    mark("gc")
    from plora.spec.model import ModelConfig
    from plora.train import preload
    from plora.train.gpu_warm_up import warm_up
    from plora.train.packed_lora import _pick_device

    spec = ModelConfig(path=model, max_seq_len=seq, dtype="bfloat16")
    key = preload.ModelKey.of(spec.resolved_path(), spec.family, seq, "bfloat16", _pick_device(device), spec.random_init)
    parts: dict = {}

    def prewarm() -> None:
        from plora.kernels.prewarm import prewarm as run

        if torch.cuda.is_available():
            parts.update(run(torch.device("cuda", torch.cuda.current_device())))
        mark("prewarmed")

    if mode == "spare":
        import threading

        thread = threading.Thread(target=prewarm)
        thread.start()
        preload.hold(key)
        mark("preloaded")
        seconds = warm_up(preload.held_model(key), key.device) if device == "cuda" else None
        mark("warmed_up")
        thread.join()
        mark("all")
    else:  # one after another; ``profile``: each stage under cProfile (its top entries kept)
        profiles: dict[str, str] = {}
        profiled(mode == "profile", profiles, "preload", lambda: preload.hold(key))
        mark("preloaded")
        seconds = profiled(mode == "profile", profiles, "warm_up", lambda: warm_up(preload.held_model(key), key.device)
                           if device == "cuda" else None)
        mark("warmed_up")
        profiled(mode == "profile", profiles, "prewarm", prewarm)
        mark("all")
        if profiles:
            return {"mode": mode, "marks": marks, "profiles": profiles, "prewarm_parts": parts, "warm_up_s": seconds}
    return {"mode": mode, "marks": marks, "prewarm_parts": {k: round(v, 3) for k, v in parts.items()},
            "warm_up_s": seconds}


def profiled(on: bool, into: dict, name: str, fn):
    """``fn()``, under cProfile where ``on`` (its top 40 entries by cumulative time into ``into``)."""
    if not on:
        return fn()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    into[name] = text.getvalue()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("spare-trace"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="shape:qwen2.5-0.5b")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--born", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("TRACE " + json.dumps(child(args.child, args.model, args.device, args.seq, args.born)), flush=True)
        return
    rows = []
    for _ in range(args.repeat):
        for mode in args.modes:
            proc = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model, "--device",
                                   args.device, "--seq", str(args.seq), "--born", repr(time.time())], capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("TRACE ")), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"{mode}: no trace")
            row = json.loads(line.removeprefix("TRACE "))
            rows.append(row)
            for name, text in row.pop("profiles", {}).items():
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"profile-{name}.txt").write_text(text)
            print(f"{mode:<7} " + "  ".join(f"{k} {v:.2f}" for k, v in row["marks"].items())
                  + f"  prewarm {row['prewarm_parts']}  warm-up {row['warm_up_s']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spare_trace.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
