"""Where a JSON file stops parsing, said once.

``json``'s messages for a position already end in "at" ("Unterminated string starting at",
"Invalid control character at"), so a message that adds "at column N" to them doubles the
word. Every reader of a user's JSON (data files, model folders) words its error here.
"""

from __future__ import annotations

import json

__all__ = ["json_error_text"]


def json_error_text(e: json.JSONDecodeError, *, line: bool = True) -> str:
    """``e``'s message and position: "Expecting value at line 3 column 5", or with
    ``line=False`` (a caller that names the line itself) "... at column 5"."""
    where = f"line {e.lineno} column {e.colno}" if line else f"column {e.colno}"
    return f"{e.msg.removesuffix(' at')} at {where}"
