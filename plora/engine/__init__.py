"""Running a plan's jobs: on this machine's GPUs (or CPU slots), or on a Ray cluster.

* `plora.engine.runner` -- the engine: jobs started as their GPUs free up, out-of-memory
  splits, retries, drift from the plan measured and the waiting jobs planned again.
* `plora.engine.local`, `plora.engine.ray_backend`, `plora.engine.backends` -- where a job's
  process runs: a local process (`tune run ...`), or a Ray task in a placement group.
* `plora.engine.job_env`, `plora.engine.cpu_share` -- a job process's environment, its GPUs
  and its share of the host's cores.
* `plora.engine.spare` -- job processes started ahead of their jobs (imports paid early).
* `plora.engine.streaming`, `plora.engine.join_choice` -- adapters sent into running jobs,
  and which job each joins.
* `plora.engine.journal` -- every job's and adapter's state (SQLite), so a sweep resumes.
* `plora.engine.preflight` -- checks made before anything runs (run directory, hardware).

What a job reads and leaves is `plora.job`'s; the engine never imports the recipe.
Importing this package imports none of its modules.
"""
