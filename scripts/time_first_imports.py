"""What a sweep's processes pay for their imports on first use, where Python may not write
bytecode beside the sources (``PYTHONDONTWRITEBYTECODE``) and the packages carry none.

Each variant runs fresh interpreters, importing what a spare job process imports before it
says ready (``spare``) or what the sweep's own process imports before its data check
(``main``):

* ``source``: plora's bytecode cache off (`plora.bytecode_cache`): everything compiled, nothing
  written, as before it existed;
* ``cold``: the cache on and empty: compiled and written to it;
* ``cold-deferred``: the same, its writes handed to a thread of their own;
* ``warm``: the cache the cold run left;
* ``x3`` variants: a spare, the main process and another spare at once, on one cache, as a first
  sweep starts them;
* ``ahead`` variants: those three beside the pool that compiles the modules a sweep imports
  (`plora.bytecode_ahead`, its shipped list), with 12 and with 6 workers.

Then the cold run's files written again by one process into an empty folder (the filesystem's
share), and the cold spare under cProfile (its top entries by own time).

    python scripts/time_first_imports.py --out DIR        # on the GPU machine

Writes DIR/first_imports.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPARE = """
import torch
from plora.models.torchtune_imports import import_job_modules, lean_job_imports
lean_job_imports()
from torchtune import config
import plora.engine.spare, plora.train.packed_lora, plora.train.preload
import_job_modules()
print('READY', round(time.time() - t0, 3), flush=True)
if torch.cuda.is_available():
    from plora.train import preload
    from plora.train.gpu_warm_up import warm_up
    from plora.spec.model import ModelConfig
    spec = ModelConfig(path="shape:qwen2.5-0.5b", max_seq_len=512, dtype="bfloat16")
    key = preload.ModelKey.of(spec.resolved_path(), spec.family, 512, "bfloat16", "cuda:0", spec.random_init)
    preload.hold(key)
    print('LOADED', round(time.time() - t0, 3), flush=True)
    warm_up(preload.held_model(key), key.device)
    print('WARMED', round(time.time() - t0, 3), flush=True)
"""
MAIN = """
import torch
import plora.cli, plora.sweep, plora.data.dataset, plora.models.check
from transformers import AutoTokenizer
"""

DEFER = """
import atexit, queue, threading
from importlib import _bootstrap_external as be
_q = queue.SimpleQueue()
_set = be.SourceFileLoader.set_data
def _writer():
    while True:
        item = _q.get()
        if item is None:
            return
        try:
            _set(*item[0], **item[1])
        except Exception:
            pass
_t = threading.Thread(target=_writer, daemon=True); _t.start()
def set_data(self, path, data, *, _mode=0o666):
    _q.put(((self, path, data), {"_mode": _mode}))
be.SourceFileLoader.set_data = set_data
def _flush():
    t = time.time(); _q.put(None); _t.join(); print("FLUSH", round(time.time() - t, 3), flush=True)
