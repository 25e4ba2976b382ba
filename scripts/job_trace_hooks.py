"""A job's GPU work around its one-time moments, under `torch.profiler`: what a sweep's
makespan pays beyond its steps (the first adapters' leaving eval and the next composition's
first step, the last eval and the job's end), beside two steady steps of each composition
for comparison.

A diagnostic for the GPU machine, installed through the test-hook variable the engine passes to
every job (`plora.train.hooks`), with the folder the pieces go to:

    PLORA_TEST_HOOKS=$PWD/scripts/job_trace_hooks.py PLORA_PROFILE_OUT=DIR \
        python scripts/bench_first_sweep.py --parts plora-fixed ...

(the file by its absolute path: each job runs in its own folder). ``PLORA_TRACE_PIECES``
overrides the pieces: ``name:begin:end,...``, after which steps each begins and ends (begin
-1: at the job's start, its set-up and first step; end -1: the process's exit); ``PLORA_TRACE_ONCE=1`` traces the first job process only.

Writes, per job process and piece, DIR/<pid>-<piece>.txt (wall seconds, the GPU's busy time,
the operators by GPU time and by host time) and DIR/<pid>-<piece>.json.gz (a Chrome trace
of the one-time pieces).
"""

from __future__ import annotations

import atexit
import gzip
import json
import os
import shutil
import time
from pathlib import Path

import torch

from plora.train import hooks

OUT = Path(os.environ.get("PLORA_PROFILE_OUT", "job-trace"))
_DEFAULT = "steady:20:22,leaving:126:129,drain:200:202,end:253:-1"
#: (piece, the step after which it starts, the step after which it ends; -1: at exit)
PIECES = [(n, int(b), int(e)) for n, b, e in
          (p.split(":") for p in os.environ.get("PLORA_TRACE_PIECES", _DEFAULT).split(","))]
#: pieces whose Chrome trace is kept (the steady ones are read from their tables)
TRACED = {"leaving", "end", "first"}
_state: dict = {"prof": None, "piece": None, "t": 0.0, "walls": {}}


def _begin(name: str) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
    prof.__enter__()
    _state["prof"], _state["piece"], _state["t"] = prof, name, time.perf_counter()


def _end() -> None:
    prof, name = _state["prof"], _state["piece"]
    if prof is None:
        return
    torch.cuda.synchronize()
    wall = time.perf_counter() - _state["t"]
    prof.__exit__(None, None, None)
    _state["prof"] = None
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6
    events = prof.key_averages()
    OUT.mkdir(parents=True, exist_ok=True)
    head = f"piece {name}: wall {wall:.3f} s, GPU busy {busy:.3f} s, kernels {len(kernels)}\n\n"
    (OUT / f"{os.getpid()}-{name}.txt").write_text(
        head + events.table(sort_by="self_device_time_total", row_limit=45) + "\n\n"
        + events.table(sort_by="cpu_time_total", row_limit=45) + "\n")
    _state["walls"][name] = {"wall_s": round(wall, 4), "gpu_busy_s": round(busy, 4), "kernels": len(kernels)}
    (OUT / f"{os.getpid()}.json").write_text(json.dumps(_state["walls"], indent=1))
    if name in TRACED:
        raw = OUT / f"{os.getpid()}-{name}.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()


def after_step(recipe, step: int) -> None:
    if _state["prof"] is not None:
        end = next(e for n, _, e in PIECES if n == _state["piece"])
        if end >= 0 and step >= end:
            _end()
    if _state["prof"] is None:
        for name, begin, _ in PIECES:
            if begin == step and name not in _state["walls"]:
                _begin(name)


def _exit_after_end(code: int = 0, _exit=os._exit) -> None:
    """A job leaves through `os._exit` (no atexit): the piece open then ends first."""
    _end()
    _exit(code)


#: with ``PLORA_TRACE_ONCE=1`` only the first job process to load this traces (a sweep run
#: again in the same benchmark is then left untouched)
_ONCE = OUT / "traced-once"
if os.environ.get("PLORA_TRACE_ONCE") != "1" or not _ONCE.exists():
    OUT.mkdir(parents=True, exist_ok=True)
    _ONCE.touch()
    hooks.register("after_step", after_step)
    atexit.register(_end)
    os._exit = _exit_after_end
    for _name, _begin_at, _ in PIECES:
        if _begin_at < 0:  # a piece from the job's start (the hooks load as it begins): its set-up and first step
            _begin(_name)
            break
