"""The engine on Ray: a local cluster of several nodes on this machine (CPU slots) runs a
sweep like the local backend does; a node removed mid-sweep costs a retry, nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from conftest import tiny_space_file
from plora.engine.journal import Journal  # noqa: E402
from plora.planner.plan import Job, Plan  # noqa: E402
from plora.spec.loading import load_spec  # noqa: E402
from plora.sweep import prepare, run_prepared, write_run_files  # noqa: E402

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
#: notice a dead node within seconds, not Ray's default half a minute
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster():
    """A head that runs no jobs (it holds the cluster's state) and two one-slot nodes."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 * 2**20,
                                                      "include_dashboard": False, "_system_config": FAST_HEALTH})
    nodes = [c.add_node(**NODE) for _ in range(2)]
    c.wait_for_nodes()
    c.workers = nodes
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def space(tmp_path: Path, name: str, backend: dict | None, steps: int = 12, num_train: int = 24) -> Path:
    configs = [
        {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
        {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 2},
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 2},
        {"rank": 2, "alpha": 2, "learning_rate": 5e-3, "batch_size": 8},
    ]
    return tiny_space_file(
        tmp_path, f"{name}.yaml", name=name, num_train=num_train,
        space={"strategy": "list", "configs": configs}, training={"steps": steps, "checkpoint_every_steps": 10},
        eval={"max_new_tokens": 2, "metrics": ["loss"]}, hardware={"device": "cpu", **(backend or {})},
        planner={"max_adapters_per_job": 2})


def two_jobs(path: Path):
    prep = prepare(load_spec(path))
    jobs = [Job(f"job-{j:03d}", [c.id for c in prep.configs[2 * j: 2 * j + 2]]) for j in range(2)]
    prep.plan = Plan(jobs, grouping="fixed for the test")
    write_run_files(prep)
    return prep


def launched(run: Path) -> list[str]:
    j = Journal(run / "journal.sqlite")
    try:
        return [a for _, kind, _, detail in j.events() if kind == "launch" for a in json.loads(detail)["adapters"]]
    finally:
        j.close()


def test_planner_plans_for_the_cluster_and_no_job_spans_nodes(tmp_path):
    from plora.hardware import hardware_for

    spec = load_spec(space(tmp_path, "hw", {"backend": "ray", "nodes": 3, "gpus_per_node": 2}))
    hw = hardware_for(spec)
    assert hw.slots == 6 and hw.max_tp == 1  # CPU slots: one-process jobs
    gpu = spec.model_copy(update={"hardware": spec.hardware.model_copy(update={"device": "cuda"})})
    hw = hardware_for(gpu)
    assert (hw.gpu, hw.slots, hw.max_tp, hw.local) == (True, 6, 2, False)


def test_the_local_backend_imports_no_ray(tmp_path):
    code = ("import sys; from plora.engine.backends import backend_for; from plora.sweep import run_prepared; "
            "import plora.engine.runner, plora.cli; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ray_cluster_runs_the_sweep_like_the_local_backend(tmp_path, cluster):
    """Two nodes, two jobs: every adapter trained exactly once, by a Ray task, with the
    same weights and losses as the local backend's."""
    ray_prep = two_jobs(space(tmp_path, "onray", {"backend": "ray", "nodes": 2, "gpus_per_node": 1,
                                                  "ray": {"address": cluster.address}}))
    frame = run_prepared(ray_prep)
    assert set(frame.status) == {"done"} and len(frame) == 4, frame[["adapter_id", "status", "reason"]]
    assert sorted(launched(ray_prep.run_dir)) == sorted(frame.adapter_id)  # each exactly once
    logs = [(ray_prep.run_dir / "jobs" / j / "log.txt").read_text() for j in ("job-000", "job-001")]
    assert all("on ray node" in log for log in logs)
    assert not (ray_prep.run_dir / ".storage-check").exists()

    local_prep = two_jobs(space(tmp_path, "local", None))
    local = run_prepared(local_prep, slots=["cpu:0", "cpu:1"])
    from safetensors.torch import load_file
    import torch

    for a in frame.adapter_id:
        got = load_file(ray_prep.run_dir / "adapters" / a / "adapter_model.safetensors")
        want = load_file(local_prep.run_dir / "adapters" / a / "adapter_model.safetensors")
        for k in want:
            torch.testing.assert_close(got[k], want[k])
    pd.testing.assert_series_equal(frame.set_index("adapter_id").eval_loss,
                                   local.set_index("adapter_id").eval_loss.loc[frame.adapter_id], check_exact=False)


def test_storage_check_fails_in_one_line_when_the_run_directory_is_not_writable(tmp_path, cluster):
    from plora.engine.backends import BackendError
    from plora.engine.ray_backend import RayBackend

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(BackendError, match=r"not writable here") as e:
        RayBackend(blocker / "run", address=cluster.address).check_storage()
    assert "\n" not in str(e.value)
    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.slow
def test_a_node_removed_mid_sweep_costs_a_retry_and_nothing_else(tmp_path, cluster):
    """The node of a running job is removed: the job is re-queued (not counted as a crash),
    runs on the other node from its checkpoint, and every adapter finishes exactly once."""
    path = space(tmp_path, "lose", {"backend": "ray", "nodes": 2, "gpus_per_node": 1,
                                    "ray": {"address": cluster.address}}, steps=400, num_train=64)
    prep = two_jobs(path)
    run = prep.run_dir
    sweep = subprocess.Popen([sys.executable, "-m", "plora.cli", "sweep", str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        victim, deadline = None, time.time() + 240
        while victim is None and time.time() < deadline and sweep.poll() is None:
            for job in ("job-000", "job-001"):
                try:
                    progress = json.loads((run / "jobs" / job / "progress.json").read_text())
                except (OSError, ValueError):
                    continue
                if progress["step"] >= 30 and (run / "jobs" / job / "checkpoint" / "state.rank0.pt").is_file():
                    victim = job
                    break
            time.sleep(0.2)
        assert victim is not None, "no job got far enough"
        log = (run / "jobs" / victim / "log.txt").read_text()
        node_prefix = log.rsplit("on ray node ", 1)[1].split()[0]
        node = next(n for n in cluster.workers if n.node_id.startswith(node_prefix))
        cluster.remove_node(node, allow_graceful=False)
        out, _ = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, out
    frame = pd.read_parquet(run / "results.parquet")
    assert set(frame.status) == {"done"} and len(frame) == 4
    j = Journal(run / "journal.sqlite")
    events = [(kind, subject) for _, kind, subject, _ in j.events()]
    job = j.job(victim)
    j.close()
    assert ("lost", victim) in events and ("retry", victim) not in events
    assert job.status == "finished" and job.attempt == 2
    progress = json.loads((run / "jobs" / victim / "progress.json").read_text())
    assert progress["resumed_step"] and progress["resumed_step"] >= 30  # went on from its checkpoint
    for a in frame.adapter_id:  # each adapter's result written once, by the last attempt of its job
        m = json.loads((run / "adapters" / a / "metrics.json").read_text())
        assert m["steps"] == 400
