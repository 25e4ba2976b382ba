"""The profiler's error. Every part raises it where profiling cannot go on (too few probes
ran, the base model does not fit, a profile that does not read), so that its callers (the
sweep, the CLI) catch one type whichever part failed."""

from __future__ import annotations


class ProfileError(RuntimeError):
    """Profiling cannot produce a model (too few probes ran, the base model does not fit)."""
