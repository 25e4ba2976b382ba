"""Data files and row formats: what a row of the user's file means, checked cell by cell.

A data file is read row by row, each row keeping where it came from (``line 7`` of a JSONL
or CSV file, ``row 7`` of a JSON or parquet one), so that any bad cell is reported as one
line naming the file, the line and the column, before anything runs. A row then becomes an
*example* in one of two shapes that tokenization (`plora.data.dataset.tokenize_examples`) knows:

* ``{"input": prompt text, "output": answer text}``: plain rows (an input and an output
  column, the prompt optionally rendered through ``data.prompt_template``) and instruction
  rows (an instruction, an optional input and an output, rendered through a prompt template);
* ``{"messages": [{"role", "content"}, ...]}``: chat rows, rendered later with the model's
  own chat template, loss on the assistant turns. ShareGPT rows (a ``conversations`` list of
  ``{"from", "value"}`` turns, ``from`` one of human/gpt/system, or user/assistant) are chat
  rows too, their turns read as the ``{role, content}`` messages they stand for.

Every example also carries ``where`` (file and line) for later messages.
"""

from __future__ import annotations

import csv
import io
import json
import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plora.data.json_errors import json_error_text

if TYPE_CHECKING:
    from plora.job.config import JobData

__all__ = [
    "FORMATS",
    "DataError",
    "RowFormat",
    "Row",
    "read_rows",
    "rows_to_examples",
    "template_fields",
]

SUPPORTED_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
FORMATS = ("auto", "plain", "instruction", "chat", "sharegpt")
ON_BAD_ROWS = ("error", "drop")
ROLES = ("system", "user", "assistant", "tool")
#: a ShareGPT turn's ``from`` -> the chat role it stands for
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant",
                  "tool": "tool"}

#: The prompt of an instruction row (Alpaca's layout) when no ``data.prompt_template`` is given.
INSTRUCTION_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
INSTRUCTION_TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


class DataError(ValueError):
    """A data file, row or cell that cannot be used; the message is one line naming it."""


class BadRow(DataError):
    """A row without an answer: refused, or dropped and counted with ``data.on_bad_rows: drop``."""


@dataclass(frozen=True)
class Row:
    """One row of a data file: its cells by column, and where it is (``line 7``, ``row 7``)."""

    where: str
    cells: dict[str, Any]


@dataclass(frozen=True)
class RowFormat:
    """How rows are read: the format and its column names (the spec's ``data`` section)."""

    format: str = "auto"
    input_column: str = "input"
    output_column: str = "output"
    instruction_column: str = "instruction"
    messages_column: str = "messages"
    conversations_column: str = "conversations"
    prompt_template: str | None = None
    choices_column: str | None = None

    @classmethod
    def from_config(cls, data: JobData, choices_column: str | None = None) -> "RowFormat":
        """The format of a job config's ``data`` section (`plora.job.config.JobData`)."""
        return cls(
            format=data.format,
            input_column=data.input_column,
            output_column=data.output_column,
            instruction_column=data.instruction_column,
            messages_column=data.messages_column,
            conversations_column=data.conversations_column,
            prompt_template=data.prompt_template,
            choices_column=choices_column,
        )

    def resolve(self, columns: Sequence[str], where: str) -> str:
        """The format of a file with these columns (``auto``: chat, else ShareGPT, else
        instruction, else plain)."""
        fmt = self.format
        if fmt == "auto":
            if self.messages_column in columns:
                fmt = "chat"
            elif self.conversations_column in columns:
                fmt = "sharegpt"
            elif self.instruction_column in columns:
                fmt = "instruction"
            else:
                fmt = "plain"
        if fmt in ("chat", "sharegpt"):
            needed = [self.conversation_column(fmt)]
        else:
            needed = [self.instruction_column] if fmt == "instruction" else []
            if self.prompt_template:
                needed += [self._column_of(f) for f in template_fields(self.prompt_template)
                           if not (f == "input" and fmt == "instruction")]
            elif fmt == "plain":
                needed.append(self.input_column)
            needed.append(self.output_column)
        if self.choices_column:
            needed.append(self.choices_column)
        for column in dict.fromkeys(needed):
            if column not in columns:
                shown = ", ".join(map(str, columns)) or "none"
                raise DataError(f"{where}: no column {column!r} for the {fmt} format (columns: {shown})")
        return fmt

    def conversation_column(self, fmt: str) -> str:
        """The column of a chat (``messages_column``) or ShareGPT (``conversations_column``) row."""
        return self.conversations_column if fmt == "sharegpt" else self.messages_column

    def _column_of(self, field: str) -> str:
        return {"input": self.input_column, "instruction": self.instruction_column,
                "output": self.output_column}.get(field, field)


def template_fields(template: str) -> list[str]:
    """The ``{names}`` a prompt template fills in (``str.format`` syntax); raises ValueError."""
    names = []
    for _, name, spec, conv in string.Formatter().parse(template):
        if name is None:
            continue
        if not name or not name.isidentifier():
            raise ValueError(f"{{{name}}} is not a column name (write literal braces as {{{{ and }}}})")
        if spec or conv:
            raise ValueError(f"{{{name}}}: format specs and conversions are not supported")
        names.append(name)
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------- files


