"""The space file: what a user asks for (`SweepSpec`), checked, and expanded into adapters.

* `plora.spec.schema` -- `SweepSpec`: the file as a whole, checks across sections, expansion.
* `plora.spec.model` -- the ``model`` section: the model's folder and its LoRA targets resolved.
* `plora.spec.space` -- the ``space`` section: values, ranges, relative alphas; grid and random draws.
* `plora.spec.sections` -- every other section (data, lora, training, eval, hardware, planner...).
* `plora.spec.adapter` -- `AdapterConfig`, one per trial; the LoRA scale; integer and rank rules.
* `plora.spec.defaults` -- the defaults a space file and a job share (`plora.job.config` reads them).
* `plora.spec.loading` -- reading a YAML file (and ``key=value`` overrides) into a `SweepSpec`.
* `plora.spec.overrides` -- ``key=value`` overrides given on the command line.
* `plora.spec.base` -- the one-line `SpecError` and the strict base of every section.

Importing this package imports none of its modules: each is imported by name.
"""
