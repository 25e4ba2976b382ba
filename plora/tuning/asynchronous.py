"""``plora tune --async``: packs that never drain. Trials stream into long-lived jobs.

The synchronous loop (`plora.tuning.loop`) waits for a whole batch before it asks again, so
a pack idles on its slowest adapter and a pruned adapter's slot stays empty. Here each slot
runs one job that lingers for joins (``streaming.linger_s``, at most ``cap`` adapters at
once: ``streaming.max_active``), and at every engine tick the tuner

1. reports the jobs' new intermediate evals to their trials, and notes the adapters the
   pruner stops;
2. tells every trial whose adapter has a result (metrics.json: done, diverged, pruned, or
   failed by the engine) exactly as the synchronous loop does (`tell_trial`);
3. asks a new trial for each slot so freed (a pruned adapter's slot counts as free at
   once) and sends it into that job (`Engine.join`): in the same control.json write as the
   prune, so it takes the pruned adapter's slot at the same step boundary. A trial joins
   only a pack that the cost model says it fits, with it, in the GPU's memory (the planner's
   load factor; an empty pack takes any); otherwise it waits for a slot, in the order
   asked, and no later trial overtakes it (`_Feeder._take`);
4. once every trial is asked and none waits, closes the jobs (they leave when their
   adapters have).

Every adapter is scored at the rungs of its own budget (`plora.tuning.fidelity`), so an
adapter that passes a rung trains on in its pack and one the pruner stops leaves it at the
step after its score, its slot taken by the next trial in the same control.json write. A
model-based sampler explores at random until as many trials are *told* as the loop's first
batch holds (`plora.tuning.samplers.Startup`), not merely asked. Once the budget is spent
(`plora.tuning.budget`) no trial is asked; trials waiting for a slot are told pruned, and
the jobs wind down: their adapters finish, or are pruned with ``on_budget: stop``. Under
``stop``, asking ends sooner: at the first trial that could not train to its end before
the budget is spent, or would keep a trial of the pack it joins from doing so
(`_Feeder._finishes_in_budget`: the cost model's time for the steps the pack has left,
with it, scaled by the job's measured pace, `plora.tuning.pace`); the run's first trials
are dealt out only while their packs can end within the budget (the first always starts).
So the trials running then end within it. Without that, trials joined freed slots until
the budget's last second and every one was pruned by it: on SmolLM2's arithmetic task with
a quarter of the grid's makespan, none of three seeds trained a trial through; and with a
check of the joining trial's own steps alone, the slower pack kept the first trials from
ending in three runs of six (both tasks, three seeds each).

A trial that proposes an adapter already trained is told that result without training;
one that proposes an adapter still training shares its result. Every trial of the run
carries the run's one ``batch`` number, and plan.json records the run as that batch.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from plora.cost.model import AdapterLoad, CostModel, packed_load
from plora.engine.join_choice import JOIN_TP, _timed, pack_fits, remaining_seconds, steps_left
from plora.engine.streaming import STREAM_LINGER_S
from plora.job.config import JobAdapter, JobStreaming
from plora.planner.plan import Job, Plan
from plora.spec.adapter import AdapterConfig
from plora.spec.schema import SweepSpec
from plora.cost.sweep_model import sweep_cost_model
from plora.job.from_spec import job_adapter
from plora.results.collect import result_row
from plora.sweep import PreparedSweep, SweepRows, collect_results, run_prepared
from plora.tuning.base import TuneError, _quiet_optuna
from plora.tuning.budget import BUDGET_LEFT_SHORT, BUDGET_SPENT, Budget, TuneHistory, never_trained
from plora.tuning.fidelity import Rungs
from plora.tuning.pace import JobPaces
from plora.tuning.prune import _finished_status, _PruneWatcher
from plora.tuning.run_state import RunState
from plora.tuning.space import config_from_params
from plora.tuning.samplers import Startup
from plora.tuning.study import tell_trial

if TYPE_CHECKING:
    from plora.engine.runner import Engine


@dataclass
class _Feeder:
    """The tuner's side of the engine's ticks (`Engine.feed`): see the module docstring."""

    spec: SweepSpec
    study: optuna.Study
    space: dict[str, Any]
    state: RunState
    prep: PreparedSweep
    n_trials: int
    in_flight: int  # trials training at once, over every job
    cap: int  # trials training at once in one job
    n_jobs: int  # jobs training at once (one per slot)
    batch: int
    n_train: int
    sign: float  # of the intermediate values (`intermediate_sign`)
    on_trial: Callable[[FrozenTrial], None] | None = None
    #: the sweep's cost model: a trial joins a job only if the pack with it fits its memory
    #: (None: only ``cap`` limits a pack)
    cost_model: CostModel | None = None
    rungs: Rungs | None = None  # the resource the watcher reports in
    budget: Budget = field(default_factory=Budget)
    history: TuneHistory | None = None
    startup: Startup | None = None
    asked: list[optuna.Trial] = field(default_factory=list)
    live: dict[str, list[optuna.Trial]] = field(default_factory=dict)  # adapter -> its trials, until told
    home: dict[str, str] = field(default_factory=dict)  # live adapter -> its job
    pruning: set[str] = field(default_factory=set)  # live adapters asked to leave: their slot is free
    waiting: list[str] = field(default_factory=list)  # live adapters no job had room for yet, in ask order
    jobs: dict[str, Job] = field(default_factory=dict)  # the run's jobs, with every adapter they took
    configs: dict[str, AdapterConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # reads the live trials
        self.watcher = _PruneWatcher(self.live, self.sign, can_prune=True, rungs=self.rungs, totals=self.prep.steps)
        self.wound_down = False
        # each running job's steps and measured pace against the cost model (`plora.tuning.pace`):
        # only what ``on_budget: stop`` asks (`_finishes_in_budget`), and only with a model that times packs
        stops = self.budget.on_budget == "stop" and self.budget.gpu_seconds is not None
        self.paces = JobPaces(self.cost_model, JOIN_TP) if stops and _timed(self.cost_model) else None

    # ------------------------------------------------------------------ trials
    def _ask(self) -> str | None:
        """One more trial; the adapter to train for it (None: it is told or shares a live one)."""
        with _quiet_optuna():
            trial = self.startup.ask(self.study, self.space) if self.startup else self.study.ask(self.space)
        self.asked.append(trial)
        cfg = config_from_params(self.spec, trial.params)
        trial.set_user_attr("adapter_id", cfg.id)  # visible while it trains
        trial.set_user_attr("batch", self.batch)
        self.configs[cfg.id] = cfg
        if cfg.id in self.live:
            self.live[cfg.id].append(trial)
            return None
        steps = self.spec.steps_for(cfg, self.n_train)
        if cfg.id not in self.state.configs:
            self.state.add([cfg], {cfg.id: steps}, [])
        if _finished_status(self.prep.run_dir, cfg.id) is not None:  # trained before: its result again
            self._tell(cfg.id, [trial])
            return None
        self.live[cfg.id] = [trial]
        if cfg.id not in self.prep.steps:
            self.prep.configs.append(cfg)
        self.prep.steps[cfg.id] = steps
        return cfg.id

    def _tell(self, adapter_id: str, trials: list[optuna.Trial], row: dict[str, Any] | None = None) -> None:
        cfg = self.configs[adapter_id]
        job = self.home.get(adapter_id)
        row = row or result_row(self.spec, self.prep.run_dir, cfg, job)
        if self.budget.exhausted and never_trained(row):
            row = BUDGET_SPENT  # never trained: its job was not started once the budget was spent
        for t in trials:
            tell_trial(self.study, self.spec, t, row, cfg, 1, self.prep.run_dir, self.batch)
            frozen = self.study.get_trials(deepcopy=False)[t.number]
            if self.history is not None:
                self.history.record(frozen)
            if self.on_trial is not None:
                self.on_trial(frozen)

    def _entry(self, adapter_id: str) -> JobAdapter:
        return job_adapter(self.spec, self.configs[adapter_id], self.prep.steps[adapter_id], self.prep.rungs)

    def _busy(self, job_id: str | None = None) -> int:
        """Slots taken (in one job, or in all, trials waiting for one included): live
        adapters not asked to leave."""
        return sum(1 for a in self.live
                   if a not in self.pruning and (job_id is None or self.home.get(a) == job_id))

    def _load(self, adapter_id: str) -> AdapterLoad:
        cfg = self.configs[adapter_id]
        return packed_load(adapter_id, cfg.rank, cfg.batch_size, self.prep.steps[adapter_id],
                           self.spec.training.micro_batch_size)

    def _has_room(self, job_id: str, adapter_id: str) -> bool:
        """Whether a trial's adapter may join a job now: the job holds fewer than ``cap``
        trials, and the cost model says the pack with it fits the GPU's memory. An empty
        pack takes any adapter (where else could it train?); one that the cost model is
        wrong about runs out of memory alone and is failed, as in a sweep."""
        pack = [a for a in self.live if a not in self.pruning and self.home.get(a) == job_id]
        if len(pack) >= self.cap:
            return False
        return not pack or pack_fits([*map(self._load, pack), self._load(adapter_id)], JOIN_TP, self.cost_model,
                                     max_adapters=self.cap, load_factor=self.spec.planner.memory_load_factor)

    def _next(self) -> str | None:
        """The next adapter to place: the first waiting one, else a new trial's while fewer
        than ``in_flight`` are live (None: nothing to place now)."""
        if self.waiting:
            return self.waiting[0]
        while self._busy() < self.in_flight and len(self.asked) < self.n_trials:
            a = self._ask()
            if a is None:  # told at once, or sharing a live adapter
                continue
            if not self._finishes_in_budget(a):
                self._last_ask(a)
                return None
            return a
        return None

    def _finishes_in_budget(self, adapter_id: str) -> bool:
        """Under ``on_budget: stop``, whether a new trial's adapter, joining the job it would
        join now, lets that job's pack train to its end before the budget is spent: the cost
        model's time for the steps the pack has left with it (trials leaving as they finish,
        and their evals), scaled by the job's measured pace, plus the job's start where its
        pack has not stepped yet; every job's GPUs busy meanwhile. A trial that fails this
        would be pruned by the budget or get another pruned; it is not started, and no
        trial after it. The run's first trial always starts."""
        model = self.cost_model
        if self.paces is None:  # no budget, ``finish``, or no model that times packs
            return True
        homes = {self.home[a] for a in self.live if a in self.home and a not in self.pruning}
        if not homes:
            return True
        fresh = len(homes) < self.n_jobs and not self.jobs  # the first fill deals to an empty job first
        job = None if fresh else min(homes, key=lambda j: (self._busy(j), j))
        pack = [self._load(a) for a in self.live
                if a != adapter_id and a not in self.pruning and job is not None and self.home.get(a) == job]
        loads = [*steps_left(pack, self.paces.done(job) if job is not None else {}), self._load(adapter_id)]
        seconds = remaining_seconds(loads, model)
        if job is not None:
            seconds *= self.paces.factor(job)
        if job is None or not self.paces.stepped(job):
            seconds += model.job_overhead_s
        return self.budget.ends_within(self.n_jobs * seconds)

    def _last_ask(self, adapter_id: str) -> None:
        """No trial is asked after this one, which is told pruned untrained; the running ones
        train on to their ends, within the budget."""
        self._tell(adapter_id, self.live.pop(adapter_id), BUDGET_LEFT_SHORT)
        self.n_trials = len(self.asked)

    def _take(self, job_id: str) -> list[str]:
        """Adapters that join a job now (it may be one not made yet): the waiting ones in
        the order asked, then new trials', while the job has room. The first without room
        waits for a slot (`waiting`), and nothing overtakes it: the packs drain to it."""
        taken: list[str] = []
        while (a := self._next()) is not None:
            if not self._has_room(job_id, a):
                if a not in self.waiting:
                    self.waiting.append(a)
                break
            if a in self.waiting:
                self.waiting.remove(a)
            self.home[a] = job_id
            taken.append(a)
        return taken

    # ------------------------------------------------------------------ jobs
    def _job_id(self, offset: int = 0) -> str:
        return f"b{self.batch:02d}-job-{len(self.jobs) + offset:03d}"

    def _new_job(self, adapters: list[str], gpus: list[int]) -> Job:
        job = Job(self._job_id(), list(adapters), 1, gpus)
        self.jobs[job.id] = job
        for a in adapters:
            self.home[a] = job.id
        self.state.add([], {}, [job])
        return job

    def first_jobs(self) -> list[Job]:
        """The jobs the run starts with: one per slot, the first trials dealt out in turn
        (each to the job with the fewest trials that has room for it; the first that none
        has room for waits)."""
        ids = [self._job_id(i) for i in range(self.n_jobs)]
        while (a := self._next()) is not None and a not in self.waiting:
            room = [j for j in ids if self._has_room(j, a)]
            if not room:
                self.waiting.append(a)
                break
            self.home[a] = min(room, key=lambda j: (self._busy(j), ids.index(j)))
        members = {j: [a for a in self.live if self.home.get(a) == j] for j in ids}
        return [self._new_job(members[j], [i]) for i, j in enumerate(ids) if members[j]]

    def __call__(self, engine: Engine) -> None:
        running = {j: rj for j, rj in engine.running.items() if rj.proc.proc.poll() is None}
        self.budget.observe([rj.proc for rj in engine.running.values()], engine.finished)
        self._measure(running)
        if self.budget.exhausted and not self.wound_down:
            self._wind_down(engine)
        status = engine.journal.adapter_status()
        finished = [a for a in self.live
                    if a not in self.waiting and (engine.result(a) is not None or status.get(a) == "failed")]
        prunes: dict[str, list[str]] = {}
        for job_id in self.jobs:  # finished adapters' last evals too, before they are told
            job_dir = self.prep.run_dir / "jobs" / job_id
            for a in self.watcher.poll(job_dir, prune=job_id in running, request=False):
                if a in self.live and a not in finished:
                    self.pruning.add(a)
                    prunes.setdefault(job_id, []).append(a)
        for a in finished:
            self._tell(a, self.live.pop(a))
            self.pruning.discard(a)
        joins: dict[str, list[str]] = {}
        for job_id in sorted(running):
            if job_id not in self.jobs or job_id in engine.closed:
                continue
            for a in self._take(job_id):
                joins.setdefault(job_id, []).append(a)
                self.jobs[job_id].adapters.append(a)
        for job_id in sorted(set(prunes) | set(joins)):
            engine.join(job_id, [self._entry(a) for a in joins.get(job_id, [])], prune=prunes.get(job_id, []))
        alive = [j for j in self.jobs if j in engine.running or any(q.id == j for q in engine.queue)]
        if len(alive) < self.n_jobs:  # a job ended early (crashed for good, or tired of waiting)
            adapters = self._take(self._job_id())
            if adapters:
                engine.submit([self._new_job(adapters, [])])
                self.state.write()
        if len(self.asked) >= self.n_trials and not self.waiting:
            for job_id in running:
                if job_id not in engine.closed:
                    engine.close(job_id)
        for job_id in running:  # a job the engine made (an out-of-memory half) takes no joins
            if job_id not in self.jobs and job_id not in engine.closed:
                engine.close(job_id)

    def _measure(self, running: dict[str, Any]) -> None:
        """Each running job's adapters' steps, and its pace (`plora.tuning.pace`), where
        ``on_budget: stop`` needs them."""
        if self.paces is None:
            return
        now = time.time()
        for job_id, rj in running.items():
            if job_id not in self.jobs:
                continue
            pack = [self._load(a) for a in self.live if a not in self.pruning and self.home.get(a) == job_id]
            self.paces.observe(job_id, rj.proc.progress().get("adapter_steps") or {}, pack, now)

    def _wind_down(self, engine: Engine) -> None:
        """The budget is spent: ask no more trials, tell the waiting ones pruned, and let the
        jobs' adapters finish (or prune them: ``on_budget: stop``)."""
        self.wound_down = True
        self.n_trials = len(self.asked)
        for a in list(self.waiting):
            self._tell(a, self.live.pop(a), BUDGET_SPENT)
        self.waiting.clear()
        engine.wind_down(prune=self.budget.stops)
        if self.budget.stops:
            self.pruning.update(a for a in self.live if a in self.home)

    def tell_the_rest(self) -> None:
        """Trials whose adapter has no result once every job has ended: told as failed."""
        for a in list(self.live):
            self._tell(a, self.live.pop(a))
        self.waiting.clear()


