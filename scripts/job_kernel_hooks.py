"""Which Triton kernel variants a job compiles, or loads from Triton's cache, and on which
thread: those its compile-ahead (`plora.kernels.compile_ahead`, threads named
``plora-compile``) or its spare missed are loaded at their first launch, on the job's own
thread, inside the first step's capture.

A diagnostic for the GPU machine, installed through the test-hook variable the engine passes to
every job (`plora.train.hooks`), with the folder its file goes to:

    PLORA_TEST_HOOKS=$PWD/scripts/job_kernel_hooks.py PLORA_PROFILE_OUT=DIR \
        python scripts/bench_first_sweep.py --parts plora-fixed ...

Writes DIR/<pid>-kernels.json when the job leaves: every variant Triton compiled or loaded
(its kernel, its specialization as Triton prints it, the thread, whether through a warm-up
call, seconds from the hooks' load) and every launcher built, with its thread and seconds.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

OUT = Path(os.environ.get("PLORA_PROFILE_OUT", "job-kernels"))
_T0 = time.perf_counter()
_state: dict = {"variants": [], "launchers": [], "steps": 0}


def _post_compile(*, key=None, repr=None, fn=None, compile=None, is_manual_warmup=False, already_compiled=False,
                  **_):
    _state["variants"].append({"repr": str(repr)[:400], "thread": threading.current_thread().name,
                               "warmup": bool(is_manual_warmup), "at_s": round(time.perf_counter() - _T0, 4),
                               "after_steps": _state["steps"]})
    return None


def _install() -> None:
    try:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = _post_compile
    except Exception as e:  # noqa: BLE001 - a Triton without knobs: the launchers only
        _state["hook_error"] = f"{type(e).__name__}: {e}"
    try:
        from triton.backends.nvidia import driver

        original = driver.CudaLauncher.__init__

        def init(self, src, metadata):
            t0 = time.perf_counter()
            original(self, src, metadata)
            _state["launchers"].append({"kernel": str(getattr(metadata, "name", "?")),
                                        "thread": threading.current_thread().name,
                                        "s": round(time.perf_counter() - t0, 4),
                                        "at_s": round(t0 - _T0, 4), "after_steps": _state["steps"]})

        driver.CudaLauncher.__init__ = init
    except Exception as e:  # noqa: BLE001
        _state["launcher_error"] = f"{type(e).__name__}: {e}"


def after_step(recipe, step: int) -> None:
    _state["steps"] = step + 1


def _write() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{os.getpid()}-kernels.json").write_text(json.dumps(_state, indent=1))


def _exit_after_write(code: int = 0, _exit=os._exit) -> None:
    """A job leaves through `os._exit` (no atexit)."""
    _write()
    _exit(code)


from plora.train import hooks  # noqa: E402

_install()
hooks.register("after_step", after_step)
os._exit = _exit_after_write
