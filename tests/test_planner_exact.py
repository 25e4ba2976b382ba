"""The planner against the exact optimum: the exact solver checked by brute force, then
every plan of seeded random small sweeps held to it (issue 34), and the engine, the
simulator and the plan agreeing on when each job runs."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from plora.cost.model import AdapterLoad, CostModel, MemoryCoeffs, TimeCoeffs
from plora.planner import Job, Plan, Workload, plan_sweep, simulate
from plora.planner.compact import compact
from plora.planner.exact import EXACT_MAX_ADAPTERS, schedule_jobs, solve_exact
from plora.planner.instances import PROFILES_DIR, random_instance, random_instances

# ---- brute force ---------------------------------------------------------------------------


def brute_schedule(jobs: list[tuple[int, float]], gpus: int) -> float:
    """The shortest schedule of rigid jobs by trying every start time a left-shifted schedule
    can have (0 or a sum of other jobs' durations) for every job, and checking that no more
    than ``gpus`` GPUs are busy at any start (any such schedule can be given GPU ids)."""
    n = len(jobs)
    choices = []
    for j in range(n):
        others = [p for k, (_, p) in enumerate(jobs) if k != j]
        sums = {0.0}
        for p in others:
            sums |= {s + p for s in sums}
        choices.append(sorted(sums))
    best = math.inf
    for starts in itertools.product(*choices):
        end = max(s + p for s, (_, p) in zip(starts, jobs))
        if end >= best:
            continue
        ok = True
        for t in starts:
            busy = sum(d for s, (d, p) in zip(starts, jobs) if s <= t < s + p)
            if busy > gpus:
                ok = False
                break
        if ok:
            best = end
    return best


def set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


def brute_optimum(wl: Workload) -> float:
    """Every partition of the adapters into jobs, every degree each job fits at, each
    scheduled exactly (`schedule_jobs`, itself checked against `brute_schedule`)."""
    cm, loads = wl.cost_model, wl.loads
    best = math.inf
    for part in set_partitions(list(range(len(loads)))):
        options = []
        for block in part:
            members = [loads[i] for i in block]
            fit = [(d, cm.job_time(members, d)) for d in wl.degrees
                   if len(block) <= wl.cap and cm.memory(members, d) <= wl.budget * (1 + 1e-9)]
            options.append(fit)
        for jobs in itertools.product(*options):
            if max(p for _, p in jobs) >= best:
                continue
            sched = schedule_jobs(list(jobs), wl.gpus, upper_bound=best)
            if sched is not None:
                best = min(best, sched.makespan)
    return best


def test_schedule_jobs_matches_brute_force():
    rng = np.random.default_rng(3)
    for trial in range(30):
        gpus = int(rng.choice([2, 3, 4]))
        n = int(rng.integers(1, 5)) if trial % 10 else 5
        jobs = [(int(rng.choice([d for d in (1, 2, 4) if d <= gpus])), float(rng.integers(1, 9)) + float(rng.random()))
                for _ in range(n)]
        sched = schedule_jobs(jobs, gpus)
        assert sched is not None and sched.proven
        assert sched.makespan == pytest.approx(brute_schedule(jobs, gpus), rel=1e-9), (trial, jobs, gpus)
        # the schedule itself: its starts give that makespan and never more than `gpus` busy GPUs
        assert max(s + p for s, (_, p) in zip(sched.starts, jobs)) == pytest.approx(sched.makespan)
        for t in sched.starts:
            assert sum(d for s, (d, p) in zip(sched.starts, jobs) if s <= t < s + p) <= gpus
        # nothing beats it: an upper bound at the optimum finds nothing
        assert schedule_jobs(jobs, gpus, upper_bound=sched.makespan) is None


def test_exact_matches_brute_force_over_partitions():
    checked = 0
    for seed in range(12):
        inst = random_instance(seed, 2 + 2 * (seed % 2), "fitted" if seed % 3 else "analytic", n=(3, 5))
        wl = Workload(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor,
                      max_adapters_per_job=int(3 + seed % 3))
        got = solve_exact(wl)
        assert got is not None and got.proven
        assert got.makespan == pytest.approx(brute_optimum(wl), rel=1e-9), inst.name
        plan = Plan(jobs=got.jobs, adapters=wl.loads, gpus=wl.gpus, makespan=got.makespan, lower_bound=0.0,
                    load_factor=wl.load_factor, max_adapters_per_job=wl.cap)
        sim = simulate(plan, inst.cost_model)
        assert sim.ok, sim.violations
        assert sim.makespan == pytest.approx(got.makespan, rel=1e-12)
        checked += 1
    assert checked == 12


def test_exact_respects_its_limits():
    inst = random_instance(0, 4, "analytic", n=(EXACT_MAX_ADAPTERS + 1, EXACT_MAX_ADAPTERS + 1))
    wl = Workload(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor)
    assert solve_exact(wl) is None  # too many adapters: not attempted
    inst = random_instance(1, 4, "fitted", n=(EXACT_MAX_ADAPTERS, EXACT_MAX_ADAPTERS))
    wl = Workload(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor)
    cut = solve_exact(wl, time_limit_s=1e-4)
    assert cut is not None and not cut.proven and "time limit" in cut.notes[0]


# ---- the planner against the optimum (issue 34's acceptance) -------------------------------


@pytest.fixture(scope="module")
def held_to_the_optimum():
    """40 seeded instances (2 and 4 GPUs; fitted profiles and the analytic model; memory
    binding in most): the planner's plan without the exact solver, and the optimum."""
    rows = []
    for inst in random_instances(40, seed=0):
        plan = plan_sweep(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor, exact=False)
        wl = Workload(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor)
        best = solve_exact(wl)
        assert best is not None and best.proven, inst.name
        rows.append((inst, plan, best))
    return rows


def test_instances_are_of_the_issues_kind(held_to_the_optimum):
    insts = [inst for inst, _, _ in held_to_the_optimum]
    assert {(i.gpus, i.source) for i in insts} == {(2, "fitted"), (4, "fitted"), (2, "analytic"), (4, "analytic")}
    assert all(6 <= len(i.loads) <= 9 for i in insts)
    assert {a.rank for i in insts for a in i.loads} <= {8, 16, 32, 64, 128}
    assert {a.batch_size for i in insts for a in i.loads} <= {1, 2, 4, 8}
    assert all(len({a.steps for a in i.loads}) > 1 for i in insts)
    # memory binds: not every sweep fits one job on one GPU
    binding = sum(not i.cost_model.fits(i.loads, 1, i.load_factor) for i in insts)
    assert binding >= len(insts) // 2


def test_plans_are_within_a_few_percent_of_the_optimum(held_to_the_optimum):
    ratios = [plan.makespan / best.makespan for _, plan, best in held_to_the_optimum]
    assert min(ratios) >= 1 - 1e-9  # nothing beats the optimum
    assert float(np.mean(ratios)) <= 1.02
    assert max(ratios) <= 1.06


def test_bound_is_never_above_the_optimum(held_to_the_optimum):
    for inst, plan, best in held_to_the_optimum:
        assert plan.lower_bound <= best.makespan * (1 + 1e-9), inst.name


def test_plans_replay_to_their_reported_makespan(held_to_the_optimum):
    for inst, plan, best in held_to_the_optimum:
        sim = simulate(plan, inst.cost_model)
        assert sim.ok, (inst.name, sim.violations)
        assert sim.makespan == pytest.approx(plan.makespan, rel=1e-9), inst.name
        for j in plan.jobs:  # compacted: the replay starts every job when the plan says
            assert sim.starts[j.id] == pytest.approx(j.start, rel=1e-9, abs=1e-9), (inst.name, j.id)
        for jobs in (best.jobs,):
            sim = simulate(Plan(jobs=jobs, adapters=inst.loads, gpus=inst.gpus, makespan=best.makespan,
                                lower_bound=0.0, load_factor=inst.load_factor), inst.cost_model)
            assert sim.ok and sim.makespan == pytest.approx(best.makespan, rel=1e-9)


def test_issue_example_reaches_the_optimum():
    """Issue 34's example: plora planned 40.62 s; {a0,a2,a5,a6} and {a1,a3,a4} on a GPU each
    take 36.94 s."""
    cm = CostModel.load(PROFILES_DIR / "qwen2.5-0.5b-seq1024.json")
    rows = "a0 64 8 200, a1 32 2 600, a2 64 1 400, a3 8 2 400, a4 8 8 50, a5 128 1 200, a6 64 1 300"
    loads = [AdapterLoad(i, int(r), int(b), int(s)) for i, r, b, s in (x.split() for x in rows.split(", "))]
    plan = plan_sweep(loads, cm, 2, exact=False)
    assert plan.makespan <= 36.94 * 1.0005
    assert simulate(plan, cm).makespan == pytest.approx(plan.makespan, rel=1e-9)
    best = solve_exact(Workload(loads, cm, 2))
    assert best is not None and best.proven and best.makespan == pytest.approx(36.94, abs=0.01)


def test_plan_sweep_uses_the_exact_solver_on_small_sweeps(tmp_path):
    inst = random_instance(4, 4, "fitted")
    plan = plan_sweep(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor)
    best = solve_exact(Workload(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor))
    assert plan.optimal and plan.makespan == pytest.approx(best.makespan, rel=1e-9)
    assert plan.lower_bound == pytest.approx(plan.makespan) and plan.bound_ratio == pytest.approx(1.0)
    assert any(n.startswith("exact search: optimal") for n in plan.notes)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["optimal"] is True and Plan.load(path) == plan
    assert simulate(plan, inst.cost_model).ok


# ---- compaction and the configuration LP's plan ---------------------------------------------


def test_compact_starts_jobs_as_soon_as_their_gpus_are_free():
    jobs = [
        Job("a", ["x"], 1, [0], 0.0, 10.0, 1.0, 0.0),
        Job("b", ["y"], 1, [1], 4.0, 9.0, 1.0, 0.0),  # GPU 1 was free from 0
        Job("c", ["z"], 2, [0, 1], 12.0, 15.0, 1.0, 0.0),  # both GPUs free from 10
    ]
    out = {j.id: j for j in compact(jobs)}
    assert (out["a"].start, out["b"].start, out["c"].start) == (0.0, 0.0, 10.0)
    assert out["c"].end == 13.0 and out["b"].end == 5.0
    assert compact(list(out.values())) == compact(jobs)  # a compact plan stays as it is


def lp_trap_model() -> tuple[CostModel, list[AdapterLoad]]:
    """Issue 34's synthetic case: one TP-2 job of all 8 adapters takes 204 s on 2 of 4 GPUs
    and the fewest GPU-seconds; one TP-4 job of them all takes 135 s."""
    mem = {d: MemoryCoeffs(base=60.0 / d, adapter=1.0, rank=0.0, tok=0.0, rank_tok=0.0) for d in (1, 2, 4)}
    time = {1: TimeCoeffs(c0=3.2, c_tok=0.0, c_rtok=0.0, c_ad=0.1), 2: TimeCoeffs(c0=1.64, c_tok=0.0, c_rtok=0.0, c_ad=0.05),
            4: TimeCoeffs(c0=1.15, c_tok=0.0, c_rtok=0.0, c_ad=0.025)}
    cm = CostModel(gpu_memory_bytes=50.0, seq_len=1, time=time, memory_coeffs=mem, name="lp-trap")
    return cm, [AdapterLoad(f"a{i}", 8, 1, 100) for i in range(8)]


def test_lp_columns_plan_is_judged_by_its_makespan():
    from plora.planner.columns import column_jobs
    from plora.planner.lp_bound import configuration_lp

    cm, loads = lp_trap_model()
    wl = Workload(loads, cm, 4, max_adapters_per_job=8)
    assert cm.job_time(loads, 2) == pytest.approx(204) and cm.job_time(loads, 4) == pytest.approx(135)
    lp = configuration_lp(wl)
    cheapest = column_jobs(wl, lp, objective="gpu_seconds")
    shortest = column_jobs(wl, lp, objective="makespan")
    assert max(j.end for j in cheapest) == pytest.approx(204)  # what the LP's own covering gives
    assert max(j.end for j in shortest) <= 135 + 1e-6
    plan = plan_sweep(loads, cm, 4, max_adapters_per_job=8, exact=False)
    assert plan.makespan <= 135 + 1e-6 and simulate(plan, cm).ok


# ---- the engine runs a plan the way the simulator replays it ---------------------------------


class _FakeProc:
    """A job process that ends when the test's clock passes its end."""

    def __init__(self, clock, duration, on_exit):
        self.clock, self.end, self.on_exit, self.pid, self.done = clock, clock[0] + duration, on_exit, 0, False

    def poll(self):
        if self.clock[0] >= self.end - 1e-9:
            if not self.done:
                self.on_exit()
                self.done = True
            return 0
        return None


def test_engine_starts_planned_jobs_when_the_simulator_does(tmp_path, monkeypatch):
    """A later job never takes a GPU ahead of the jobs planned before it there (the engine
    used to start it on any free GPU); on the plan's own times, the engine's starts are the
    replay's, including TP jobs on their planned GPU sets."""
    from plora.engine import runner
    from plora.engine.journal import Journal
    from plora.engine.local import JobProcess
    from plora.engine.runner import Engine

    checked = 0
    for seed in range(4):
        inst = random_instance(seed, 4, "fitted" if seed % 2 else "analytic")
        plan = plan_sweep(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor, exact=False)
        if seed == 0:  # a hand-made plan that backfilling would break: c would start at 4 on GPU 1
            plan.jobs = [Job("a", [inst.loads[0].id], 1, [0], 0.0, 10.0, 0, 0),
                         Job("b", [inst.loads[1].id], 1, [1], 0.0, 4.0, 0, 0),
                         Job("c", [a.id for a in inst.loads[2:]], 1, [0], 10.0, 12.0, 0, 0)]
        run = tmp_path / f"run{seed}"
        run.mkdir()
        clock = [0.0]
        started: dict[str, float] = {}
        duration = {j.id: j.end - j.start for j in plan.jobs}

        def fake_launch(job_id, job_dir, slot, *, gpus=(), nproc=1, extra_env=None, run=run, clock=clock,
                        started=started, duration=duration):
            started[job_id] = clock[0]
            members = next(j.adapters for j in plan.jobs if j.id == job_id)

            def finish():
                for a in members:
                    out = run / "adapters" / a
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "metrics.json").write_text(json.dumps({"status": "done", "job_id": job_id}))

            return JobProcess(job_id, job_dir, slot, _FakeProc(clock, duration[job_id], finish), started=clock[0])

        monkeypatch.setattr(runner, "launch", fake_launch)
        journal = Journal(run / "journal.sqlite")
        journal.add_adapters([a.id for a in inst.loads])
        engine = Engine(run, journal, [f"cuda:{g}" for g in range(inst.gpus)],
                        lambda job: (run / "jobs" / job.id).mkdir(parents=True, exist_ok=True) or run / "jobs" / job.id)
        engine.submit(plan.jobs)
        while engine.queue or engine.running:
            engine._launch_ready()
            ends = [rj.proc.proc.end for rj in engine.running.values()]
            assert ends, "nothing runs and jobs wait"
            clock[0] = min(ends)
            engine._reap()
        journal.close()
        sim = simulate(plan, inst.cost_model) if seed else None
        expect = sim.starts if sim else {"a": 0.0, "b": 0.0, "c": 10.0}
        assert started == pytest.approx(expect, rel=1e-9, abs=1e-9), seed
        checked += 1
    assert checked == 4


@pytest.mark.slow
def test_many_more_instances_and_larger_sweeps_against_the_optimum():
    """Issue 34's full measure (216 instances) and sweeps of 10 adapters on 2 GPUs."""
    ratios = []
    larger = [random_instance(s, 2, src, n=(10, 10)) for s in range(6) for src in ("fitted", "analytic")]
    for inst in random_instances(216, seed=1000) + larger:
        plan = plan_sweep(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor, exact=False)
        found = solve_exact(Workload(inst.loads, inst.cost_model, inst.gpus, load_factor=inst.load_factor),
                            upper_bound=plan.makespan * (1 + 1e-9))
        assert found is not None and found.proven, inst.name
        best = found.makespan if found.jobs else plan.makespan
        assert plan.lower_bound <= best * (1 + 1e-9), inst.name
        sim = simulate(plan, inst.cost_model)
        assert sim.ok and sim.makespan == pytest.approx(plan.makespan, rel=1e-9), inst.name
        ratios.append(plan.makespan / best)
    assert float(np.mean(ratios)) <= 1.02 and max(ratios) <= 1.06