def tune_async(
    spec: SweepSpec,
    study: optuna.Study,
    space: dict[str, Any],
    state: RunState,
    *,
    n_trials: int,
    in_flight: int,
    slots: list[str],
    sign: float,
    n_train: int,
    on_trial: Callable[[FrozenTrial], None] | None = None,
    on_tick: Callable[[list, list], None] | None = None,
    on_snapshot: Callable[[Any], None] | None = None,
    cost_model: CostModel | None = None,
    rungs: Rungs | None = None,
    scored_at: Rungs | None = None,
    budget: Budget | None = None,
    history: TuneHistory | None = None,
    startup: Startup | None = None,
    rows: SweepRows | None = None,
) -> tuple[list[optuna.Trial], list[str], float]:
    """Run ``n_trials`` trials through long-lived jobs, ``in_flight`` at once (see the module
    docstring); returns the trials asked, the jobs' ids and the wall time. ``cost_model``
    judges whether a trial fits a job's memory (default: the sweep's, `sweep_cost_model`:
    the run's or this machine's profile, else the analytic model). ``rungs``: the resource
    intermediate scores are reported in; ``scored_at``: the rungs every adapter is scored at
    (a pruner's; None: ``eval.every_steps`` only); ``budget``, ``history`` and ``startup``:
    see the module docstring. ``rows``: what the jobs are given of their rows, as a sweep of
    the space decides it (`plora.tuning.loop.tune_rows`; None: the spec's settings as they are)."""
    t0 = time.time()
    if "targets" in spec.space.searched():  # its jobs live for the whole run, each with one target set
        raise TuneError("--async: space.targets cannot be searched asynchronously (a job adapts one target set); "
                        "tune it in batches")
    if cost_model is None:
        cost_model = sweep_cost_model(spec, state.run_dir)
    cost_model = cost_model.scored_in_line()  # its jobs linger for joins: none scores beside training
    batch = state.next_batch()
    n_jobs = max(1, min(len(slots), in_flight))
    cap = min(spec.planner.max_adapters_per_job, math.ceil(in_flight / n_jobs))
    cap = max(cap, 1)
    if rows is None:
        rows = SweepRows(spec, spec.training.row_layout, spec.training.length_buckets)
    prep = PreparedSweep(rows.spec, state.run_dir, [], {}, Plan([]),
                         streaming=JobStreaming(linger_s=STREAM_LINGER_S, max_active=cap), rungs=scored_at,
                         row_layout=rows.layout, length_buckets=rows.length_buckets)
    feeder = _Feeder(spec, study, space, state, prep, n_trials, min(in_flight, n_jobs * cap), cap, n_jobs, batch,
                     n_train, sign, on_trial, cost_model, rungs, budget or Budget(), history, startup)
    try:
        jobs = feeder.first_jobs()
        state.write()
        if jobs:
            prep.plan = Plan(jobs, gpus=n_jobs, grouping=f"asynchronous: {n_jobs} jobs of up to {cap} trials")
            run_prepared(prep, on_tick=on_tick, on_snapshot=on_snapshot, slots=slots, replan=False, feed=feeder)
        feeder.tell_the_rest()
    except BaseException:
        with _quiet_optuna():
            for t in feeder.asked:  # interrupted or broken: no trial stays RUNNING forever
                with contextlib.suppress(Exception):
                    study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
        raise
    finally:
        plan = Plan(list(feeder.jobs.values()), gpus=n_jobs,
                    grouping=f"asynchronous: {n_jobs} jobs of up to {cap} trials, joined as trials finished")
        state.add_batch(batch, [t.number for t in feeder.asked], plan)
        state.batches[-1]["asynchronous"] = True
        state.write()
        collect_results(state.prep())
    return feeder.asked, list(feeder.jobs), time.time() - t0

