"""Joins sent to a job process at given steps (`plora.train.hooks`), as a sender would.

A job imports this module when ``PLORA_TEST_HOOKS`` names it. ``PLORA_TEST_JOIN`` is a JSON
list of ``{"after_step": s, "adapters": [<JobAdapter entries>]}``: after job step s the
job's control.json asks for those adapters (`plora.job.control.request_join`), so they join
at step s + 1. On a relaunched attempt the request is made again, and ignored by the job
(it knows them from its joins.jsonl).
"""

from __future__ import annotations

import json
import os

from plora.train import hooks
from plora.job.config import JobAdapter
from plora.job.control import request_join

ENV = "PLORA_TEST_JOIN"


def send(recipe, step: int) -> None:
    for item in json.loads(os.environ.get(ENV, "[]")):
        if item["after_step"] == step:
            request_join(recipe.job_dir, [JobAdapter(**a) for a in item["adapters"]])


hooks.register("after_step", send)
