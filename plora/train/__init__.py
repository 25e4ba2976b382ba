"""Training one packed job: the torchtune-shaped recipe, its components, the packed layers.

* `plora.train.packed_lora` -- the recipe (``tune run plora/train/packed_lora.py --config
  job.yaml``): `setup`, `train`, `cleanup`, a shell over the components below.
* `plora.train.row_stream` -- the training rows: each adapter's stream, each step's batch.
* `plora.train.adapter_pack` -- the adapters' weights (bank) and their optimizer.
* `plora.train.packed_step` -- one packed optimizer step, and the host's books of it.
* `plora.train.adapter_run` -- one adapter's progress in the job; its learning-rate schedule.
* `plora.train.evaluator`, `plora.train.epochs` -- evals (final, epoch ends, intermediate,
  base model); each adapter's epochs and its best one.
* `plora.train.joins` -- the job's side of the join protocol (control.json, joins.jsonl).
* `plora.train.checkpoint` -- mid-job checkpoints of the pack (resume after a kill).
* `plora.train.job_files`, `plora.train.adapter_writer` -- the job's logs and records; leaving
  adapters' files written while the pack trains on.
* `plora.train.step_graph`, `plora.train.heap` -- steps replayed from CUDA graphs; the
  garbage collector kept off the loop's objects.
* `plora.train.preload`, `plora.train.spare` -- a job process started before its job.
* `plora.train.hooks` -- named points where tests look into a running job.
* `plora.train.packed` -- the packed LoRA layers (bank, layer, TP, rows, PEFT format).

Nothing below (spec, data, models, cost, planner) imports this package. Importing it
imports none of its modules.
"""