atexit.register(_flush)
"""


def child_code(kind: str, *, defer: bool, profile: bool) -> str:
    body = SPARE if kind == "spare" else MAIN
    head = "import time; t0 = time.time()\nfrom plora.bytecode_cache import use_here; use_here()\n"
    if defer:
        head += DEFER
    if profile:
        body = ("import cProfile, pstats, io\n_p = cProfile.Profile(); _p.enable()\n" + body
                + "_p.disable(); _s = io.StringIO()\n"
                  "pstats.Stats(_p, stream=_s).sort_stats('tottime').print_stats(25)\n"
                  "print('PROFILE', json.dumps(_s.getvalue()))\n")
    tail = "" if kind == "spare" else "print('READY', round(time.time() - t0, 3), flush=True)\n"
    return head + "import json\n" + body + tail


def environment(cache: Path, on: bool = True) -> dict[str, str]:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PLORA_CACHE_DIR": str(cache),
            "PLORA_BYTECODE_CACHE": "1" if on else "0"}


def start(kind: str, cache: Path, *, on: bool = True, defer: bool = False, profile: bool = False,
          importtime: bool = False) -> subprocess.Popen:
    env = environment(cache, on)
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.Popen([sys.executable, *flags, "-c", child_code(kind, defer=defer, profile=profile)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, born: float) -> dict:
    out, err = proc.communicate()
    row: dict = {"exit_s": round(time.time() - born, 3)}
    for line in out.splitlines():
        if line.split(" ")[0] in ("READY", "LOADED", "WARMED"):
            row[line.split()[0].lower() + "_s"] = float(line.split()[1])
        elif line.startswith("FLUSH "):
            row["flush_s"] = float(line.split()[1])
        elif line.startswith("PROFILE "):
            row["profile"] = json.loads(line.removeprefix("PROFILE "))
    if proc.returncode:
        row["error"] = err[-1500:]
    if "import time:" in err:
        row["importtime"] = err
    return row


def run(kinds: list[str], cache: Path, *, ahead: int = 0, **kw) -> list[dict]:
    """``kinds`` started together on ``cache``; with ``ahead``, beside a pool of that many
    workers (`plora.bytecode_ahead.lead`, as the plora program starts it)."""
    born = time.time()
    code = f"from plora.bytecode_ahead import LIST, lead; lead({str(cache / 'bytecode')!r}, str(LIST), {ahead})"
    pool = [subprocess.Popen([sys.executable, "-c", code], env=environment(cache))] if ahead else []
    procs = [start(k, cache, **kw) for k in kinds]
    for p in pool:
        p.wait()
    pool_s = round(time.time() - born, 3)
    rows = [{"kind": k, **finish(p, born)} for k, p in zip(kinds, procs)]
    if pool:
        rows[0]["pool_s"] = pool_s
    return rows


def cache_size(cache: Path) -> tuple[int, int]:
    files = [p for p in (cache / "bytecode").rglob("*.pyc")] if (cache / "bytecode").exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def rewrite(cache: Path, into: Path) -> dict:
    """The cold run's bytecode written again, as Python writes it (folders made, a file of its
    own then renamed), by one process: what the filesystem alone costs."""
    src = cache / "bytecode"
    blobs = [(p.relative_to(src), p.read_bytes()) for p in src.rglob("*.pyc")]
    t = time.time()
    for rel, data in blobs:
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{target}.{id(data)}"
        fd = os.open(tmp, os.O_EXCL | os.O_CREAT | os.O_WRONLY, 0o666)
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    return {"files": len(blobs), "seconds": round(time.time() - t, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("first-imports"))
    ap.add_argument("--root", type=Path, default=None, help="where the caches go (default: a temporary folder)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="plora-imports-", dir=args.root))
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def note(variant: str, found: list[dict], cache: Path | None = None) -> None:
        for r in found:
            r["variant"] = variant
            if cache is not None:
                r["cache_files"], r["cache_bytes"] = cache_size(cache)
            it = r.pop("importtime", None)
            if it:
                (args.out / f"importtime-{variant}-{r['kind']}.txt").write_text(it)
            prof = r.pop("profile", None)
            if prof:
                (args.out / f"profile-{variant}-{r['kind']}.txt").write_text(prof)
            rows.append(r)
            print(f"{variant:<16} {r['kind']:<6} ready {r.get('ready_s', '-'):>7} loaded {r.get('loaded_s', '-'):>7}"
                  f" warmed {r.get('warmed_s', '-'):>7} exit {r['exit_s']:>7} pool {r.get('pool_s', '-')}"
                  f"  flush {r.get('flush_s', '-')}  files {r.get('cache_files', '-')}"
                  + (f"  ERROR {r['error'][-300:]}" if "error" in r else ""), flush=True)

    for kind in ("spare", "main"):
        note("source", run([kind], root / f"src-{kind}", on=False))
        cold = root / f"cold-{kind}"
        note("cold", run([kind], cold), cold)
        note("warm", run([kind], cold), cold)
        deferred = root / f"deferred-{kind}"
        note("cold-deferred", run([kind], deferred, defer=True), deferred)
        note("warm-after-deferred", run([kind], deferred), deferred)
    note("source-x3", run(["spare", "main", "spare"], root / "src-x3", on=False))
    note("ahead-x3", run(["spare", "main", "spare"], root / "ahead-x3", ahead=12), root / "ahead-x3")
    note("ahead6-x3", run(["spare", "main", "spare"], root / "ahead6-x3", ahead=6), root / "ahead6-x3")
    note("cold-x3", run(["spare", "main", "spare"], root / "cold-x3"), root / "cold-x3")
    note("cold-deferred-x3", run(["spare", "main", "spare"], root / "def-x3", defer=True), root / "def-x3")
    note("warm-x3", run(["spare", "main", "spare"], root / "cold-x3"), root / "cold-x3")
    for kind in ("main", "spare"):
        note("source-importtime", run([kind], root / "src-it", on=False, importtime=True))
        note("warm-importtime", run([kind], root / "cold-x3", importtime=True))
    note("cold-profiled", run(["spare"], root / "cold-prof", profile=True), root / "cold-prof")
    note("source-profiled", run(["spare"], root / "src-prof", on=False, profile=True))
    again = rewrite(root / "cold-spare", root / "rewrite")
    print(f"rewrite: {again}", flush=True)
    fs = subprocess.run(["df", "-T", str(root)], capture_output=True, text=True).stdout
    print(fs, flush=True)
    (args.out / "first_imports.json").write_text(json.dumps({"rows": rows, "rewrite": again, "df": fs}, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
