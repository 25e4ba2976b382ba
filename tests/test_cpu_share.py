"""Each job process's share of the host's cores: jobs side by side on a multi-GPU host do not
starve each other of CPU (each bound to its GPUs' block of cores, with as many threads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plora.engine import cpu_share
from plora.engine.cpu_share import CpuShare, format_cpus, parse_cpus, physical_cores, share_for
from plora.engine.job_env import job_env
from plora.engine.spare import child_setup


def fake_topology(root: Path, packages: int, cores: int, threads: int) -> list[int]:
    """A /sys/devices/system/cpu of ``packages`` x ``cores`` x ``threads``, numbered as Linux
    numbers hyperthreads: all first threads, then all second ones."""
    n = packages * cores
    cpus = []
    for t in range(threads):
        for p in range(packages):
            for c in range(cores):
                cpu = t * n + p * cores + c
                topo = root / f"cpu{cpu}" / "topology"
                topo.mkdir(parents=True)
                (topo / "physical_package_id").write_text(f"{p}\n")
                (topo / "core_id").write_text(f"{c}\n")
                cpus.append(cpu)
    return sorted(cpus)


def test_cpu_lists_round_trip():
    assert format_cpus([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert parse_cpus("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpus(format_cpus(range(64))) == tuple(range(64))
    with pytest.raises(ValueError):
        parse_cpus("3-1")


def test_each_gpu_gets_its_own_physical_cores_with_their_siblings(tmp_path):
    # 2 sockets x 16 cores x 2 threads = 64 logical CPUs, 4 GPUs: 8 physical cores a GPU
    cpus = fake_topology(tmp_path, packages=2, cores=16, threads=2)
    cores = physical_cores(cpus, tmp_path)
    assert len(cores) == 32 and all(len(c) == 2 for c in cores)
    shares = [share_for([g], 4, cores) for g in range(4)]
    for g, s in enumerate(shares):
        assert s is not None and s.threads == 8  # torch's pool: one thread a physical core
        assert len(s.cpus) == 16
        # hyperthread siblings stay together, never split between two GPUs' jobs
        assert {c % 32 for c in s.cpus} == set(range(8 * g, 8 * g + 8))
    assert set().union(*(set(s.cpus) for s in shares)) == set(cpus)  # disjoint and complete
    assert sum(len(s.cpus) for s in shares) == 64
    both = share_for([2, 3], 4, cores)  # a TP-2 job: both blocks, each process 8 threads
    assert both == CpuShare(tuple(sorted(shares[2].cpus + shares[3].cpus)), 8)


def test_nothing_is_divided_on_one_gpu_or_without_cores():
    cores = [(c,) for c in range(16)]
    assert share_for([0], 1, cores) is None
    assert share_for([], 4, cores) is None
    assert share_for([1], 4, [(0,), (1,)]) == CpuShare((0, 1), 1)  # fewer cores than GPUs


def test_a_gpu_job_environment_carries_its_share(monkeypatch):
    monkeypatch.setattr(cpu_share, "host_gpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(cpu_share, "physical_cores", lambda cpus: [(c,) for c in sorted(cpus)])
    for var in (*cpu_share.THREAD_VARS, cpu_share.CPUS_VAR, "CUDA_VISIBLE_DEVICES", cpu_share.ENV_SWITCH):
        monkeypatch.delenv(var, raising=False)
    env = job_env([2])
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["RAYON_NUM_THREADS"]) == ("16", "16", "16")
    assert env[cpu_share.CPUS_VAR] == "32-47"
    # the sweep runs on GPUs 4-7 of an 8-GPU host: the block follows the host's numbering
    monkeypatch.setattr(cpu_share, "host_gpu_count", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert job_env([1])[cpu_share.CPUS_VAR] == "40-47"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own setting is kept
    assert job_env([0])["OMP_NUM_THREADS"] == "3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv(cpu_share.ENV_SWITCH, "0")  # off: the libraries' defaults
    env = job_env([0])
    assert cpu_share.CPUS_VAR not in env and "OMP_NUM_THREADS" not in env
    assert cpu_share.CPUS_VAR not in job_env([])  # a CPU job is one thread of its own slot


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_a_job_process_runs_bound_to_its_share_with_as_many_torch_threads(monkeypatch):
    """The real thing: a process started as the engine starts a job (`child_setup`) with a
    GPU job's environment, on a host of as many GPUs as this machine has cores."""
    cores = physical_cores(os.sched_getaffinity(0))
    monkeypatch.setattr(cpu_share, "host_gpu_count", lambda: max(2, len(cores)))
    for var in (*cpu_share.THREAD_VARS, cpu_share.CPUS_VAR, "CUDA_VISIBLE_DEVICES", cpu_share.ENV_SWITCH):
        monkeypatch.delenv(var, raising=False)
    env = job_env([1])
    share = share_for([1], max(2, len(cores)), cores)
    assert share is not None and env[cpu_share.CPUS_VAR] == format_cpus(share.cpus)
    code = "import os, torch; print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=env, preexec_fn=child_setup(env),
                         capture_output=True, text=True, check=True).stdout.split("\n")[0]
    assert out == f"{sorted(share.cpus)} {share.threads}"


def test_baseline_plans_put_one_adapter_in_each_job():
    from plora.cost.model import AdapterLoad, CostModel
    from plora.models.shape import ModelShape
    from plora.planner import baseline_plan, plan_sweep

    cm = CostModel.analytic(ModelShape.preset("qwen2.5-3b"), 512, 80 * 2**30)
    rng = np.random.default_rng(0)
    loads = [AdapterLoad(f"a{i}", int(rng.choice([8, 32, 128])), int(rng.choice([1, 2, 4, 8])), 64) for i in range(24)]
    packed = plan_sweep(loads, cm, 4, time_limit_s=5)
    for name, tp in (("min_gpu", 1), ("max_gpu", 2)):  # 2 KV heads: TP 2 at most
        plan = baseline_plan(loads, cm, 4, name)
        assert plan.strategy == name and len(plan.jobs) == len(loads)
        assert sorted(a for j in plan.jobs for a in j.adapters) == sorted(a.id for a in loads)
        assert {j.tp for j in plan.jobs} == {tp} and all(len(j.adapters) == 1 for j in plan.jobs)
        assert plan.makespan == pytest.approx(packed.baselines[name])
        assert plan.makespan > packed.makespan


def test_a_baseline_sweep_streams_nothing():
    from plora.spec.sections import PlannerConfig

    assert PlannerConfig().streams(gpu=True)
    assert not PlannerConfig(baseline="min_gpu").streams(gpu=True)
