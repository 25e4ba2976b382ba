"""A tune's cumulative view of its run directory (`RunState`): every configuration and job
so far, shared by the batched loop (`plora.tuning.loop`) and the asynchronous tuner
(`plora.tuning.asynchronous`), which both add to it."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from plora.cost.model import packed_load
from plora.planner.plan import PLAN_FILE, Job, Plan
from plora.spec.adapter import TRAINING_DIMS, AdapterConfig
from plora.spec.schema import SweepSpec
from plora.sweep import PreparedSweep, configs_frame


@dataclass
class RunState:
    """The tune's cumulative view of the run directory: every config and job so far, so that
    results.parquet, configs.parquet and plan.json describe the whole search."""

    spec: SweepSpec
    run_dir: Path
    configs: dict[str, AdapterConfig] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    jobs: list[Job] = field(default_factory=list)
    batches: list[dict[str, Any]] = field(default_factory=list)
    gpus: int = 0  # slots the batches were planned for

    @classmethod
    def load(cls, spec: SweepSpec, run_dir: Path) -> "RunState":
        st = cls(spec, run_dir)
        with contextlib.suppress(Exception):
            for r in pd.read_parquet(run_dir / "configs.parquet").to_dict("records"):
                cfg = AdapterConfig.make(r["rank"], r["alpha"], r["learning_rate"], r["batch_size"], r["seed"],
                                         **{n: r.get(n) for n in TRAINING_DIMS})
                st.configs[cfg.id] = cfg
                st.steps[cfg.id] = int(r.get("steps") or 0)
        with contextlib.suppress(Exception):  # a run directory of another plora version: start the plan afresh
            plan = Plan.of_run(run_dir)
            if plan is not None:
                st.batches, st.gpus = list(plan.batches), plan.gpus
                members = [(j, [a for a in j.adapters if a in st.configs]) for j in plan.jobs]
                st.jobs = [dataclasses.replace(j, adapters=m) for j, m in members if m]
        return st

    def next_batch(self) -> int:
        used = [int(m.group(1)) for j in self.jobs if (m := re.match(r"b(\d+)-", j.id))]
        used += [int(b.get("batch", 0)) for b in self.batches]
        return max(used, default=0) + 1

    def plan(self) -> Plan:
        """Every batch's jobs in one plan; each batch's predictions are in its record."""
        last = self.batches[-1].get("grouping", "") if self.batches else ""
        # the planner's micro-batches of every batch (`plora.planner.micro_batch`; the user's wins)
        chosen = {str(k): int(v) for b in self.batches for k, v in (b.get("micro_batches") or {}).items()}
        user = self.spec.training.micro_batch_size
        return Plan(list(self.jobs), adapters=[packed_load(c.id, c.rank, c.batch_size, self.steps[c.id],
                                                           user if user is not None else chosen.get(c.id))
                                               for c in self.configs.values()],
                    gpus=self.gpus, grouping=f"optuna: {len(self.batches)} batches; {last}", batches=list(self.batches),
                    micro_batches={} if user is not None else chosen)

    def prep(self) -> PreparedSweep:
        return PreparedSweep(self.spec, self.run_dir, list(self.configs.values()), dict(self.steps), self.plan())

    def add(self, configs: Sequence[AdapterConfig], steps: Mapping[str, int], jobs: Sequence[Job]) -> None:
        for c in configs:
            self.configs[c.id] = c
            self.steps[c.id] = int(steps.get(c.id, self.steps.get(c.id, 0)))
        self.jobs.extend(jobs)

    def add_batch(self, number: int, trials: Sequence[int], plan: Plan) -> None:
        """A batch's record: its trials, its jobs' ids and its plan's predictions."""
        summary = {k: v for k, v in plan.to_dict().items() if k not in ("kind", "jobs", "batches", "adapters")}
        self.batches.append({"batch": number, "trials": list(trials), "jobs": [j.id for j in plan.jobs], **summary})
        self.gpus = max(self.gpus, plan.gpus)

    def write(self) -> None:
        """configs.parquet and plan.json of everything so far (each batch's jobs keep their id)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        prep = self.prep()
        configs_frame(prep).to_parquet(self.run_dir / "configs.parquet", index=False)
        prep.plan.save(self.run_dir / PLAN_FILE)
