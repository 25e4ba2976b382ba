"""One packed job as the engine and the job process both see it: the contract between them.

* `plora.job.config` -- `JobConfig`, what ``job.yaml`` holds (every job default here).
* `plora.job.control` -- ``control.json`` (requests in) and ``joins.jsonl`` (joins taken).
* `plora.job.phases` -- where a job's wall time goes besides its training steps.
* `plora.job.step_settings` -- how a job's steps run (what the recipe and the profiler share).

The engine writes and reads these; the recipe (`plora.train`) reads and writes them; neither
imports the other. Importing this package imports none of its modules.
"""
