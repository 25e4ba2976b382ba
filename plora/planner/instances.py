"""Seeded random small sweeps, to hold the planner against the exact optimum.

The kind of instance issue 34 measured the planner on: 6-9 adapters of ranks 8-128, batch
sizes 1-8 and different step counts, on 2 or 4 GPUs, priced by a fitted profile
(``scripts/profiles/``) or the analytic model, with a GPU memory chosen so that it binds
in many instances (not every adapter fits one job). Used by the tests and by
``scripts/bench_planner.py --exact``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plora.cost.model import AdapterLoad, CostModel

from plora.models.shape import ModelShape

__all__ = ["Instance", "PROFILES_DIR", "random_instance", "random_instances"]

PROFILES_DIR = Path(__file__).resolve().parents[2] / "scripts" / "profiles"
RANKS = (8, 16, 32, 64, 128)
BATCH_SIZES = (1, 2, 4, 8)
STEPS = (50, 100, 200, 300, 400, 600)
ANALYTIC_SHAPES = ("qwen2.5-0.5b", "qwen2.5-3b", "qwen2.5-7b")


@dataclass
class Instance:
    """One small sweep: adapters, cost model, GPUs; ``source`` says which model priced it."""

    name: str
    loads: list[AdapterLoad]
    cost_model: CostModel
    gpus: int
    source: str  # "fitted" or "analytic"
    load_factor: float = 0.9


def _cost_model(rng: np.random.Generator, source: str) -> CostModel:
    if source == "fitted":
        files = sorted(PROFILES_DIR.glob("*.json"))
        return CostModel.load(files[int(rng.integers(len(files)))])
    shape = ModelShape.preset(ANALYTIC_SHAPES[int(rng.integers(len(ANALYTIC_SHAPES)))])
    return CostModel.analytic(shape, int(rng.choice([256, 512, 1024])), 80 * 2**30)


def random_instance(seed: int, gpus: int, source: str, *, n: tuple[int, int] = (6, 9)) -> Instance:
    """A seeded instance; its GPU memory is set between "the biggest adapter barely fits one
    GPU" and "all of them fit one GPU", so packs are limited by memory in most instances."""
    rng = np.random.default_rng([seed, gpus, 0 if source == "fitted" else 1])
    cm = _cost_model(rng, source)
    k = int(rng.integers(n[0], n[1] + 1))
    loads = [AdapterLoad(f"a{i}", int(rng.choice(RANKS)), int(rng.choice(BATCH_SIZES)), int(rng.choice(STEPS)))
             for i in range(k)]
    lf = 0.9
    need_one = max(cm.memory([a], 1) for a in loads)
    need_all = cm.memory(loads, 1)
    # memory between the largest adapter alone and everything together (log-uniform), or
    # the profile's own where that is already smaller
    mem = float(np.exp(rng.uniform(np.log(need_one * 1.02), np.log(need_all * 1.05)))) / lf
    cm = dataclasses.replace(cm, gpu_memory_bytes=min(mem, cm.gpu_memory_bytes))
    if cm.memory([max(loads, key=lambda a: cm.memory([a], 1))], 1) > lf * cm.gpu_memory_bytes:
        cm = dataclasses.replace(cm, gpu_memory_bytes=need_one / lf * 1.02)
    return Instance(f"{source}-{gpus}gpu-{seed}", loads, cm, gpus, source, lf)


def random_instances(count: int, *, seed: int = 0, gpus: tuple[int, ...] = (2, 4),
                     sources: tuple[str, ...] = ("fitted", "analytic")) -> list[Instance]:
    """``count`` instances, spread evenly over the GPU counts and cost-model sources."""
    combos = [(g, s) for s in sources for g in gpus]
    return [random_instance(seed + i // len(combos), *combos[i % len(combos)]) for i in range(count)]
