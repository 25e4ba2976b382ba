"""The profiler: probe a model on this machine, fit its cost model, validate it; and a
sweep's model from the cache or measured.

* **Job terms.** Probes run in-process and cannot see what a job of a sweep pays besides
  its steps: process start, model load, the first step's one-time costs, a graph capture
  whenever the pack changes, the packed eval and the saves of adapters leaving. One short
  real job (`plora.cost.profiling.job_probe`, run as the engine runs jobs, with adapters leaving in groups
  of different sizes) reports its phases, and `plora.cost.job.fit_overheads` fits them; the
  raw phases are kept in the profile (``job_runs``) and the phases of a finished sweep's
  jobs are fitted in with them (`remember_job_phases`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

from plora.cost.model import AdapterLoad, CostModel

from plora.models.families.targets import resolve_lora_targets

from plora.models.shape import ModelShape
from plora.cost.job import fit_overheads
from plora.cost.profiling.job_probe import run_job_probe
from plora.cost.profiling.calibrate import Calibration, PackFootprint, PackTiming
from plora.cost.profiling.cache import _backend, _device_info, _sweep_cache_path, profile_key, shape_from_model
from plora.cost.profiling.errors import ProfileError
from plora.cost.profiling.fit import fit_cost_model
from plora.cost.profiling.measure import DEFAULT_ITERS, DEFAULT_WARMUP, Log, _match_job_allocator, run_probe
from plora.cost.profiling.probes import (CPU_MAX_ROWS, Measurement, Probe, _probe_rows, calibration_probes, far_from_limit,
                                    fill_probes, fit_probes, holdout_probes, limit_probes, sweep_pack_rows)
from plora.cost.profiling.record import Profile

#: more warm-up steps for the first probe of a process
FIRST_PROBE_EXTRA_WARMUP = 3
#: `profile_sweep` on a CPU: shorter probes (the CPU path is for the demo, not for planning a cluster)
CPU_DEFAULTS = {"max_probe_s": 0.5, "holdout": 3}


def profile_model(
    model_dir: str | Path,
    shape: ModelShape,
    *,
    seq_len: int,
    dtype: str = "bfloat16",
    device: str = "auto",
    targets: str | Iterable[str] | None = None,
    family: str = "auto",
    dropout: float = 0.0,
    gpu_memory_bytes: float | None = None,
    tp_degrees: Iterable[int] = (1,),
    load_factor: float = 0.9,
    kmax: int = 16,
    max_rows: int | None = None,
    warmup: int = DEFAULT_WARMUP,
    iters: int = DEFAULT_ITERS,
    max_probe_s: float | None = None,
    holdout: int = 6,
    limit: bool | None = None,
    fill: bool | None = None,
    num_threads: int | None = None,
    deadline: float | None = None,
    min_checks: int = 0,
    log: Log | None = None,
    on_measurement: Callable[[Measurement], None] | None = None,
    activation_checkpointing: bool = False,
    cuda_graphs: Any = "auto",
    job_probe: bool = False,
    random_init: bool = True,
) -> Profile:
    """Probe a model on this machine, fit its cost model, validate it on held-out packs.

    ``limit`` adds the near-limit packs of `limit_probes` to the validation, ``fill`` the
    memory-filling packs of `fill_probes` to the fit (both by default on a GPU).
    ``deadline`` (a ``time.time()`` value) skips validation packs that would start after
    it, once ``min_checks`` of them have run; the fit probes always run. ``job_probe`` also
    runs one short real job (`plora.cost.profiling.job_probe`) and fits the job terms from its phases.
    """
    say = log or (lambda _msg: None)
    device, device_name, total = _device_info(device)
    cuda = device.startswith("cuda")
    if gpu_memory_bytes is None:
        if total is None:
            raise ProfileError("gpu_memory_bytes is needed on CPU")
        gpu_memory_bytes = total
    names = list(resolve_lora_targets(targets))
    if limit is None:
        limit = cuda
    if fill is None:
        fill = cuda
    if max_rows is None and not cuda:
        max_rows = CPU_MAX_ROWS
    key = profile_key(shape, seq_len=seq_len, dtype=dtype, device_name=device_name,
                      backend=_backend(device, activation_checkpointing, cuda_graphs), targets=names, dropout=dropout,
                      activation_checkpointing=activation_checkpointing)

    from scipy.optimize import nnls  # noqa: F401 - loaded now, not between probes (it moves the CPU baseline)

    first = [True]

    def measure(p: Probe) -> Measurement:
        # The process' first steps pay one-time costs (lazy loading, kernel compilation,
        # allocator growth) beyond a normal warm-up: the first probe warms up longer.
        extra = FIRST_PROBE_EXTRA_WARMUP if first[0] else 0
        first[0] = False
        try:
            m = run_probe(model_dir, p, seq_len=seq_len, dtype=dtype, device=device, targets=names, family=family,
                          dropout=dropout, warmup=warmup + extra, iters=iters, max_probe_s=max_probe_s,
                          num_threads=num_threads, activation_checkpointing=activation_checkpointing,
                          cuda_graphs=cuda_graphs, quantize=shape.quantize)
        except Exception as e:  # noqa: BLE001 - one failed probe is reported, the others still count
            m = Measurement(p, int(seq_len), error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        if m.error and not m.oom:
            say(f"  {p.role:7} {p.name:14} {p.label():40} failed: {m.error}")
        elif m.oom:
            say(f"  {p.role:7} {p.name:14} {p.label():40} out of memory")
        else:
            say(f"  {p.role:7} {p.name:14} {p.label():40} {m.step_time * 1e3:9.2f} ms  "
                f"{m.peak_bytes / 2**30:7.2f} GiB  ({len(m.step_times)} steps, build {m.build_s:.1f} s)")
        if on_measurement is not None:
            on_measurement(m)
        return m

    if cuda:
        _match_job_allocator(say)
    t_start = time.time()
    if job_probe:  # the probe job's process imports while the probes run, as a sweep's jobs do
        from plora.engine import spare

        spare.prime([0] if str(device).startswith("cuda") else spare.first_gpus(str(device)))
    say(f"profiling {shape.name} at seq {seq_len}, {dtype}, on {device_name} ({key['backend']} kernels)")
    fit_set = [measure(p) for p in calibration_probes()]
    rows = _probe_rows(fit_set, gpu_memory_bytes * load_factor, seq_len, max_rows)
    say(f"  largest probes: {rows} rows of {seq_len} tokens")
    if cuda and max_rows is not None and rows >= max_rows and far_from_limit(fit_set, rows, gpu_memory_bytes * load_factor):
        # The sweep's largest pack (``max_rows``) stays far below the memory limit: packs near
        # it will never be planned, so measuring or validating them only costs time.
        limit = fill = False
        say("  the sweep's largest pack is far from the memory limit: no near-limit probes")
    fit_set += [measure(p) for p in fit_probes(rows, kmax)]
    meta = {"device": device_name, "backend": key["backend"], "dtype": dtype, "seq_len": int(seq_len),
            "warmup": warmup, "iters": iters, "probe_rows": rows,
            "sized_by": "rows" if max_rows is not None and rows >= max_rows else "memory",
            **({"cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")} if cuda else {})}
    cm = fit_cost_model(fit_set, shape, seq_len, gpu_memory_bytes, targets=names, tp_degrees=tp_degrees, meta=meta)
    if fill:  # the largest packs, placed by the memory model just fitted; then fit again
        fit_set += [measure(p) for p in fill_probes(cm, load_factor, kmax, max_rows=max_rows)]
        cm = fit_cost_model(fit_set, shape, seq_len, gpu_memory_bytes, targets=names, tp_degrees=tp_degrees,
                            meta=meta)
    job_runs: list[dict[str, Any]] = []
    if job_probe:
        t_job = time.time()
        run = run_job_probe(model_dir, seq_len=seq_len, dtype=dtype, device=device, targets=names, family=family,
                            dropout=dropout, random_init=random_init,
                            activation_checkpointing=activation_checkpointing, cuda_graphs=cuda_graphs,
                            quantize=shape.quantize)
        from plora.engine import spare

        spare.discard()  # one the probe did not take (whoever runs jobs next starts their own)
        if run is None:
            say("  job probe did not finish: job start, load, eval and save are not in the model")
        else:
            job_runs.append(run)
            cm = cm.with_overheads(fit_overheads(job_runs))
            o = cm.overheads
            say(f"  job probe: start {o.start_s:.1f} s, load {o.load_s:.1f} s, set-up {o.setup_s:.1f} s, "
                f"first step +{o.warm_s:.2f} s, capture {o.capture_s:.2f} s, save {o.save_s:.2f} s/adapter "
                f"({time.time() - t_job:.0f} s)")
    profiling_s = time.time() - t_start
    cm = cm.with_meta(profiling_s=profiling_s)

    t_val = time.time()
    checks = holdout_probes(rows, kmax, n=holdout)
    if limit:  # interleaved, so that a deadline leaves some of each kind
        for i, p in enumerate(limit_probes(cm, load_factor, kmax)):
            checks.insert(min(len(checks), 2 + 3 * i), p)
    held: list[Measurement] = []
    for p in checks:
        if deadline is not None and time.time() > deadline and len(held) >= min_checks:
            say(f"  skipped {p.name}: out of time")
            continue
        held.append(measure(p))
    prof = Profile(cm, fit_set, held, key, load_factor,
                   timings={"profiling_s": profiling_s, "validation_s": time.time() - t_val}, job_runs=job_runs)
    prof.cost_model = prof.cost_model.with_meta(holdout=prof.summary())
    return prof


def profile_sweep(spec, run_dir: str | Path | None, *, force: bool = False, log: Log | None = None,
                  cached_only: bool = False, **options) -> CostModel | None:
    """The cost model of a sweep's model on this machine: from the cache when there is one
    (no probing), else measured; written to ``<run_dir>/profile.json`` (when a run_dir is
    given). With ``cached_only`` it never probes and returns None on a cache miss.

    ``options`` go to `profile_model` (iters, warmup, kmax, max_rows, ...).
    """
    say = log or (lambda _msg: None)
    model_dir = spec.model.resolved_path()
    dtype = spec.model.dtype
    shape = shape_from_model(model_dir, spec.model.family, dtype, spec.model.quantize)
    device, device_name, total = _device_info(spec.hardware.device)
    gpu_memory = total if total is not None else spec.hardware.gpu_memory_gb * 2**30
    targets = list(spec.lora.resolved_targets())
    degrees = shape.tp_degrees(max_tp=spec.hardware.gpus)
    seq = spec.model.max_seq_len
    ac = spec.training.checkpointing
    path = _sweep_cache_path(spec, shape, device, device_name)
    load_factor = spec.planner.memory_load_factor
    prof = None
    if path.is_file() and not force:
        try:
            prof = Profile.load(path)
        except ProfileError as e:
            say(f"ignoring the cached profile: {e}")
    if prof is not None and device.startswith("cuda") and prof.cost_model.meta.get("sized_by") == "rows" \
            and int(prof.cost_model.meta.get("probe_rows", 0)) < sweep_pack_rows(spec):
        say(f"the cached profile {path} measured packs of at most {prof.cost_model.meta.get('probe_rows')} rows; "
            "this sweep's are larger: profiling again")
        prof = None
    if prof is not None:
        say(f"reusing the cached profile {path}")
        cm = prof.cost_model
        if set(cm.degrees) != set(degrees) or cm.gpu_memory_bytes != gpu_memory:
            keep = cm.meta.only(("device", "backend", "dtype", "seq_len", "warmup", "iters", "probe_rows",
                                 "profiling_s", "holdout", "sized_by"))
            overhead, terms = cm.job_overhead_s, cm.overheads
            prof.cost_model = fit_cost_model(prof.measurements, shape, seq, gpu_memory, targets=targets,
                                             tp_degrees=degrees, meta=keep)
            # the job overhead learned from sweeps (remember_job_overhead)
            prof.cost_model = replace(prof.cost_model, job_overhead_s=overhead)
            if terms is not None:
                prof.cost_model = prof.cost_model.with_overheads(terms)
        prof.reused, prof.load_factor = True, load_factor
    elif cached_only:
        return None
    else:
        threads = 1 if device == "cpu" else None
        if threads:
            import torch

            torch.set_num_threads(1)  # tiny matmuls on several threads are far slower on a small CPU
            for k, v in CPU_DEFAULTS.items():
                options.setdefault(k, v)
        else:  # probes sized to the sweep's packs (a quarter more), not to the whole device
            options.setdefault("max_rows", -(-5 * sweep_pack_rows(spec) // 4))
        options.setdefault("job_probe", True)
        options.setdefault("random_init", bool(spec.model.random_init))
        prof = profile_model(model_dir, shape, seq_len=seq, dtype=dtype, device=device, targets=targets,
                             family=spec.model.family, dropout=spec.lora.dropout, gpu_memory_bytes=gpu_memory,
                             tp_degrees=degrees, load_factor=load_factor, num_threads=threads, log=say,
                             activation_checkpointing=ac, cuda_graphs=spec.training.cuda_graphs, **options)
        prof.cache_path = str(path)
        prof.save(path)
    prof.cache_path = str(path)
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        prof.save(Path(run_dir) / "profile.json")
    return prof.cost_model


#: the quick calibration's probes: warm-up steps (the first compiles kernels and captures),
#: then timed steps for at most this long each
QUICK_WARMUP = 2
QUICK_ITERS = 4
QUICK_PROBE_S = 1.0
#: its sweep-like probe is cut until the prior (no margin) puts it at this share of the usable
#: memory: the prior has been up to 2.7x short, and a probe that runs out of memory says little
QUICK_PROBE_SHARE = 0.35


def quick_probe(prior: CostModel, loads: Sequence[AdapterLoad], load_factor: float, d: int = 1) -> Probe:
    """A pack like the sweep's own (``loads``: the adapters of its largest planned job), cut
    (fewer adapters, then fewer rows each) until the prior puts it within `QUICK_PROBE_SHARE` of
    the usable memory."""
    pack = sorted(loads, key=lambda a: (-a.batch_size, -a.rank))[:16] or [AdapterLoad("q", 16, 1, 1)]
    budget = QUICK_PROBE_SHARE * load_factor * prior.gpu_memory_bytes
    bare = replace(prior, eval_load=None)

    def fits(p: list[AdapterLoad]) -> bool:
        return bare.memory(p, d) <= budget

    while len(pack) > 1 and not fits(pack):
        pack = pack[: max(1, len(pack) // 2)]
    while not fits(pack) and max(a.batch_size for a in pack) > 1:
        pack = [replace(a, batch_size=max(1, a.batch_size // 2)) for a in pack]
    return Probe("cal-sweep", tuple(a.rank for a in pack), tuple(a.batch_size for a in pack))


def quick_calibration(spec, prior: CostModel, loads: Sequence[AdapterLoad], *, log: Log | None = None) -> Calibration:
    """Two short packs of the sweep's model measured on this GPU, in a few seconds: a small
    one (mostly per-step cost) and one like the sweep's largest (``loads``), for
    `plora.cost.profiling.calibrate` to correct the prior with. Each probe's kernels compile into
    Triton's cache, where the sweep's jobs find them."""
    say = log or (lambda _msg: None)
    model_dir = spec.model.resolved_path()
    device, device_name, _ = _device_info(spec.hardware.device)
    targets = list(spec.lora.resolved_targets())
    seq = int(spec.model.max_seq_len)
    probes = [Probe("cal-small", (16,), (1,)), quick_probe(prior, loads, spec.planner.memory_load_factor)]
    # what importing and running a job here sets in this process's environment (the allocator,
    # torch's and torchtune's own variables) must not reach the jobs it starts: the job process
    # started ahead of the first job has the environment from before (`plora.engine.spare`)
    saved = dict(os.environ)
    try:
        return _measure_quickly(spec, probes, model_dir, device, device_name, targets, seq, say)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _measure_quickly(spec, probes: list[Probe], model_dir, device: str, device_name: str, targets: list[str],
                     seq: int, say: Log) -> Calibration:
    if device.startswith("cuda"):
        _match_job_allocator(say)
    cal = Calibration()
    for i, p in enumerate(probes, 1):
        t0 = time.time()
        say(f"calibrating on {device_name}: pack {i}/{len(probes)} ({p.label()})…")
        try:
            m = run_probe(model_dir, p, seq_len=seq, dtype=spec.model.dtype, device=device, targets=targets,
                          family=spec.model.family, dropout=spec.lora.dropout, warmup=QUICK_WARMUP,
                          iters=QUICK_ITERS, max_probe_s=QUICK_PROBE_S, min_timed_s=0.0,
                          activation_checkpointing=spec.training.checkpointing,
                          cuda_graphs=spec.training.cuda_graphs, quantize=spec.model.quantize)
        except Exception as e:  # noqa: BLE001 - a calibration that fails leaves the prior's safe memory
            say(f"  pack {i} failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                "planning on the analytic model")
            continue
        if m.oom or not m.step_times:
            say(f"  pack {i} {'ran out of memory' if m.oom else 'took no timed step'}")
            continue
        cal.add([PackTiming(p.ranks, p.batch_sizes, float(seq), m.step_time, len(m.step_times))],
                [PackFootprint(p.ranks, p.batch_sizes, float(seq), m.peak_bytes)])
        say(f"  pack {i}: {m.step_time * 1e3:.1f} ms a step, {m.peak_bytes / 2**30:.1f} GiB ({time.time() - t0:.1f} s)")
    return cal
