"""Where a command's time goes, thread by thread: runs a Python module as ``python -m`` would,
with a thread that samples every thread's stack every ``--every`` seconds, and writes what it
saw when the command exits (or is interrupted).

A diagnostic for the GPU machine, where no sampling profiler is installed: cProfile shows a
thread's own calls, not which of a process's threads held the interpreter while another
waited, nor the moment each part ran.

    python scripts/stack_samples.py OUT.txt -- -m plora.cli sweep space.yaml --restart

OUT.txt holds, per thread: its samples' innermost frames by count (own time), the frames
on its stacks by count (inclusive time), and a timeline: every ``--bucket`` seconds, the
innermost frame of ``--focus`` (a path fragment, default ``plora``) seen most often.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import runpy
import sys
import threading
import time
from pathlib import Path


class Sampler:
    """Samples ``sys._current_frames()`` on a daemon thread; `report` summarises."""

    def __init__(self, every: float, focus: str) -> None:
        self.every, self.focus, self.t0 = every, focus, time.time()
        self.samples: list[tuple[float, str, list[str]]] = []  # (seconds, thread name, frames outer->inner)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.every):
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.time() - self.t0
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{code.co_filename}:{code.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                stack.reverse()
                self.samples.append((now, names.get(ident, str(ident)), stack))

    def report(self, bucket: float, top: int = 40) -> str:
        out: list[str] = [f"{len(self.samples)} samples every {self.every} s"]
        by_thread: dict[str, list[tuple[float, list[str]]]] = collections.defaultdict(list)
        for t, name, stack in self.samples:
            by_thread[name].append((t, stack))
        for name, rows in by_thread.items():
            own = collections.Counter(_short(s[-1]) for _, s in rows if s)
            incl = collections.Counter()
            for _, s in rows:
                incl.update({_short(f, line=False) for f in s})
            out += ["", f"== thread {name}: {len(rows)} samples, {rows[0][0]:.2f}-{rows[-1][0]:.2f} s",
                    "-- own (innermost frame)"]
            out += [f"{n * self.every:8.2f} s  {f}" for f, n in own.most_common(top)]
            out += ["-- inclusive"]
            out += [f"{n * self.every:8.2f} s  {f}" for f, n in incl.most_common(top)]
            out += [f"-- timeline ({bucket} s buckets; the innermost '{self.focus}' frame, and the innermost frame)"]
            buckets: dict[int, list[list[str]]] = collections.defaultdict(list)
            for t, s in rows:
                buckets[int(t / bucket)].append(s)
            for b in sorted(buckets):
                stacks = buckets[b]
                focus = collections.Counter(_innermost(s, self.focus) for s in stacks).most_common(1)[0][0]
                inner = collections.Counter(_short(s[-1]) for s in stacks if s).most_common(1)
                out.append(f"{b * bucket:7.2f}  {focus}  |  {inner[0][0] if inner else ''}")
        return "\n".join(out) + "\n"


def _short(frame: str, line: bool = True) -> str:
    path, name, lineno = frame.rsplit(":", 2)
    for cut in ("site-packages/", "/lib/python3"):
        if cut in path:
            path = path.split(cut, 1)[1]
            break
    else:
        path = "/".join(path.split("/")[-3:])
    return f"{path}:{name}" + (f":{lineno}" if line else "")


def _innermost(stack: list[str], focus: str) -> str:
    for frame in reversed(stack):
        if focus in frame.rsplit(":", 2)[0]:
            return _short(frame)
    return "-"


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit("usage: stack_samples.py OUT.txt [--every S] [--bucket S] [--focus TEXT] -- -m MODULE ARGS...")
    cut = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--every", type=float, default=0.02)
    ap.add_argument("--bucket", type=float, default=0.25)
    ap.add_argument("--focus", default="plora")
    args = ap.parse_args(argv[:cut])
    rest = argv[cut + 1:]
    if len(rest) < 2 or rest[0] != "-m":
        sys.exit("after --: -m MODULE ARGS...")
    sampler = Sampler(args.every, args.focus)

    def write() -> None:
        sampler.stop()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(sampler.report(args.bucket))

    atexit.register(write)
    sys.argv = [rest[1]] + rest[2:]
    sampler.start()
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
