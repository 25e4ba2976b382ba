"""One packed job as the engine and the job process both see it: the contract between them.

* `plora.job.config` -- `JobConfig`, what ``job.yaml`` holds (its defaults: `plora.spec.defaults`).
* `plora.job.outputs` -- what a job leaves (summary.json, progress.json, error.json, oom.json)
  and its exit codes: typed, written by the recipe, read by the engine and the report.
* `plora.job.control` -- ``control.json`` (requests in) and ``joins.jsonl`` (joins taken).
* `plora.job.phases` -- where a job's wall time goes besides its training steps.
* `plora.job.step_settings` -- how a job's steps run (what the recipe and the profiler share).
* `plora.job.from_spec` -- a job config from a sweep's spec (what the sweep and tunes write).
* `plora.job.synthetic` -- a job of random rows on a random-init model (probes, benchmarks).
* `plora.job.warm_order` -- what a sweep orders of its kernel-warming process, and its answer.

The engine writes and reads these; the recipe (`plora.train`) reads and writes them; neither
imports the other. Importing this package imports none of its modules.
"""
