"""What a sweep hands back: metrics, evaluation, export and the report.

* `plora.results.metrics` -- the eval metrics (built-in and user ones) and which way is better.
* `plora.results.evaluate` -- scoring adapters (and the base model) on the eval rows.
* `plora.results.export` -- adapters exported as folders Hugging Face tools load as they are.
* `plora.results.adapter_spans` -- each adapter's own span in the jobs that ran it.
* `plora.results.report` -- the report notebook's run-directory reading and plots.

Importing this package imports none of its modules: each is imported by name.
"""
