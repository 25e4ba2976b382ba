"""A job process waiting for its job: imports the recipe first, then reads one `SpareOrder`
(after, perhaps, a `PreloadOrder`: the sweep's base model, loaded while it waits; and a
`KernelsOrder`: the Triton kernels its job will likely launch, loaded once compiled).

Started by `plora.engine.spare` ahead of a job, with that job's environment. Once its
imports are done it prints ``ready`` and blocks on stdin. Given its order it becomes the job exactly as
``tune run plora/train/packed_lora.py --config job.yaml`` would have run it: in the
job's folder, with the job's environment, its output appended to the job's log.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    import time

    from plora.job.phases import watch_dynamo_import

    watch_dynamo_import()  # who imports torch._dynamo, if anything does (the job's summary says)
    import torch

    from plora.job.phases import SPARE_MOMENTS

    if GPU_IDLE in sys.argv[1:]:
        _cuda_start_thread(SPARE_MOMENTS)
    from plora.models.torchtune_imports import LATE_GPU_MODULES, import_job_modules, import_late_modules, lean_job_imports

    # no torchtune dataset builders, generation or tokenizers, no torchao beyond a QLoRA job's
    # NF4, no flex attention compiled as torchtune imports: none of it is a job's
    lean_job_imports()
    from torchtune import config as tune_config

    from plora.engine.spare import CHECKED, READY, PreloadOrder, SpareOrder
    from plora.job.phases import process_started_at
    from plora.train import preload
    from plora.train.packed.flash_varlen import flash_varlen
    from plora.train.packed_lora import _pick_device, recipe_main, run_then_leave

    import_job_modules()  # what the job's model build imports, whatever its family
    born = process_started_at()  # (no job yet: the process's creation)
    if born is not None:
        SPARE_MOMENTS["created_at"] = born
    SPARE_MOMENTS["ready_at"] = time.time()

    # the imports asked CUDA about the GPU: the spare serves only a job for the GPUs it sees
    # (`plora.engine.spare.Spare.compatible`)
    print(READY, flush=True)
    # on a GPU, while the job is still being planned: nothing, where the flash ops are called
    # directly (`plora.train.packed.flash_varlen`: no torch._dynamo)
    import_late_modules(SPARE_MOMENTS, () if flash_varlen() is not None else LATE_GPU_MODULES)
    warming: list = []  # threads its job waits for at the handover
    kernels = KernelsAhead(SPARE_MOMENTS)  # the sweep's expected kernels, loaded before the job comes
    # what is alive now (torch, torchtune, the recipe: most of a job's objects) moved where
    # garbage collections do not walk it: the job's first collection (`plora.train.heap`)
    # walks the model and its own objects only
    import gc

    gc.collect()
    gc.freeze()
    while True:
        line = sys.stdin.readline()
        if not line.strip():
            return 0  # let go unused
        try:
            fields = json.loads(line)
        except ValueError:
            fields = {}
        if not isinstance(fields, dict) or "config" in fields:
            break
        if "warmer_log" in fields:  # a `KernelsOrder`: loaded after the warm-up, or now where it is done
            later = kernels.take(fields)
            if later is not None:
                warming.append(later)
            continue
        if "check" in fields:  # the sweep's model check, done here where torchtune is imported
            answer = answer_check(fields)
            try:
                print(CHECKED + answer.model_dump_json(), flush=True)
            except OSError:  # the sweep stopped reading (it gave up on the answer): the job comes still
                pass
            continue
        SPARE_MOMENTS["preload_ordered_at"] = time.time()
        # a preload is sent only to the spare of an idle GPU (the sweep's first job): the model
        # first, then on a thread its warm-up and Triton's once-a-process costs, one after the
        # other (a spare beside a running job takes no GPU memory before its job). Side by side
        # they shared one interpreter lock: on an H200 the three took 3.7-5.1 s so, 3.2-3.9 s in turn.
        key = None
        try:  # the sweep's base model, loaded while the sweep plans; a failure is the job's to report
            ahead = PreloadOrder.model_validate(fields)
            key = preload.ModelKey.of(ahead.path, ahead.family, ahead.max_seq_len, ahead.dtype,
                                      _pick_device(ahead.device), ahead.random_init)
            preload.hold(key)
            SPARE_MOMENTS["preloaded_at"] = time.time()
        except Exception:  # noqa: BLE001 - the job loads its own model then
            key = None
        if not warming:
            warming.append(_warming_thread(key, SPARE_MOMENTS, kernels))
    order = SpareOrder.model_validate_json(line)
    kernels.job_came.set()  # a load still waiting for the warming process's answer is let go
    _join_warming(warming, SPARE_MOMENTS)
    SPARE_MOMENTS["dynamo_at_handover"] = "torch._dynamo" in sys.modules
    os.chdir(order.cwd)
    os.environ.clear()
    os.environ.update(order.env)
    fd = os.open(order.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = ["plora/train/packed_lora.py", "--config", order.config]
    run_then_leave(tune_config.parse(recipe_main))
    return 0


#: the argument a spare of an idle GPU is started with (`plora.engine.spare.GPU_IDLE`)
GPU_IDLE = "--gpu-idle"


def _cuda_start_thread(moments: dict):
    """CUDA's start (the context, a cuBLAS handle and its first product) on a thread begun
    right after ``import torch``, while the rest of the spare's imports run: where the
    GPU is idle (the sweep's first wave), nothing is lost by taking a context early, and
    the warm-up (`_warming_thread`) that waited for imports, then the preload, finds it made.
    The two share the interpreter lock, but CUDA's start is mostly driver calls, which run
    without it: on an H200, done beside the imports it ended before them (0.25-0.3 s of
    the spare's time gone; `scripts/probe_spare_warm.py`)."""
    import threading
    import time

    import torch

    def run() -> None:
        t0 = time.perf_counter()
        try:
            if not torch.cuda.is_available():
                return
            device = torch.device("cuda", torch.cuda.current_device())
            x = torch.zeros(16, 16, device=device, dtype=torch.bfloat16)
            torch.nn.functional.linear(x, x, x[0])
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - the warm-up, or the job, starts CUDA then
            return
        moments["cuda_started_s"] = round(time.perf_counter() - t0, 3)

    thread = threading.Thread(target=run, name="plora-cuda-start", daemon=True)
    thread.start()
    return thread


#: seconds a job waits at its handover for the spare's warming threads (a second or two, as a
#: rule); past that it goes on without them, and loads its own model
HANDOVER_WAIT_S = 60.0


def _join_warming(threads: list, moments: dict) -> None:
    """Wait for the warming threads before the job starts (nothing of theirs runs beside it),
    at most `HANDOVER_WAIT_S` in all. A thread still running then is left to end on its own,
    and the model held for the job is dropped, so the job never shares a model a warm-up
    may still be running."""
    import time

    from plora.train import preload

    deadline = time.monotonic() + HANDOVER_WAIT_S
    for thread in threads:
        if thread is None:
            continue
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            moments["warming_abandoned"] = thread.name
            preload.release()


def _warming_thread(key, moments: dict, kernels: "KernelsAhead | None" = None):
    """What a job's first GPU work would pay, paid on a thread while the spare waits: the
    held model (of ``key``, if one is held) once forward and backward (`plora.train.gpu_warm_up`),
    then Triton's once-a-process costs (`plora.kernels.prewarm`), then the kernels the sweep
    expects the job to launch (``kernels``, where its order came: `KernelsAhead`). A thread,
    so that the spare answers the sweep's model check meanwhile (1.8-2.3 s of warm-up on a
    machine's first use, which the check, and so the sweep's first job, had waited for); the
    thread, or None where there is no GPU."""
    import threading
    import time

    import torch

    if not torch.cuda.is_available():
        return None

    def run() -> None:
        from plora.kernels.prewarm import prewarm
        from plora.train import preload
        from plora.train.gpu_warm_up import warm_up

        model = preload.held_model(key) if key is not None else None
        if model is not None and torch.device(key.device).type == "cuda":
            moments["warm_up_began_at"] = time.time()
            try:
                seconds = warm_up(model, key.device)
            except Exception:  # noqa: BLE001 - the job's first step pays it then, as before
                seconds = None
            if seconds is not None:
                moments["warmed_up_s"] = round(seconds, 3)
        del model
        try:
            parts = prewarm(torch.device("cuda", torch.cuda.current_device()))
        except Exception:  # noqa: BLE001 - the job's first step pays it then, as before
            parts = {}
        if parts:
            moments["prewarmed_at"] = time.time()
            moments["prewarm_s"] = round(sum(parts.values()), 3)
            moments["prewarm_parts"] = {k: round(v, 3) for k, v in parts.items()}
        try:  # the pinned buffer leaving adapters' weights go through (`plora.train.packed.bank`)
            from plora.train.packed.bank import host_staging

            host_staging()
        except Exception:  # noqa: BLE001 - the job's bank pins it at set-up then
            pass
        if kernels is not None:
            kernels.load(kernels.close())
        moments["ready_for_job_at"] = time.time()

    thread = threading.Thread(target=run, name="plora-warming", daemon=True)
    thread.start()
    return thread


class KernelsAhead:
    """The Triton kernels the sweep expects its first job to launch (a `KernelsOrder`),
    loaded in the spare before the job comes: its first step's capture then loads none of
    them (the job's own compile-ahead finds them loaded: `plora.kernels.compile_ahead`).

    Loaded only once the sweep's kernel-warming process has answered, so that every one is
    in Triton's cache and the spare compiles nothing (on a machine's first sweep the warming
    process compiles for seconds: a spare compiling beside it would hold up the handover).
    The warming thread loads them at its end (`close`); an order that comes after that gets
    a thread of its own (`take`). A load waiting for the warming process's answer gives up
    when the job comes (`job_came`)."""

    #: how often, and at most how long, a load looks for the warming process's answer
    POLL_S = 0.02
    WAIT_S = 30.0

    def __init__(self, moments: dict):
        import threading

        self.moments = moments
        self.job_came = threading.Event()
        self._lock = threading.Lock()
        self._order: dict | None = None
        self._closed = False  # the warming thread has looked for an order

    def take(self, fields: dict):
        """An order read by the spare: kept for the warming thread, or, where that has looked
        already, loaded on a thread of its own (returned, for the handover to wait for)."""
        import threading

        with self._lock:
            if not self._closed:
                self._order = fields
                return None
        thread = threading.Thread(target=self.load, args=(fields,), name="plora-kernels", daemon=True)
        thread.start()
        return thread

    def close(self) -> dict | None:
        """The order kept so far (None: none came yet); a later one gets a thread of its own."""
        with self._lock:
            self._closed = True
            order, self._order = self._order, None
            return order

    def load(self, fields: dict | None) -> None:
        """Load ``fields``' kernels once the warming process has answered (`plora.kernels.warm_cache.warm`,
        which finds each in Triton's cache); what happened goes to the spare's moments."""
        import time

        if fields is None:
            return
        from plora.engine.spare import KernelsOrder
        from plora.job.warm_order import answered

        t0 = time.perf_counter()
        try:
            ahead = KernelsOrder.model_validate(fields)
        except ValueError:
            self.moments["kernels_skipped"] = "order"
            return
        deadline = time.monotonic() + self.WAIT_S
        while answered(ahead.warmer_log, ahead.warmer_offset) is None:
            if self.job_came.is_set() or time.monotonic() > deadline:
                self.moments["kernels_skipped"] = "not compiled yet"
                return
            time.sleep(self.POLL_S)
        waited = time.perf_counter() - t0
        try:
            import torch

            from plora.kernels.compile_ahead import COMPILED
            from plora.kernels.warm_cache import warm

            before = COMPILED.seconds
            loaded = warm(ahead.order)
            torch.cuda.empty_cache()  # a dry run's scratch back to the device, as before it
        except Exception as e:  # noqa: BLE001 - the job loads its kernels itself, as before
            self.moments["kernels_skipped"] = f"{type(e).__name__}: {e}"[:200]
            return
        self.moments["kernels_ahead"] = {"loaded": loaded, "waited_s": round(waited, 3),
                                         "load_s": round(COMPILED.seconds - before, 3), "at": time.time()}


def answer_check(fields: dict):
    """A `CheckOrder`'s `CheckAnswer`: the folder checked as the sweep would check it."""
    from plora.engine.spare import CheckAnswer, CheckOrder
    from plora.models.check import check_model
    from plora.models.loading import ModelError

    try:
        order = CheckOrder.model_validate(fields)
        check_model(order.check, order.family, random_init=order.random_init, max_seq_len=order.max_seq_len)
    except ModelError as e:
        return CheckAnswer(ok=False, error=str(e))
    except Exception as e:  # noqa: BLE001 - the check broke here: the sweep checks again itself
        return CheckAnswer(ok=False, failed=f"{type(e).__name__}: {e}")
    return CheckAnswer(ok=True)


if __name__ == "__main__":
    sys.exit(main())
