"""torchao's notice that it skipped its C++ extensions, kept off plora's output.

torchao 0.13–0.15, the releases torchtune 0.6.1 works with, were built against older torch
releases; on plora's pinned torch their import logs "Skipping import of cpp extensions due to
incompatible torch version …" (a warning through the ``torchao`` logger). plora never uses
those extensions, so the line, printed by every command and in every job log, tells a user
nothing. It is dropped by a filter on that logger, which must be in place before anything
imports torchao: `plora/__init__.py` installs it, so every process that imports plora first
(the CLI, a job started ahead of its job, a tensor-parallel worker) has it, and a job started
through torchtune's CLI imports plora before torchtune (`plora.engine.local.tune_command`).
Every other torchao message still gets through.
"""

from __future__ import annotations

import logging

__all__ = ["NOTICE_PREFIX", "silence_torchao_version_notice"]

#: The start of the one message dropped.
NOTICE_PREFIX = "Skipping import of cpp extensions due to incompatible torch version"


class _DropVersionNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(NOTICE_PREFIX)


def silence_torchao_version_notice() -> None:
    """Drop torchao's incompatible-version notice from now on (once per process)."""
    logger = logging.getLogger("torchao")
    if not any(isinstance(f, _DropVersionNotice) for f in logger.filters):
        logger.addFilter(_DropVersionNotice())
