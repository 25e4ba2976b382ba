"""Run packed jobs as Ray tasks: one placement group per job, the same `tune run` inside.

Each job reserves one bundle ``{"GPU": d, "CPU": c·d}`` (``{"CPU": d}`` on a CPU cluster)
with ``STRICT_PACK``: a bundle lives on one node, so a TP job never spans nodes. The task
starts exactly what the local backend starts, ``tune run [--nproc_per_node d] …`` (torchtune
runs torchrun standalone: a port-0 rendezvous per job, so jobs on one node never collide)
and returns its exit code. The driver keeps the journal and the live view; jobs write
their files into the run directory, which must be on storage every node sees (a shared
file system: NFS, Lustre, a FUSE bucket): `check_storage` proves it before anything runs.

A job whose node dies (its raylet, worker or machine gone) comes back as a lost task: the
engine re-queues it without counting a crash against its adapters, and the relaunched job
resumes from its checkpoint. Ray sets ``CUDA_VISIBLE_DEVICES`` for a task itself (and to
nothing for a task without GPUs); the task passes its job exactly the GPUs Ray gave it.
Placement groups and tasks are named after the job ids, so Ray's dashboard shows the jobs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from plora.settings import settings
from plora.engine.errors import BackendError
from plora.engine.local import JobProcess, tune_command
from plora.job.step_settings import JOB_ALLOCATOR

#: exit code the engine sees for a job whose task was lost with its node
LOST = -1000
#: environment passed from the driver to every job (fault injection, caches): Ray's
#: workers inherit the environment of their raylet, not of the driver
FORWARDED_PREFIXES = ("PLORA_", "HF_", "TRITON_")


@ray.remote(max_retries=0)
def _run_job(job_dir: str, nproc: int, env_updates: dict[str, str], omp_threads: int, header: str) -> int:
    """On a worker: start the job in its own session, log to its log.txt, return its exit
    code. Cancelling the task (Ctrl-C on the driver) stops the job with SIGTERM first."""
    from plora.engine.spare import die_with_parent

    env = dict(os.environ)
    env.update(env_updates)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = str(omp_threads)  # as torchrun would; Ray sets its own otherwise
    gpus = [str(g) for g in ray.get_gpu_ids()]
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", JOB_ALLOCATOR)
    node = ray.get_runtime_context().get_node_id()[:8]
    with open(Path(job_dir) / "log.txt", "a") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {header} on ray node {node}{' GPUs ' + ','.join(gpus) if gpus else ''}\n")
        log.flush()
        proc = subprocess.Popen(tune_command(Path(job_dir) / "job.yaml", nproc), stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=job_dir, start_new_session=True, preexec_fn=die_with_parent)
        try:
            return proc.wait()
        except KeyboardInterrupt:  # ray.cancel: stop the job as the local engine does
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                return proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait()


@ray.remote(max_retries=0)
def _probe_storage(root: str, driver_token: str) -> str:
    """On one node: read the driver's marker and write this node's; '' when both work."""
    node = ray.get_runtime_context().get_node_id()
    try:
        seen = (Path(root) / "driver").read_text()
    except OSError as e:
        return f"cannot read {root}: {e.strerror or e}"
    if seen != driver_token:
        return f"sees another folder at {root} (not the driver's)"
    try:
        (Path(root) / node).write_text(driver_token)
    except OSError as e:
        return f"cannot write {root}: {e.strerror or e}"
    return ""


class RayTask:
    """A job's Ray task, looking like the `subprocess.Popen` the engine polls."""

    pid = None  # not a local process: nothing for the engine to signal by pid

    def __init__(self, ref: "ray.ObjectRef", pg, job_dir: Path):
        self.ref, self.pg, self.job_dir = ref, pg, job_dir
        self.returncode: int | None = None
        self.lost = False

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ready, _ = ray.wait([self.ref], timeout=0)
        if not ready:
            return None
        try:
            self.returncode = int(ray.get(self.ref))
        except RayTaskError as e:  # the task's own code failed: the job's crash
            self._note(f"ray task failed: {str(e).splitlines()[0]}")
            self.returncode = 1
        except RayError as e:  # worker or node gone, task cancelled: not the adapters' fault
            self._note(f"ray task lost: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            self.lost, self.returncode = True, LOST
        self._release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if end is not None and time.time() >= end:
                raise subprocess.TimeoutExpired(f"ray task {self.ref}", timeout)
            time.sleep(0.1)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """SIGTERM: cancel the task (it stops its job gracefully); else kill its worker
        (the job dies with it: parent-death signal)."""
        try:
            ray.cancel(self.ref, force=sig != signal.SIGTERM)
        except (RayError, ValueError):
            pass

    def _release(self) -> None:
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - already gone with its node
            pass

    def _note(self, text: str) -> None:
        try:
            with open(self.job_dir / "log.txt", "a") as f:
                f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        except OSError:
            pass


class RayBackend:
    """Connects to (or starts) a Ray cluster and launches the sweep's jobs on it."""

    def __init__(self, run_dir: Path, *, address: str | None = None, device: str = "auto",
                 cpus_per_gpu: float = 1.0, init_kwargs: dict | None = None):
        self.run_dir = Path(run_dir).resolve()
        self.started = not ray.is_initialized()
        if self.started:
            try:
                ray.init(address=address, namespace="plora", log_to_driver=False, configure_logging=False,
                         **(init_kwargs or {}))
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise BackendError(f"hardware.ray.address: cannot reach a Ray cluster at {address!r}: "
                                   f"{str(e).splitlines()[0]}") from None
        resources = ray.cluster_resources()
        if device == "cuda" and resources.get("GPU", 0) < 1:
            raise BackendError("hardware.device is cuda but the Ray cluster has no GPU")
        self.gpu = device == "cuda" or (device == "auto" and resources.get("GPU", 0) >= 1)
        self.cpus_per_gpu = float(cpus_per_gpu)
        self.tasks: list[RayTask] = []

    def slots(self, nodes: int, per_node: int) -> list[str]:
        """The engine's pool: one slot per GPU (or CPU slot) of ``nodes × per_node``. Which
        node a job lands on is Ray's choice; the pool only bounds how many run at once."""
        return [f"ray:{i}" for i in range(nodes * per_node)]

    def check_storage(self, timeout_s: float = 120.0) -> None:
        """Every alive node reads a marker the driver wrote into the run directory and
        writes its own, which the driver reads back: jobs write their results there."""
        root = self.run_dir / ".storage-check"
        token = uuid.uuid4().hex
        try:
            root.mkdir(parents=True, exist_ok=True)
            (root / "driver").write_text(token)
        except OSError as e:
            raise BackendError(f"the run directory {self.run_dir} is not writable here: {e.strerror or e}") from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        refs = {
            n["NodeID"]: _probe_storage.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                name="plora-storage-check").remote(str(root), token)
            for n in nodes
        }
        try:
            for n in nodes:
                node_id, where = n["NodeID"], f"node {n['NodeID'][:8]} ({n.get('NodeManagerAddress', '?')})"
                try:
                    problem = ray.get(refs[node_id], timeout=timeout_s)
                except GetTimeoutError:
                    problem = f"did not answer within {timeout_s:.0f} s"
                except RayError as e:
                    problem = f"failed: {str(e).splitlines()[0]}"
                if not problem and _read(root / node_id) != token:
                    problem = "wrote its marker where the driver cannot see it"
                if problem:
                    raise BackendError(f"hardware.backend ray: {where} {problem}; the run directory "
                                       f"{self.run_dir} must be on storage every node sees (output.dir)")
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def bundle(self, nproc: int) -> dict[str, float]:
        if self.gpu:
            return {"GPU": float(nproc), "CPU": max(1.0, self.cpus_per_gpu) * nproc}
        return {"CPU": float(nproc)}

    def launch(self, job_id: str, job_dir: Path, slot: str, *, gpus: Sequence[int] = (), nproc: int = 1,
               extra_env: dict[str, str] | None = None) -> JobProcess:
        """What `plora.engine.local.launch` does, as a Ray task in the job's placement group."""
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
        env.update(extra_env or {})
        attempt = str(settings(env).job_attempt)
        bundle = self.bundle(nproc)
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"{job_id}#{attempt}")
        omp = max(1, int(bundle["CPU"] // nproc)) if self.gpu else 1
        header = f"{job_id} attempt {attempt}"
        ref = _run_job.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), name=f"{job_id}#{attempt}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote(str(job_dir), nproc, env, omp, header)
        task = RayTask(ref, pg, Path(job_dir))
        self.tasks.append(task)
        return JobProcess(job_id, Path(job_dir), slot, task, time.time())

    def close(self) -> None:
        for task in self.tasks:
            if task.returncode is None:
                task.send_signal(signal.SIGKILL)
                task._release()
        if self.started and ray.is_initialized():
            ray.shutdown()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
