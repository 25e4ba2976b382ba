"""A job's main thread under cProfile, in three pieces: from the job's start to the end of its
first step (set-up, the base eval, the first step), its second step, and the steps around the
first adapters' leaving (their evals and saves, the next composition's first step).

A diagnostic for the GPU machine, installed through the test-hook variable the engine passes to
every job (`plora.train.hooks`), with the folder the pieces go to:

    PLORA_TEST_HOOKS=$PWD/scripts/job_profile_hooks.py PLORA_PROFILE_OUT=DIR python scripts/bench_first_sweep.py ...

(the file by its absolute path: each job runs in its own folder, where a relative one names
nothing and the job fails at start).

Writes DIR/<pid>-<piece>.txt (top entries by own and by cumulative time) and DIR/<pid>.json
(each piece's wall seconds).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

from plora.train import hooks

OUT = Path(os.environ.get("PLORA_PROFILE_OUT", "job-profile"))
#: (piece, the step after which it starts or None: at import, the step after which it ends or
#: -1: at the process's exit); ``PLORA_PROFILE_PIECES`` = ``name:begin:end,...`` (begin empty:
#: at import) overrides them
PIECES = [(n, int(b) if b else None, int(e)) for n, b, e in
          (p.split(":") for p in os.environ.get("PLORA_PROFILE_PIECES", "start::0,second:0:1,leaving:126:129").split(","))]
_state: dict = {"prof": None, "piece": None, "t": 0.0, "walls": {}}


def _begin(name: str) -> None:
    _state["prof"], _state["piece"], _state["t"] = cProfile.Profile(), name, time.perf_counter()
    _state["prof"].enable()


def _end() -> None:
    prof, name = _state["prof"], _state["piece"]
    prof.disable()
    _state["walls"][name] = time.perf_counter() - _state["t"]
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(60)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{os.getpid()}-{name}.txt").write_text(s.getvalue())
    (OUT / f"{os.getpid()}.json").write_text(json.dumps(_state["walls"], indent=1))
    _state["prof"] = None


def after_step(recipe, step: int) -> None:
    if _state["prof"] is not None:
        end = next(e for n, _, e in PIECES if n == _state["piece"])
        if 0 <= end <= step:
            _end()
    if _state["prof"] is None:
        for name, begin, _ in PIECES:
            if begin == step and name not in _state["walls"]:
                _begin(name)


def _exit_after_end(code: int = 0, _exit=os._exit) -> None:
    """A job leaves through `os._exit` (no atexit): the piece open then ends first."""
    if _state["prof"] is not None:
        _end()
    _exit(code)


hooks.register("after_step", after_step)
os._exit = _exit_after_end
for _name, _begin_at, _ in PIECES:
    if _begin_at is None:
        _begin(_name)
        break