def read_rows(path: str | Path, label: str = "data", split: str | None = None) -> tuple[list[Row], list[str]]:
    """Every row of a JSON/JSONL/CSV/parquet file, or of a folder written by `datasets`'
    ``save_to_disk`` (its ``split``, for a folder of splits), and the columns.

    JSONL is parsed line by line so that a broken line is named; blank lines are skipped.
    Raises `DataError` naming ``label`` and the file.
    """
    path = Path(path)
    where = f"{label}: {path}"
    if path.is_dir():
        return _folder_rows(path, split, where)
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataError(f"{where}: unsupported file type {suffix or '(none)'!r} (use {', '.join(SUPPORTED_SUFFIXES)})")
    if not path.is_file():
        raise DataError(f"{where}: file not found")
    try:
        if suffix == ".parquet":
            rows = _parquet_rows(path, where)
        else:
            text = path.read_text(encoding="utf-8")
            if not text.strip():
                raise DataError(f"{where}: the file is empty (it has no rows)")
            rows = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows}[suffix](text, where)
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{where}: cannot read: {e.strerror or e}") from None
    if not rows:
        raise DataError(f"{where}: has no rows")
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row.cells))
    return rows, list(columns)


def _folder_rows(path: Path, split: str | None, where: str) -> tuple[list[Row], list[str]]:
    from plora.data.folders import DatasetFolderError, dataset_rows

    if split is not None:
        where = f"{where} (split {split})"
    try:
        records, columns = dataset_rows(path, split, where)
    except DatasetFolderError as e:
        raise DataError(str(e)) from None
    if not records:
        raise DataError(f"{where}: has no rows")
    return [Row(f"row {n}", cells) for n, cells in enumerate(records, start=1)], columns


def _jsonl_rows(text: str, where: str) -> list[Row]:
    rows = []
    # "\n" only: str.splitlines would also split at U+2028 and others, which JSON strings may hold
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where} line {n}: not valid JSON ({json_error_text(e, line=False)})") from None
        if not isinstance(value, dict):
            raise DataError(f"{where} line {n}: expected a JSON object, got {_kind(value)}")
        rows.append(Row(f"line {n}", value))
    return rows


def _json_rows(text: str, where: str) -> list[Row]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where} line {e.lineno}: not valid JSON ({json_error_text(e, line=False)})") from None
    if isinstance(value, dict) and "data" in value:
        value = value["data"]
    if not isinstance(value, list):
        raise DataError(f"{where}: expected a list of objects (or {{\"data\": [...]}}), got {_kind(value)}")
    rows = []
    for n, item in enumerate(value, start=1):
        if not isinstance(item, dict):
            raise DataError(f"{where} row {n}: expected a JSON object, got {_kind(item)}")
        rows.append(Row(f"row {n}", item))
    return rows


def _csv_rows(text: str, where: str) -> list[Row]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
    except (StopIteration, csv.Error) as e:
        raise DataError(f"{where}: no header line ({e})") from None
    rows = []
    start = reader.line_num + 1
    try:
        for record in reader:
            if record:
                if len(record) > len(header):
                    raise DataError(f"{where} line {start}: {len(record)} cells but {len(header)} columns in the header")
                cells = dict(zip(header, record))
                rows.append(Row(f"line {start}", cells))
            start = reader.line_num + 1
    except csv.Error as e:
        raise DataError(f"{where} line {start}: not valid CSV ({e})") from None
    return rows


