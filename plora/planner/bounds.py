"""A lower bound on the makespan of any schedule of a sweep, on a given cost model."""

from __future__ import annotations

from plora.planner.workload import Workload

__all__ = ["lower_bound"]


def lower_bound(wl: Workload) -> float:
    """No schedule on ``wl``'s cost model, GPUs, memory budget and pack cap finishes sooner.

    It is the larger of two bounds:

    * **work**: ``sum_k w_k / G`` -- total work at the best packed throughput spread
      over all G GPUs. ``w_k`` (``Workload.ideal_work``) is adapter k's GPU-seconds in
      the most favourable job there could be: at the TP degree d that minimises
      ``d * (o / P_k(d) + steps_k * (m_k(d) + c0[d] / P_k(d)))``, where ``m_k(d)`` is
      what k adds to a step, ``c0[d]`` the fixed cost of a step, ``o`` the cost
      model's once-per-job overhead and ``P_k(d)`` the most adapters a job holding k
      can pack (memory budget and cap). A job at degree d keeps d GPUs for
      ``o + c0[d] * max steps + sum steps_k m_k(d)`` seconds, which is at least the
      sum of its adapters' ``w_k``; G GPUs supply ``G * makespan`` GPU-seconds.
    * **straggler**: the longest single adapter (with its job's overhead), alone at
      its fastest degree -- packing only adds to an adapter's step time.

    Both use exactly the quantities the planner optimises, so the plan's
    ``makespan / lower_bound`` is a certificate of how far from optimal it can be.
    """
    work = float((wl.work * wl.counts).sum()) / wl.gpus
    straggler = float(wl.single_time.max()) if len(wl.types) else 0.0
    return max(work, straggler)
