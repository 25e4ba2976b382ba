"""A lower bound on the makespan of any schedule of a sweep, on a given cost model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from plora.planner.workload import Workload

if TYPE_CHECKING:
    from plora.planner.lp_bound import ConfigurationLP

__all__ = ["lower_bound"]


def lower_bound(wl: Workload, *, lp: bool = True, solver: str = "auto",
                configuration: "ConfigurationLP | None" = None) -> float:
    """No schedule on ``wl``'s cost model, GPUs, memory budget and pack cap finishes sooner.

    It is the largest of these bounds:

    * **work**: ``sum_k w_k / G`` -- total work at the best packed throughput spread
      over all G GPUs. ``w_k`` (``Workload.ideal_work``) is adapter k's GPU-seconds in
      the most favourable job there could be: at the TP degree d that minimises
      ``d * (o / P_k(d) + steps_k * (m_k(d) + c0[d] / P_k(d)))``, where ``m_k(d)`` is
      what k adds to a step, ``c0[d]`` the fixed cost of a step (with one rank
      bucket's, which every job pays), ``o`` the cost
      model's once-per-job overhead and ``P_k(d)`` the most adapters a job holding k
      can pack (memory budget and cap). A job at degree d keeps d GPUs for
      ``o + c0[d] * max steps + sum steps_k m_k(d)`` seconds, which is at least the
      sum of its adapters' ``w_k``; G GPUs supply ``G * makespan`` GPU-seconds.
    * **straggler**: the longest single adapter (with its job's overhead), alone at
      its fastest degree -- packing only adds to an adapter's step time.

    * **packs**: the work bound charges a job's fixed step cost over the *average* steps
      of its adapters; here it is charged over their maximum. Sort all adapters by steps,
      s_1 >= s_2 >= ...; with at most P adapters per job, the i-th longest job runs at
      least s_((i-1)P+1) steps (the i-1 longer ones hold at most (i-1)P adapters). So
      G * makespan >= sum_i min_d(d c0[d]) s_((i-1)P+1) + sum_k steps_k min_d(d m_k(d))
      + ceil(n / P) min_d(d) o. Tight where adapters of very different lengths cannot
      fill packs of equals (a few batch-size-1 adapters among many larger batches).

    * **configuration LP** (`plora.planner.lp_bound`): the least GPU-seconds of any set
      of jobs covering every adapter, each job priced exactly, over G. It dominates the
      work bound when it converges (in seconds on the paper's space); when it does not,
      it is left out.

    All use exactly the quantities the planner optimises, so the plan's
    ``makespan / lower_bound`` is a certificate of how far from optimal it can be.
    ``configuration``: the LP already solved (`plan_sweep` also plans from its columns).
    """
    work = float((wl.bound_work * wl.counts).sum()) / wl.gpus
    straggler = float(wl.single_time.max()) if len(wl.types) else 0.0
    bounds = [work, straggler, _packs_bound(wl)]
    if configuration is not None:
        bounds.append(configuration.value)
    elif lp:
        from plora.planner.lp_bound import configuration_lp_bound

        value = configuration_lp_bound(wl, solver=solver)
        if value is not None:
            bounds.append(value)
    return max(bounds)


def _packs_bound(wl: Workload) -> float:
    if not len(wl.types):
        return 0.0
    biggest = max(int(np.max(wl.max_pack[d])) for d in wl.degrees)
    biggest = max(1, biggest)
    steps = np.sort(np.repeat(wl.steps, np.asarray(wl.counts, dtype=int)))[::-1]
    n_jobs = -(-len(steps) // biggest)
    best = 0.0
    for p in range(wl.num_pieces):  # a job costs at least each step-time piece's sum
        fixed = min(d * (wl.piece(d, p)[0] + wl.piece(d, p)[1]) for d in wl.degrees)  # every job has a rank bucket
        per_adapter = np.full(len(wl.types), np.inf)
        for d in wl.degrees:
            per_adapter = np.where(wl.fits[d], np.minimum(per_adapter, d * wl.piece(d, p)[2]), per_adapter)
        gpu_seconds = (fixed * float(steps[::biggest].sum()) + float((wl.counts * wl.steps * per_adapter).sum())
                       + n_jobs * min(wl.degrees) * wl.overhead)
        best = max(best, gpu_seconds / wl.gpus)
    return best