def _parquet_rows(path: Path, where: str) -> list[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a broken file
        raise DataError(f"{where}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    rows = [Row(f"row {n}", cells) for n, cells in enumerate(table.to_pylist(), start=1)]
    if not rows and table.column_names:
        return []
    return rows


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- cells


def _text(row: Row, column: str, where: str, *, answer: bool = False, optional: bool = False) -> str | None:
    """A text cell: numbers are text (``42``); null, NaN, lists and objects are not."""
    at = f"{where} {row.where}, column {column!r}"
    value = row.cells.get(column)
    if column not in row.cells or value is None or (isinstance(value, float) and math.isnan(value)):
        if optional:
            return None
        state = "is missing" if column not in row.cells else ("is NaN" if value is not None else "is null")
        if answer:
            raise BadRow(f"{at}: {state}: the row has no answer")
        raise DataError(f"{at}: {state}")
    if isinstance(value, (dict, list, tuple)):
        raise DataError(f"{at}: expected text, got {_kind(value)}")
    if isinstance(value, bool):
        value = str(value).lower()
    text = str(value)
    if answer and not text.strip():
        raise BadRow(f"{at}: is empty: the row has no answer")
    return text


def _fill(template: str, row: Row, fmt: RowFormat, resolved: str, where: str) -> str:
    values = {}
    for name in template_fields(template):
        column = fmt._column_of(name)
        optional = name == "input" and resolved == "instruction"
        values[name] = _text(row, column, where, optional=optional) or ""
    return template.format_map(values)


def _message(m: Any, i: int, at: str) -> tuple[Any, Any]:
    """A message's role and content: a ``{role, content}`` message, or a ShareGPT
    ``{from, value}`` turn read as the message it stands for."""
    if isinstance(m, dict) and "role" in m and "content" in m:
        role = m["role"]
        if role not in ROLES:
            raise DataError(f"{at}: message {i} has role {role!r} (expected one of {', '.join(ROLES)})")
        return role, m["content"]
    if isinstance(m, dict) and "from" in m and "value" in m:
        sender = m["from"]
        if not isinstance(sender, str) or sender not in SHAREGPT_ROLES:
            raise DataError(f"{at}: message {i} is from {sender!r} (expected one of {', '.join(SHAREGPT_ROLES)})")
        return SHAREGPT_ROLES[sender], m["value"]
    raise DataError(f"{at}: message {i} is not a {{role, content}} or {{from, value}} object")


def _messages(row: Row, column: str, where: str) -> list[dict[str, str]]:
    at = f"{where} {row.where}, column {column!r}"
    value = row.cells.get(column)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise BadRow(f"{at}: is {'missing' if column not in row.cells else 'null'}: the row has no conversation")
    if isinstance(value, str):  # a CSV cell, or a JSON string holding the list
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{at}: expected a list of {{role, content}} messages, got text") from None
    if not isinstance(value, (list, tuple)):
        raise DataError(f"{at}: expected a list of {{role, content}} messages, got {_kind(value)}")
    out = []
    for i, m in enumerate(value):
        role, content = _message(m, i, at)
        if content is None or isinstance(content, (dict, list, tuple)) or (isinstance(content, float) and math.isnan(content)):
            if role == "assistant":
                raise BadRow(f"{at}: message {i} (assistant) has {_kind(content)} content: no answer")
            raise DataError(f"{at}: message {i} has {_kind(content)} content (expected text)")
        content = str(content)
        if role == "assistant" and not content.strip():
            raise BadRow(f"{at}: message {i} (assistant) is empty: no answer")
        out.append({"role": str(role), "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow(f"{at}: no assistant message: the row has no answer")
    return out


def _choices(row: Row, column: str, where: str) -> list[str]:
    at = f"{where} {row.where}, column {column!r}"
    value = row.cells.get(column)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{at}: expected a list of answer choices, got text") from None
    if not isinstance(value, (list, tuple)) or len(value) < 2:
        raise DataError(f"{at}: expected a list of at least two answer choices, got {_kind(value)}")
    if any(not isinstance(c, (str, int, float)) or isinstance(c, bool) or not str(c).strip() for c in value):
        raise DataError(f"{at}: every choice must be non-empty text")
    return [str(c) for c in value]


# --------------------------------------------------------------------------- rows -> examples


def row_to_example(row: Row, fmt: RowFormat, resolved: str, where: str) -> dict[str, Any]:
    """One row as an example (see the module's doc); raises `BadRow` or `DataError`."""
    ex: dict[str, Any] = {"where": f"{where} {row.where}"}
    if resolved in ("chat", "sharegpt"):
        ex["messages"] = _messages(row, fmt.conversation_column(resolved), where)
    else:
        output = _text(row, fmt.output_column, where, answer=True)
        if resolved == "instruction":
            has_input = bool((_text(row, fmt.input_column, where, optional=True) or "").strip())
            template = fmt.prompt_template or (INSTRUCTION_TEMPLATE if has_input else INSTRUCTION_TEMPLATE_NO_INPUT)
            prompt = _fill(template, row, fmt, resolved, where)
        elif fmt.prompt_template:
            prompt = _fill(fmt.prompt_template, row, fmt, resolved, where)
        else:
            prompt = _text(row, fmt.input_column, where)
        ex["input"], ex["output"] = prompt, output
    if fmt.choices_column:
        ex["choices"] = _choices(row, fmt.choices_column, where)
    return ex


def rows_to_examples(rows: Sequence[Row], columns: Sequence[str], fmt: RowFormat, where: str,
                     on_bad_rows: str = "error") -> tuple[list[dict[str, Any]], list[str]]:
    """The examples of a file's rows, and the reasons of the rows dropped (``on_bad_rows: drop``).

    A row with no answer raises `BadRow` unless dropped; any other bad cell raises `DataError`.
    """
    resolved = fmt.resolve(columns, where)
    examples, dropped = [], []
    for row in rows:
        try:
            examples.append(row_to_example(row, fmt, resolved, where))
        except BadRow as e:
            if on_bad_rows != "drop":
                raise BadRow(f"{e} (fix it, or set data.on_bad_rows: drop to skip such rows)") from None
            dropped.append(str(e))
    if not examples:
        raise DataError(f"{where}: has no usable rows ({len(dropped)} dropped for having no answer)")
    return examples, dropped
