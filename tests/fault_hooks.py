"""Faults injected into the job processes a test launches (`plora.train.hooks`).

A job imports this module when ``PLORA_TEST_HOOKS`` names it (`inject_fault` in conftest
sets both variables). ``PLORA_INJECT_FAULT="<oom|crash|kill|slow>@<job id>@<step>[@<attempts>]"``,
comma-separated, makes that job fail after that step on its first <attempts> attempts
(``PLORA_ATTEMPT`` counts from 1; without <attempts>, on every attempt); ``slow`` makes that
step take `SLOW_S` seconds longer instead.
"""

from __future__ import annotations

import os
import time

import torch

from plora.train import hooks

ENV = "PLORA_INJECT_FAULT"
#: the process that asked for the faults (`inject_fault`): only the jobs it launches get them
PARENT_ENV = "PLORA_INJECT_FAULT_PARENT"
#: seconds a ``slow`` fault adds to its step
SLOW_S = 3.0


def faults(text: str) -> list[tuple[str, str, int, int]]:
    """(kind, job id, step, attempts) of each fault ``text`` names."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split("@")
        out.append((parts[0], parts[1], int(parts[2]), int(parts[3]) if len(parts) > 3 else 10**9))
    return out


def inject(recipe, step: int) -> None:
    if os.environ.get(PARENT_ENV) == str(os.getpid()):
        return  # a recipe the test runs in its own process (a reference run): never the test's own death
    for kind, job, at, attempts in faults(os.environ.get(ENV, "")):
        if job != recipe.job_id or step != at or recipe.attempt > attempts:
            continue
        if kind == "slow":
            time.sleep(SLOW_S)
            continue
        if kind == "oom":
            raise torch.OutOfMemoryError("injected out-of-memory")
        if kind == "kill":
            os.kill(os.getpid(), 9)
        os._exit(1)


hooks.register("after_step", inject)
