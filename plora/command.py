"""The `plora` program: what the console script runs.

Kept apart from `plora.cli` so that this process keeps its bytecode where Python may not write
it (`plora.bytecode_cache`), and has the modules a sweep imports compiled ahead where none is
kept yet (`plora.bytecode_ahead`), before the command's own imports; and so that a test importing
`plora.cli` leaves its interpreter as it is.
"""

from __future__ import annotations


def main() -> None:
    from plora.bytecode_ahead import set_up

    set_up()
    from plora.cli import app

    app()
