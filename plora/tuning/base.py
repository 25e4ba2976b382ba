"""What every module of the tuning package shares: its error and a quiet Optuna."""

from __future__ import annotations

import contextlib
import warnings

import optuna


class TuneError(ValueError):
    """A tuning request that cannot run (unknown sampler, bad trial count...); one line."""


@contextlib.contextmanager
def _quiet_optuna():
    """Optuna logs every study creation and trial at INFO; plora renders its own progress."""
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(level)
