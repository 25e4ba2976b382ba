"""Record the Python modules a sweep's processes compiled, in the order they compiled them, for
`plora.bytecode_ahead` to compile ahead on a machine's first sweep.

The input is a folder laid out as ``PYTHONPYCACHEPREFIX`` lays it out: plora's bytecode cache
after a first sweep (``$PLORA_CACHE_DIR/bytecode``, where the packages carry no bytecode), or
the prefix a sweep was run under with ``PYTHONPYCACHEPREFIX`` set (every module it imported,
whatever the packages carry). Each compiled file names its source; the source is written
relative to the import path entry it was found under (``torch/nn/modules/linear.py``), so
the list holds on any machine where the same packages are installed elsewhere. Files are
ordered by when they were written, which is when their module was first imported.

    python scripts/record_bytecode_modules.py CACHE_DIR [CACHE_DIR ...] --into plora/assets/bytecode_modules.txt

The runs are merged with what ``--into`` holds: each module takes the soonest place it had in any
of them, as a share of that run's length.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path


def compiled_sources(prefix: Path) -> list[tuple[int, str]]:
    """(when written, source path) of every compiled file under ``prefix``."""
    tag = sys.implementation.cache_tag
    out = []
    for pyc in prefix.rglob(f"*.{tag}*.pyc"):
        name = pyc.name.split(f".{tag}")[0] + ".py"
        source = os.sep + str(pyc.parent.relative_to(prefix) / name)
        out.append((pyc.stat().st_mtime_ns, source))
    return sorted(out)


def relative_to_path(source: str, entries: list[str]) -> str | None:
    """``source`` relative to the longest import path entry holding it; None where none does."""
    best = None
    for entry in entries:
        root = os.path.abspath(entry or ".").rstrip(os.sep) + os.sep
        if source.startswith(root) and (best is None or len(root) > len(best)):
            best = root
    return None if best is None else source[len(best):]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefixes", nargs="+", type=Path)
    ap.add_argument("--into", type=Path, required=True)
    args = ap.parse_args()
    known = args.into.read_text().splitlines() if args.into.is_file() else []
    header = [line for line in known if line.startswith("#")]
    # the standard library comes compiled with Python: nothing of it to compile ahead
    stdlib = {os.path.abspath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
    entries = [p for p in sys.path if p and os.path.abspath(p) not in stdlib]
    runs = [[line for line in known if line and not line.startswith("#")]]
    for prefix in args.prefixes:
        names = (relative_to_path(source, entries) for _, source in compiled_sources(prefix))
        kept = (n for n in names if n and n.endswith(".py") and not n.startswith("__editable__"))  # an install's finder
        runs.append(list(dict.fromkeys(kept)))
    # each module where it came soonest in any run, as a share of that run: a module one kind of
    # sweep imports first (a GGUF reader) is compiled early however long the other runs' lists are
    rank: dict[str, float] = {}
    for run in runs:
        for i, name in enumerate(run):
            rank[name] = min(rank.get(name, 1.0), i / len(run))
    seen = sorted(rank, key=lambda n: rank[n])
    added = len(rank) - len(runs[0])
    args.into.parent.mkdir(parents=True, exist_ok=True)
    args.into.write_text("\n".join([*header, *seen]) + "\n")
    print(f"{added} modules added, {len(seen)} in {args.into}")


if __name__ == "__main__":
    main()
