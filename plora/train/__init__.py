"""Training one packed job: the torchtune-shaped recipe and the packed LoRA layers.

* `plora.train.packed_lora` -- the recipe (``tune run plora/train/packed_lora.py --config
  job.yaml``): set-up, train, clean-up over the components beside it.
* `plora.train.checkpoint`, `plora.train.adapter_writer` -- mid-job checkpoints, adapters saved.
* `plora.train.epochs`, `plora.train.step_graph`, `plora.train.heap` -- how steps run.
* `plora.train.preload`, `plora.train.spare` -- a job process started before its job.
* `plora.train.hooks` -- named points where tests look into a running job.
* `plora.train.packed` -- the packed LoRA layers (bank, layer, TP, rows, PEFT format).

Nothing below (spec, data, models, cost, planner) imports this package. Importing it
imports none of its modules.
"""
