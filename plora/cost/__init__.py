"""What a packed job costs: memory and step time of a pack, and the profile they come from.

* `plora.cost.model` -- `CostModel` (frozen, with a typed `CostMeta`): ``memory(job, d)`` and
  ``step_time(job, d)``.
* `plora.cost.job` -- a whole job's terms beyond its steps (start, load, evals, saves).
* `plora.cost.sweep_rows` -- a sweep's own rows and eval, measured to price its steps.
* `plora.cost.cpu` -- the CPU prior: what a job costs on CPU cores before anything is measured.
* `plora.cost.sweep_model` -- which cost model a sweep plans with (a profile, a calibration,
  the analytic prior), priced on its rows, and corrected by its finished jobs.
* `plora.cost.profiling` -- probes, the fit, calibration and the profile cache.

These sit below the planner and the recipe: nothing here imports `plora.train`, except the
profiler's in-process measurement (`tests/test_imports.py` checks it). Importing this
package imports none of its modules.
"""
