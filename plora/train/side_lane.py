"""One thread beside a job's main loop that does the model's eager work while the main loop
only replays captured steps.

On a GPU a replayed step costs the host one launch and a wait, so while a pack replays its
graph the interpreter is free; what a job does at a change of its pack is not: the graph of
the next composition is captured (0.4-0.5 s of Python launches on an H200 for the
0.5B-shape benchmark, the GPU idle) and the leaving adapters are evaluated eagerly (0.3-0.5 s).
The lane does both while the GPU trains: the next composition is captured while the pack
before it still replays, and the leaving adapters are scored while the ones that stay train.

The rule that makes it safe: the model's Python state (the pack's segments, the row
boundaries, the kernels' side streams) has one user at a time. While the lane works, the
main loop does nothing with the model but replay graphs (which read no Python state); before
anything else (an eager step, a capture of its own, an eval, a checkpoint, a pack laid out
again) it waits for the lane (`SideLane.wait`). On the device an eval runs on the lane's own
stream after what the job's stream held when it was submitted (`submit_after`), a capture
records and runs nothing, and a capture from the lane is made in CUDA's thread-local mode, so
that the main loop's reads of its steps' results are allowed meanwhile.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

#: the interpreter's switch interval while a job has a lane: the main loop waits on the GPU
#: with the lock released and wants it back at once when a step ends (the default 5 ms is
#: the GPU idle that long after each step while the lane holds the lock)
SWITCH_INTERVAL_S = 0.0005


class SideLane:
    """A single worker thread for the model's eager work (module docstring). ``inline``:
    every task runs at once in the caller's thread (CPU tests of the books around it)."""

    def __init__(self, device: torch.device, *, inline: bool = False):
        self.device = device
        self._pool = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="plora-lane")
        self._pending: list[Future] = []
        self._stream = None
        self._first: Callable[[], Any] | None = None  # run before the first task (`before_first`)
        self._switch = sys.getswitchinterval()
        self._worker: int | None = None  # the lane's thread (`_enter`)
        if not inline:
            sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL_S))
            self.submit(self._enter)

    def _enter(self) -> None:
        """The worker's device (its library handles come later, `before_first`)."""
        self._worker = threading.get_ident()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def warm(self, stream: Any, dtype: torch.dtype) -> None:
        """Make the calling thread's library handles (cuBLAS, cuBLASLt, torch's attention)
        and their workspaces on ``stream``, for ``dtype`` and float32: run on the lane before
        its first task (a handle made during a capture invalidates it)."""
        if self.device.type != "cuda":
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for dt in dict.fromkeys((dtype, torch.float32)):
                a = torch.ones(16, 16, device=self.device, dtype=dt)
                torch.nn.functional.linear(a, a, a[0])
                a @ a
                if dt != torch.float32:
                    q = torch.ones(1, 2, 16, 64, device=self.device, dtype=dt, requires_grad=True)
                    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        stream.synchronize()

    def stream(self) -> Any:
        """The lane's own CUDA stream (None off a GPU): its evals run there, beside the
        replayed steps, after what the job's stream held when they were submitted."""
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def submit_after(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the lane's own stream once the job's stream has done what it holds
        now (an eval of weights the last step wrote); on a CPU, as `submit`."""
        stream = self.stream()
        if stream is None:
            return self.submit(fn)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))

        def run() -> Any:
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                out = fn()
            stream.synchronize()  # what it made is read by the job's thread next
            return out

        return self.submit(run)

    @property
    def busy(self) -> bool:
        """Whether a task submitted is still running or waiting (the main loop then leaves
        the model alone)."""
        self._pending = [f for f in self._pending if not f.done()]
        return bool(self._pending)

    def before_first(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the lane before its first task (not at once: the lane's thread then
        takes its library handles after the job's thread took its own at its first capture)."""
        self._first = fn

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the lane, after what was submitted before; its future."""
        if self._first is not None:
            first, self._first = self._first, None
            self.submit(first)
        if self._pool is None:
            f: Future = Future()
            try:
                f.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the future carries it, as a thread's would
                f.set_exception(e)
            return f
        f = self._pool.submit(fn)
        self._pending.append(f)
        return f

    def wait(self) -> None:
        """Wait until the lane is idle (what the main loop does before any work of its own
        with the model). A task's error is its future's, raised where its result is taken.
        Asked from a task of the lane itself (which would wait for itself for ever, and the
        main loop for it), it raises instead: such a task must leave that work to the main
        loop (an H200 job hung so at its 126th step)."""
        if self._worker is not None and threading.get_ident() == self._worker:
            raise RuntimeError("a task on the side lane waited for the lane: the main loop's work, not the lane's")
        pending, self._pending = self._pending, []
        for f in pending:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - raised where the task's result is taken
                pass

    def close(self) -> None:
        """Wait for the lane's tasks and stop its thread."""
        if self._pool is not None:
            self.wait()
            self._pool.shutdown(wait=True)
            self._pool = None
            sys.setswitchinterval(self._switch)
