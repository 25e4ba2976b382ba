"""A job process started ahead of its job, so that a job does not pay for its imports.

A job is a fresh process so that a crash or an out-of-memory never takes the sweep down
(`plora.engine.local`). Its start is mostly imports: on an H100 machine, importing
torchtune (which pulls torchao, torch._dynamo, sympy and datasets) took 8 s of a job's
11 s start, more than a quarter of a 16-adapter job. A *spare* is that same process,
started early (while the sweep validates its data, loads its cost model and plans, or
while the previous job trains): it imports the recipe, says ``ready``, and waits for its
job on stdin (`plora.train.spare`). Handing it a job takes milliseconds.

A spare starts with the environment its job will have (`plora.engine.job_env`), for the GPU
the next job is expected on: torchao's and torchtune's imports ask CUDA about the GPU, which
fixes the GPUs a process sees, so a spare takes only a job for the same GPUs (the same
``CUDA_VISIBLE_DEVICES``) and allocator settings. Only the variables in `ADJUSTABLE` may
differ; any other difference and the job starts the ordinary way, at once. A spare that
dies before it is ready (or cannot be started) turns spares off for this process. A spare
that is never used is killed; one whose sweep dies dies with it (parent-death signal).
On a host of several GPUs, each job planned to start at once gets a spare of its own (one per
GPU). The sweep's first spares are also told its base model (`preload`, a `PreloadOrder` line ahead
of the job's): it loads it once its imports are done, while the sweep plans, and the job
takes it (`plora.train.preload`); and the Triton kernels the sweep expects it to launch
(`kernels_ahead`, a `KernelsOrder`), which it loads once the sweep's kernel-warming process
has compiled them.
Setting ``PLORA_SPARE_JOBS=0`` turns spares off.
"""

from __future__ import annotations

import atexit
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from plora.bytecode_cache import PREAMBLE
from plora.engine.cpu_share import bind_to_share, host_gpu_count
from plora.engine.job_env import job_env
from plora.job.warm_order import WarmOrder
from plora.settings import ATTEMPT, SPARE_JOBS, TEST_HOOKS, settings
from plora.settings import HANDED_AT as settings_HANDED_AT

#: set to 0 to start every job the ordinary way
ENV_SWITCH = SPARE_JOBS
#: the child: imports the recipe, says ready, waits for a `SpareOrder`
CHILD_MODULE = "plora.train.spare"
#: when the job was handed to its spare (the job's clock counts its start from there)
HANDED_AT = settings_HANDED_AT
#: what the child prints once it has imported the recipe
READY = "ready"
#: what starts the child's line answering a `CheckOrder` (a `CheckAnswer` follows)
CHECKED = "checked "
#: variables a job may set differently from its spare's: read only once the job runs
ADJUSTABLE = frozenset({"OMP_NUM_THREADS", ATTEMPT, HANDED_AT, TEST_HOOKS, "PYTHONUNBUFFERED"})
#: variables a spare and its job always agree on, whoever changed them
PINNED = frozenset({"CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF"})


