"""The profiler: fit the cost model of packed jobs from a few real iterations.

The planner trusts `CostModel.memory` and `CostModel.step_time` for every job it forms: a
pack predicted to fit that runs out of memory wastes the sweep, and a wrong step time
gives a wrong schedule. So the coefficients come from measurements on the sweep's own
hardware and model: short *probe* jobs (two warm-up steps, then by default ten timed
steps, as PLoRA does with the first ten iterations of real runs) that vary total rows,
Σ rank·rows, adapter count and, where it can be measured, the TP degree.

Its parts, each with one job:

* `plora.cost.profiling.probes`: the probe jobs (which packs, how large) and what one measured;
* `plora.cost.profiling.measure`: runs a probe's job in this process and measures it;
* `plora.cost.profiling.fit`: the cost model fitted to the measurements;
* `plora.cost.profiling.validate`: predicted against measured, on packs left out of the fit;
* `plora.cost.profiling.record`: `Profile`, what profile.json holds;
* `plora.cost.profiling.cache`: where profiles are kept and what keys them (the model's shape,
  the device, how steps run on it), and what finished sweeps add to them;
* `plora.cost.profiling.profile`: probing a model (`profile_model`), and a sweep's model from
  the cache or measured (`profile_sweep`).

Like the cost model, these sit below the planner, and only `measure` imports the recipe:
a probe is a real packed job run in-process, the rest is arithmetic on what it measured
(`tests/test_imports.py` checks it). What a probe must share with a job (CUDA graphs, the
CUDA allocator settings) is in `plora.job.step_settings`, which the recipe imports as well.
This package imports nothing in ``__init__``, so that loading one part never loads
`measure`.
"""
