"""Data: rows read, checked and tokenized, and each adapter's stream of batches.

* `plora.data.formats`, `plora.data.folders` -- reading rows (plain, instruction, chat,
  ShareGPT; JSON, JSONL, CSV, Parquet, ``save_to_disk`` folders).
* `plora.data.tasks` -- the built-in synthetic tasks (``builtin:<task>``).
* `plora.data.chat_template`, `plora.data.special_tokens` -- a model's own prompt shape.
* `plora.data.dataset` -- tokenizing, and the per-adapter seeded batch streams of a job.
* `plora.data.balanced_stream`, `plora.data.row_layout`, `plora.data.accumulation` -- how
  rows become a packed step's batch (and what a row costs).
* `plora.data.check` -- the data check a sweep makes before anything runs.

Importing this package imports none of its modules: each is imported by name.
"""
