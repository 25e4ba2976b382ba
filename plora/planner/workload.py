"""The sweep as the planner sees it: adapter *types* with counts, and their costs.

Adapters with equal (rank, batch size, steps) are interchangeable for planning:
they cost the same memory and time in any job. Grouping them turns the ILP's
one binary per adapter into one integer count per type, which for a sweep of
120 configurations drawn from 5 ranks x 6 batch sizes is at most 30 integers --
the symmetry a binary model would make the solver rediscover by branching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from plora.cost.model import AdapterLoad, CostModel, rank_bucket
from plora.planner.errors import PlannerError

__all__ = ["AdapterType", "Workload"]


@dataclass(frozen=True)
class AdapterType:
    rank: int
    batch_size: int
    steps: int

    def load(self, id: str = "") -> AdapterLoad:
        return AdapterLoad(id=id, rank=self.rank, batch_size=self.batch_size, steps=self.steps)


class Workload:
    """Adapter types, their counts and per-degree cost arrays, for one planning problem.

    Per TP degree ``d`` (only degrees the model supports and ``<= gpus``):
    ``mem[d][t]`` bytes one adapter of type t adds, ``step[d][t]`` seconds it adds to
    each step, ``fits[d][t]`` whether it fits alone. ``work[t]`` is the type's ideal
    GPU-seconds as the planner prices it (see :meth:`planning_work`), the unit in which it
    counts progress; ``bound_work[t]`` the lower bound's (:meth:`ideal_work`).
    """

    def __init__(
        self,
        loads: Sequence[AdapterLoad],
        cost_model: CostModel,
        gpus: int,
        *,
        load_factor: float = 0.9,
        max_adapters_per_job: int | None = None,
    ) -> None:
        if gpus < 1:
            raise PlannerError(f"gpus: must be at least 1, got {gpus}")
        if not 0 < load_factor <= 1:
            raise PlannerError(f"load_factor: must be in (0, 1], got {load_factor}")
        if max_adapters_per_job is not None and max_adapters_per_job < 1:
            raise PlannerError(f"max_adapters_per_job: must be at least 1, got {max_adapters_per_job}")
        seen: set[str] = set()
        for a in loads:
            if a.id in seen:
                raise PlannerError(f"adapter {a.id}: duplicate id")
            if a.rank < 1 or a.batch_size < 1 or a.steps < 1:
                raise PlannerError(f"adapter {a.id}: rank, batch_size and steps must be positive")
            seen.add(a.id)
        self.loads = list(loads)
        self.cost_model = cost_model
        self.gpus = gpus
        self.load_factor = load_factor
        self.cap = max_adapters_per_job if max_adapters_per_job is not None else max(1, len(loads))
        self.budget = load_factor * cost_model.gpu_memory_bytes

        groups: dict[AdapterType, list[str]] = {}
        for a in self.loads:
            groups.setdefault(AdapterType(a.rank, a.batch_size, a.steps), []).append(a.id)
        self.types: list[AdapterType] = sorted(groups, key=lambda t: (t.steps, t.batch_size, t.rank))
        self.ids: list[list[str]] = [groups[t] for t in self.types]
        self.counts: tuple[int, ...] = tuple(len(i) for i in self.ids)
        self.by_id = {a.id: a for a in self.loads}

        # TP degrees are powers of two (DTM splits GPUs into such groups) within the GPU count.
        self.degrees = [d for d in cost_model.degrees if d <= gpus and d & (d - 1) == 0]
        self.rank = np.array([t.rank for t in self.types], dtype=float)
        # rank buckets: each distinct one in a pack adds c_bkt[d] to every step while it is in it
        self.buckets = sorted({rank_bucket(t.rank) for t in self.types})
        self.bucket = np.array([self.buckets.index(rank_bucket(t.rank)) for t in self.types], dtype=int)
        self.c_bkt: dict[int, float] = {}
        self.steps = np.array([t.steps for t in self.types], dtype=float)
        self.mem: dict[int, np.ndarray] = {}
        self.step: dict[int, np.ndarray] = {}
        self.fits: dict[int, np.ndarray] = {}
        self.mem_base: dict[int, float] = {}
        self.c0: dict[int, float] = {}
        self.fit_alone: dict[int, np.ndarray] = {}
        # The step takes the longest of its linear pieces (GPU, and the host where profiled):
        # (c0, c_bkt, per-type step cost) each; c0/c_bkt/step above are the first, the GPU's.
        self.pieces: dict[int, list[tuple[float, float, np.ndarray]]] = {}
        for d in self.degrees:
            self.mem_base[d] = cost_model.memory_base(d)
            self.c0[d] = cost_model.step_base(d)
            self.c_bkt[d] = float(cost_model.step_per_bucket(d)) if hasattr(cost_model, "step_per_bucket") else 0.0
            self.mem[d] = np.array([cost_model.memory_per_adapter(t.load(), d) for t in self.types])
            self.step[d] = np.array([cost_model.step_per_adapter(t.load(), d) for t in self.types])
            self.pieces[d] = [(self.c0[d], self.c_bkt[d], self.step[d])]
            for c in (cost_model.pieces(d)[1:] if hasattr(cost_model, "pieces") else ()):
                self.pieces[d].append(
                    (c.c0, c.c_bkt, np.array([cost_model.piece_per_adapter(c, t.load()) for t in self.types])))
            self.fits[d] = self.mem_base[d] + self.mem[d] <= self.budget * (1 + 1e-12)
            # how many adapters of each type alone would fit one job next to the base
            self.fit_alone[d] = np.floor((self.budget - self.mem_base[d]) / np.maximum(self.mem[d], 1.0) * (1 + 1e-12))
        self._check_placeable()
        self.max_pack = {d: self._max_pack(d) for d in self.degrees}
        self.overhead = float(getattr(cost_model, "job_overhead_s", 0.0))  # once per job
        self.bucket_pack = {d: self._bucket_pack(d) for d in self.degrees}
        self.same_pack = {d: self._same_pack(d) for d in self.degrees}
        self.bound_work = self.ideal_work()
        self.work = self.planning_work()
        # a job of one adapter alone, per degree, and at its fastest degree: no pack makes it faster
        self._alone = {d: self.overhead + self.steps * np.max([c0 + c_bkt + step for c0, c_bkt, step in self.pieces[d]],
                                                              axis=0) for d in self.degrees}
        self.single_time = np.full(len(self.types), np.inf)
        for d in self.degrees:
            self.single_time = np.where(self.fits[d], np.minimum(self.single_time, self._alone[d]), self.single_time)

    # ------------------------------------------------------------------------------------
    def _check_placeable(self) -> None:
        for i, t in enumerate(self.types):
            if not any(self.fits[d][i] for d in self.degrees):
                cm = self.cost_model
                degrees = self.degrees or list(cm.degrees)
                need = min(cm.memory([t.load()], d) for d in degrees)
                raise PlannerError(
                    f"adapter {self.ids[i][0]} (rank {t.rank}, batch size {t.batch_size}) fits at no TP degree "
                    f"<= {self.gpus} GPUs: needs {need / 2**30:.1f} GiB per GPU at best, budget "
                    f"{self.budget / 2**30:.1f} GiB"
                )

    def _max_pack(self, d: int, counts: np.ndarray | None = None) -> np.ndarray:
        """Per type: the most adapters any job at degree d containing one of that type can hold
        (``counts``: the adapters that may be companions, default all).

        Taking the other adapters smallest-memory-first gives the largest number of
        companions that fit, so this is an exact cardinality bound. Done with a
        prefix sum over the adapters sorted by memory: with one unit of type i
        (at position p_i of that order) set aside, the first k others weigh C[k]
        when k <= p_i and C[k + 1] - mem_i after it.
        """
        mem = self.mem[d]
        order = np.argsort(mem, kind="stable")
        counts = np.asarray(self.counts if counts is None else counts)[order]
        units = np.repeat(mem[order], counts)
        csum = np.concatenate([[0.0], np.cumsum(units)])
        start = np.empty(len(self.types), dtype=int)
        start[order] = np.concatenate([[0], np.cumsum(counts)[:-1]])
        n_total = len(units)
        out = np.zeros(len(self.types), dtype=float)
        for i in range(len(self.types)):
            if not self.fits[d][i]:
                continue
            room = (self.budget - self.mem_base[d] - mem[i]) * (1 + 1e-12)
            p = start[i]
            k = int(np.searchsorted(csum, room, side="right")) - 1
            if k >= p:  # every adapter before type i's first fits: continue past the one set aside
                k = int(np.searchsorted(csum, room + mem[i], side="right")) - 2
                k = max(p, min(k, n_total - 1))
            out[i] = 1 + min(k, self.cap - 1)
        return out

    def ideal_work(self) -> np.ndarray:
        """Per type: GPU-seconds one adapter costs in the most favourable job possible.

        With the linear step model a job J at degree d occupies its d GPUs for
        ``o + c0[d] * max_k steps_k + sum_k steps_k * m_k(d)`` seconds (``o`` the cost
        model's once-per-job overhead), and ``max_k steps_k >= sum_k steps_k / |J|`` with
        ``|J| <= P_k(d)``, the largest pack that can contain k (:meth:`_max_pack`); likewise
        each rank bucket b in J costs ``c_bkt[d]`` per step for its longest adapter's steps,
        shared by at most ``Q_k(d)`` adapters of k's bucket (:meth:`_bucket_pack`). Hence
        every job's GPU-seconds are at least the sum over its adapters of
        ``d * (o / P_k(d) + steps_k * (m_k(d) + c0[d] / P_k(d) + c_bkt[d] / Q_k(d)))``,
        minimised over the degrees where k fits. Summed over adapters this bounds the whole
        sweep's GPU-seconds from below.
        """
        # a job pays each rank bucket's step cost over its longest adapter of that bucket:
        # shared at best by the adapters of the bucket it can hold.
        # With several step-time pieces a job costs at least each piece's sum, not the sum of
        # per-adapter maxima: the bound takes the one piece whose total is largest.
        per_piece = [self._cheapest_work(self.max_pack, self.bucket_pack, piece=p) for p in range(self.num_pieces)]
        return max(per_piece, key=lambda w: float(w @ np.asarray(self.counts, dtype=float)))

    @property
    def num_pieces(self) -> int:
        return max((len(v) for v in self.pieces.values()), default=1)

    def piece(self, d: int, p: int) -> tuple[float, float, np.ndarray]:
        """Piece ``p`` of the step time at degree d (the GPU piece where d has fewer)."""
        pieces = self.pieces[d]
        return pieces[min(p, len(pieces) - 1)]

    def _cheapest_work(self, pack: dict[int, np.ndarray], share: dict[int, np.ndarray],
                       piece: int | None = None) -> np.ndarray:
        """Per type, at its cheapest degree: d x (its share of the job overhead and of the
        per-step constant among ``pack[d]`` adapters, of its bucket's step cost among
        ``share[d]``, plus its own step cost) over its steps; under one ``piece`` of the step
        time, or (None) the largest of them per type."""
        w = np.full(len(self.types), np.inf)
        for d in self.degrees:
            p, q = np.maximum(pack[d], 1), np.maximum(share[d], 1)
            chosen = self.pieces[d] if piece is None else [self.piece(d, piece)]
            per_step = np.max([step + c0 / p + c_bkt / q for c0, c_bkt, step in chosen], axis=0)
            cost = d * (self.overhead / p + self.steps * per_step)
            w = np.where(self.fits[d], np.minimum(w, cost), w)
        return w

    def _bucket_pack(self, d: int) -> np.ndarray:
        """Per type: the most adapters of its own rank bucket a job at degree d holding it can
        hold -- how many can share that bucket's per-step cost."""
        out = np.zeros(len(self.types))
        for b in range(len(self.buckets)):
            mine = self.bucket == b
            out[mine] = self._max_pack(d, np.where(mine, self.counts, 0))[mine]
        return out

    def _same_pack(self, d: int) -> np.ndarray:
        """Per type: how many adapters of its own memory fit one job at degree d (at most
        the cap): the pack a type can count on. `_max_pack` assumes the smallest
        companions, which exist only for some of the adapters that need them."""
        return np.clip(np.minimum(self.fit_alone[d], self.max_pack[d]), 1, max(self.cap, 1))

    def planning_work(self) -> np.ndarray:
        """Per type: GPU-seconds of one adapter in a pack of `_same_pack` adapters like it,
        at its cheapest degree -- what the scheduler expects an adapter still waiting to
        cost. The lower bound's `ideal_work` prices every adapter as packed with the
        smallest companions; pricing the ones too large for that so cheaply makes running
        them look wasteful, and the scheduler would leave GPUs idle rather than start them."""
        return self._cheapest_work(self.same_pack, self.same_pack)

    def pack_time(self, i: int, n: int) -> float:
        """Shortest job time of n adapters of type i alone together (n capped at what fits)."""
        best = np.inf
        for d in self.degrees:
            if self.fits[d][i]:
                k = max(1, min(n, int(self.same_pack[d][i])))
                per_step = max(c0 + c_bkt + k * step[i] for c0, c_bkt, step in self.pieces[d])
                best = min(best, self.overhead + self.steps[i] * per_step)
        return float(best)

    def single_times(self, d: int) -> np.ndarray:
        """Per type: the time of a job of one such adapter alone at degree d."""
        return self._alone[d]

    # ------------------------------------------------------------------------------------
    def job_time(self, counts: np.ndarray, d: int) -> float:
        """Exact job time of a pack given as counts per type.

        One linear piece has a closed form; with several, the job runs phase by phase (an
        adapter leaves when its steps are done) and each phase's step is the longest piece.
        """
        counts = np.asarray(counts, dtype=float)
        if counts.sum() <= 0:
            return 0.0
        if len(self.pieces[d]) == 1:
            return self.job_time_bound(counts, d)
        present = counts > 0
        total, done = self.overhead, 0.0
        for s in np.unique(self.steps[present]):
            still = np.where(present & (self.steps >= s), counts, 0.0)
            total += (s - done) * self.step_time(still, d)
            done = s
        return float(total)

    def job_time_bound(self, counts: np.ndarray, d: int) -> float:
        """The largest piece's closed-form job time: exact with one piece, never above
        `job_time` otherwise (a maximum of sums is at most the sum of maxima)."""
        counts = np.asarray(counts, dtype=float)
        if counts.sum() <= 0:
            return 0.0
        present = counts > 0
        s_max = float(self.steps[present].max())
        buckets = sum(float(self.steps[present & (self.bucket == b)].max(initial=0.0)) for b in range(len(self.buckets)))
        return self.overhead + max(c0 * s_max + c_bkt * buckets + float(counts @ (self.steps * step))
                                   for c0, c_bkt, step in self.pieces[d])

    def step_time(self, counts: np.ndarray, d: int) -> float:
        counts = np.asarray(counts, dtype=float)
        n_buckets = len(set(self.bucket[counts > 0].tolist()))
        return max(c0 + c_bkt * n_buckets + float(counts @ step) for c0, c_bkt, step in self.pieces[d])

    def memory(self, counts: np.ndarray, d: int) -> float:
        return self.mem_base[d] + float(np.asarray(counts, dtype=float) @ self.mem[d])

    def pack_fits(self, counts: np.ndarray, d: int) -> bool:
        counts = np.asarray(counts)
        return (
            counts.sum() >= 1
            and counts.sum() <= self.cap
            and self.memory(counts, d) <= self.budget * (1 + 1e-9)
            and bool(np.all(self.fits[d][counts > 0]))
        )