def module_child(module: str) -> str:
    """``python -c`` code that runs ``module`` as a program, with the sweep's working folder
    left off its import path (``python -m`` puts it first, where a stray module of the user's
    could shadow one the child imports) and its bytecode kept (`plora.bytecode_cache`)."""
    return ("import sys, runpy; del sys.path[0]; " + PREAMBLE
            + f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


#: the child process's code
CHILD = module_child(CHILD_MODULE)
#: the child's argument saying no job runs on its GPUs: it may take GPU memory (a CUDA
#: context) before its job, and starts CUDA beside its imports (`plora.train.spare`)
GPU_IDLE = "--gpu-idle"
#: how long a hand-over waits for a spare still importing (a cold start would take as long)
READY_WAIT_S = 180.0


class SpareOrder(BaseModel):
    """The last line a spare reads on stdin: its job (what `tune run` would have been given)."""

    model_config = ConfigDict(extra="forbid")

    config: str  #: the job's job.yaml
    cwd: str  #: the job's folder
    log: str  #: the job's log.txt (stdout and stderr go there, appended)
    env: dict[str, str]  #: the job's whole environment


class CheckOrder(BaseModel):
    """A line a spare may read before its job: check this model folder now, as
    `plora.models.check.check_model` does (the model built on meta: the spare has imported
    torchtune already, the sweep need not), and answer with a `CheckAnswer` line."""

    model_config = ConfigDict(extra="forbid")

    check: str  #: the model folder (a GGUF file's converted folder)
    family: str
    random_init: bool
    max_seq_len: int


class CheckAnswer(BaseModel):
    """What a spare prints after `CHECKED` for a `CheckOrder`: the folder passed, or the
    model's one-line problem; ``failed``: the check itself broke (the sweep checks again)."""

    model_config = ConfigDict(extra="forbid")

    ok: bool
    error: str | None = None
    failed: str | None = None


class PreloadOrder(BaseModel):
    """A line a spare may read before its job: load this base model now
    (`plora.train.preload`); its job takes it if it asks for the same one."""

    model_config = ConfigDict(extra="forbid")

    path: str
    family: str
    max_seq_len: int
    dtype: str
    device: str  #: the job config's device ("cuda", "auto", "cpu")
    random_init: bool


class KernelsOrder(BaseModel):
    """A line a spare may read before its job: the Triton kernels the sweep expects its first
    job to launch (``order``: the `plora.job.warm_order.WarmOrder` its kernel-warming process
    compiles), to load once that process has answered in ``warmer_log`` past byte
    ``warmer_offset``, so that they are in Triton's cache: the spare compiles nothing."""

    model_config = ConfigDict(extra="forbid")

    order: WarmOrder
    warmer_log: str
    warmer_offset: int = 0


def die_with_parent() -> None:
    """Linux parent-death signal: the process gets SIGKILL when the sweep process dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except OSError:  # not Linux: resume's stale-process check still covers it
        pass


def child_setup(env: Mapping[str, str]) -> Callable[[], None]:
    """What a job process (or a spare) runs between fork and exec: it dies with the sweep,
    and is bound to its share of the host's cores (`plora.engine.cpu_share`)."""

    def setup() -> None:
        die_with_parent()
        bind_to_share(env)

    return setup


class Spare:
    """One started spare process and the environment it started with."""

    def __init__(self, env: dict[str, str], gpus: Sequence[int] = (), *, gpu_idle: bool = False):
        """``gpu_idle``: no job runs on its GPUs (the sweep's first wave), so the child starts
        CUDA while it imports (`GPU_IDLE`)."""
        self.env, self.gpus = env, tuple(gpus)
        #: this process's environment when the spare started: what this process changes in it
        #: afterwards (its own imports' settings) its job passes on without them mattering
        self.started_from = dict(os.environ)
        self.ready = False  #: the child said ready (read from its stdout)
        self._pending = b""  #: what was read of the child's stdout past the last line
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, *([GPU_IDLE] if gpu_idle else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, start_new_session=True, preexec_fn=child_setup(env),
        )

    def compatible(self, env: dict[str, str]) -> bool:
        """Whether a job of environment ``env`` may run in this spare: every variable equal,
        but for those a job may set differently (`ADJUSTABLE`) and those this process changed
        itself after the spare started (what its own imports set, a first model check's or a
        quick calibration's: the spare's imports set theirs; on an H100's first sweep the
        inductor's cache folder alone sent the first job to a cold start of 20 s); never the
        GPUs or the allocator (`PINNED`)."""
        here = self.started_from
        changed = {k for k in set(here) | set(os.environ) if here.get(k) != os.environ.get(k)}
        keys = (set(env) | set(self.env)) - ADJUSTABLE - (changed - PINNED)
        return all(env.get(k) == self.env.get(k) for k in keys)

    def _line(self, timeout_s: float) -> str | None:
        """The child's next stdout line, waiting up to ``timeout_s``; None on a timeout or
        its end. Read from the pipe unbuffered: a line already read ahead is never left in
        a buffer that ``select`` does not see."""
        out = self.proc.stdout
        if out is None:
            return None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                return None
            chunk = os.read(out.fileno(), 65536)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode(errors="replace").strip()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the child said ready (waiting for it to finish importing, up to ``timeout_s``)."""
        if not self.ready:
            self.ready = self._line(timeout_s) == READY
        return self.ready

    def check(self, order: CheckOrder, timeout_s: float) -> CheckAnswer | None:
        """The child's answer to ``order`` (waiting for its imports first), or None where it
        gave none (dead, hung, or no spare protocol)."""
        if not self.wait_ready(timeout_s) or not self._send(order):
            return None
        line = self._line(timeout_s)
        if line is None or not line.startswith(CHECKED):
            return None
        try:
            return CheckAnswer.model_validate_json(line.removeprefix(CHECKED))
        except ValueError:
            return None

    def _send(self, order: BaseModel) -> bool:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((order.model_dump_json() + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError, AssertionError):
            return False
        return True

    def tell(self, order: PreloadOrder | KernelsOrder) -> bool:
        """Send a preload or kernels order ahead of the job (read once the child has imported)."""
        return self._send(order)

    def hand(self, order: SpareOrder) -> bool:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((order.model_dump_json() + "\n").encode())
            self.proc.stdin.close()
        except (OSError, ValueError):
            return False
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


_spares: dict[tuple[int, ...], Spare] = {}  #: by the GPUs their jobs run on (one each)
_broken = False  # a spare died before it was ready, or could not be started: no more here


def enabled() -> bool:
    return not _broken and settings().spare_jobs


def _give_up() -> None:
    global _broken
    _broken = True
    discard()


def first_gpus(device: str) -> list[int]:
    """The GPUs a sweep's first job on ``device`` ("cpu", "cuda", "auto") is expected on."""
    if device == "cpu":
        return []
    if device == "auto":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        first = visible.split(",")[0].strip() if visible is not None else "0"
        if not first or first.startswith("-"):  # CUDA reads the list up to its first invalid entry
            return []
        if host_gpu_count(torch_fallback=False) and _gpu_torch():  # no torch import (seconds) first
            return [0]
        try:
            import torch

            return [0] if torch.cuda.is_available() else []
        except Exception:  # noqa: BLE001 - a broken CUDA install: CPU jobs
            return []
    return [0]


def _gpu_torch() -> bool:
    """Whether the installed torch is a build that can use a GPU, from its version alone
    (a CPU wheel says ``+cpu``) and a GPU device node: a CPU-only container on a GPU host
    sees the driver's list, not the device."""
    from plora.gpu_facts import cuda_torch_build

    return cuda_torch_build() and (os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl"))


def first_wave(device: str, gpus: int) -> list[list[int]]:
    """The GPUs of the jobs a sweep on ``device`` with ``gpus`` GPUs starts at once: one each
    (the usual first wave of one-GPU jobs; a plan of wider jobs leaves their spares unused),
    never more than the GPUs this process sees."""
    first = first_gpus(device)
    if not first or gpus <= 1:
        return [first]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = len([v for v in visible.split(",") if v.strip()]) if visible is not None else host_gpu_count()
    return [[g] for g in range(max(1, min(gpus, seen)))]


def spare_env(gpus: Sequence[int] = ()) -> dict[str, str]:
    """What a spare for a job on ``gpus`` starts with: that job's environment."""
    return job_env(gpus)


def prime(gpus: Sequence[int] = (), *, gpu_idle: bool = False) -> None:
    """Start a spare for a job on ``gpus`` unless one is alive (a no-op when spares are off).
    Spares for other GPUs stay: on a host of several GPUs, the jobs that start side by side
    each find their own. ``gpu_idle``: no job runs on those GPUs (`Spare`)."""
    if not enabled():
        return
    key = tuple(gpus)
    there = _spares.get(key)
    if there is not None:
        if there.proc.poll() is not None:  # died unused, before any job was handed to it
            _give_up()
        return
    try:
        _spares[key] = Spare(spare_env(gpus), gpus, gpu_idle=gpu_idle)
    except OSError:  # no process to spare (memory, file handles): jobs start the ordinary way
        _give_up()


def preload(order: PreloadOrder) -> bool:
    """Have the spares there are load the sweep's base model before their jobs come (only
    for GPUs no job is running on: the first jobs'). Whether an order went out."""
    return _tell_all(order)


def kernels_ahead(order: KernelsOrder) -> bool:
    """Have the spares there are load the kernels their jobs will likely launch (as
    `preload`: only the first jobs' spares, on idle GPUs, are there when the sweep sends it;
    ``PLORA_SPARE_KERNELS=0`` sends nothing). Whether an order went out."""
    return settings().spare_kernels and _tell_all(order)


def _tell_all(order: PreloadOrder | KernelsOrder) -> bool:
    """Send ``order`` to every spare still alive; whether one took it."""
    told = False
    for spare in list(_spares.values()):
        if spare.proc.poll() is None:
            told = spare.tell(order) or told
    return told


def check_model(order: CheckOrder) -> CheckAnswer | None:
    """Have the first spare check a model folder (`CheckOrder`): its answer, or None where
    it gave none (the caller checks it itself). Waits for the spare's imports, which the
    sweep would otherwise pay again in its own process. A spare that never said ready turns
    spares off (`_give_up`: the next would hang too); one that took the order and gave no
    answer is let go (its answer, written later, would find no reader and kill it as its job
    began)."""
    for key, spare in list(_spares.items()):
        if spare.proc.poll() is not None:
            continue
        if not spare.wait_ready(READY_WAIT_S):
            _give_up()
            return None
        answer = spare.check(order, READY_WAIT_S)
        if answer is None:
            _spares.pop(key, None)
            spare.kill()
        return answer
    return None


def keep(wanted: bool, gpus: Sequence[int] = ()) -> None:
    """Start a spare for a job on ``gpus`` if more jobs are coming (``wanted``), else let go
    of the ones there are."""
    if wanted:
        prime(gpus)
    else:
        discard()


def keep_only(wanted: Sequence[Sequence[int]]) -> None:
    """Spares for jobs on each GPU set of ``wanted`` (started where missing); the others,
    for GPUs no job is coming to, are let go."""
    keys = {tuple(g) for g in wanted}
    for key in [k for k in _spares if k not in keys]:
        _spares.pop(key).kill()
    for gpus in wanted:
        prime(gpus)


def discard() -> None:
    """Kill the spares, if there are any (never used: they hold no job)."""
    spares = list(_spares.values())
    _spares.clear()
    for spare in spares:
        spare.kill()


def _note_in(log: Path, line: str) -> None:
    """A line in the job's log: why it starts the ordinary way (seconds slower on a GPU)."""
    try:
        with open(log, "a") as f:
            f.write(f"plora: {line}\n")
    except OSError:
        pass


def take(job_yaml: Path, cwd: Path, log: Path, env: dict[str, str], launched: float) -> subprocess.Popen | None:
    """Hand a job launched at ``launched`` to the spare: its process (now the job's), or
    None when there is no usable spare and the job must start the ordinary way. The job
    counts its start from ``launched`` (waiting for a spare still importing included). The
    engine starts the next spare (`keep`)."""
    if not _spares:
        return None
    spare = next((sp for sp in _spares.values() if sp.compatible(env)), None)
    if spare is None:  # for other GPUs, or settings: the job starts the ordinary way, at once
        other = next(iter(_spares.values()))
        differ = sorted(k for k in set(env) | set(other.env) if env.get(k) != other.env.get(k))
        _note_in(log, f"the job process started ahead was not used: its environment differs ({', '.join(differ)})")
        if not any(sp.env.get("CUDA_VISIBLE_DEVICES") == env.get("CUDA_VISIBLE_DEVICES") for sp in _spares.values()):
            return None  # the others may still serve their own GPUs' jobs
        for key in [k for k, sp in _spares.items() if sp.env.get("CUDA_VISIBLE_DEVICES") == env.get("CUDA_VISIBLE_DEVICES")]:
            _spares.pop(key).kill()  # this GPU's spare, made with settings no job has now
        return None
    del _spares[spare.gpus]
    try:
        if spare.proc.poll() is not None or not spare.wait_ready(READY_WAIT_S):
            _note_in(log, "the job process started ahead died or hung importing: jobs start the ordinary way")
            spare.kill()
            _give_up()  # it died (or hung) importing: the next would too
            return None
        order = SpareOrder(config=str(Path(job_yaml).resolve()), cwd=str(Path(cwd).resolve()),
                           log=str(Path(log).resolve()), env={**env, HANDED_AT: repr(launched)})
        if not spare.hand(order):
            spare.kill()
            return None
    except BaseException:
        spare.kill()
        raise
    return spare.proc


atexit.register(discard)
