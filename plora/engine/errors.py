"""The engine's backend error, apart so that every backend can raise it without importing the
module that picks backends."""

from __future__ import annotations


class BackendError(RuntimeError):
    """The backend cannot run this sweep (Ray missing or unreachable, a node that cannot
    write the run directory): one line for the user, nothing trained."""
