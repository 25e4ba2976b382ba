"""What a sweep hands back: metrics, evaluation, the results table, export and the report.

* `plora.results.metrics` -- the eval metrics (built-in and user ones) and which way is better.
* `plora.results.evaluate` -- scoring adapters (and the base model) on the eval rows, packed.
* `plora.results.collect` -- the results table (results.parquet), ranked by the objective.
* `plora.results.export` -- adapters exported as folders Hugging Face tools load as they are.
* `plora.results.adapter_spans` -- each adapter's own span in the jobs that ran it.
* `plora.results.run_data` -- a run directory read for the report (`load_run`).
* `plora.results.plots` -- the report's sections: tables and plots of a run.
* `plora.results.notebook` -- ``plora report``: the report notebook run headless.
* `plora.results.report` -- what ``notebooks/report.ipynb`` calls, one name each.

Importing this package imports none of its modules: each is imported by name.
"""
