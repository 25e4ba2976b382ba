"""A real sweep on a Ray cluster of two nodes on one host, then again with a node killed.

Starts two raylets on this machine, one GPU each (``ray start --head --num-gpus 1`` under
``CUDA_VISIBLE_DEVICES=0``, then ``ray start --address … --num-gpus 1`` under
``CUDA_VISIBLE_DEVICES=1``, each with its own temp dir and ports), and runs ``plora sweep``
with ``hardware.backend: ray`` on it:

1. the whole sweep (>= 16 configurations of a random-init model of a real shape) to the end;
2. the same sweep in a fresh run directory, with the second node's raylet SIGKILLed
   ``--kill-at`` of the first run's makespan in: its job must be re-queued on the head
   node, resume from its checkpoint, and every adapter must finish exactly once.

Prints each run's makespan (first job start to last job end, from the journal), wall time,
adapters finished, jobs lost with the node, and whether every adapter finished once.
``--single`` runs step 1 on a one-node cluster of one GPU instead (no kill).
``--smoke`` does it all on CPU with the shipped tiny model (one CPU slot per node).

    python scripts/bench_ray.py --out /tmp/bench-ray                  # 2 GPUs
    python scripts/bench_ray.py --single --out /tmp/bench-ray-1       # 1 GPU
    python scripts/bench_ray.py --smoke --out /tmp/bench-ray-smoke    # CPU

Writes OUT/ray_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import yaml
from plora.models.families.targets import DEFAULT_TARGETS  # noqa: E402

RAY = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoRaylets:
    """Ray nodes on this host, started with `ray start`, each pinned to one GPU (or CPU slots)."""

    def __init__(self, out: Path, nodes: int, *, gpu: bool, cpus: int):
        self.out, self.gpu, self.cpus = out, gpu, cpus
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.manager_ports: list[int] = []
        self.envs: list[dict] = []
        for i in range(nodes):
            self.start(i)

    def start(self, i: int) -> None:
        manager = free_port()
        temp = Path(f"/tmp/plora-ray-{os.getpid()}-{i}")  # short: unix socket paths are limited
        cmd = RAY + ["start", f"--num-cpus={self.cpus}", f"--num-gpus={1 if self.gpu else 0}",
                     f"--node-manager-port={manager}", f"--temp-dir={temp}", "--disable-usage-stats",
                     f"--min-worker-port={11000 + 4000 * i}", f"--max-worker-port={14999 + 4000 * i}"]
        if i == 0:
            cmd += ["--head", f"--port={self.port}", "--include-dashboard=false", "--node-ip-address=127.0.0.1"]
        else:
            cmd += [f"--address={self.address}", "--node-ip-address=127.0.0.1"]
        env = dict(os.environ)
        if self.gpu:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        self.manager_ports.append(manager)

    def kill_node(self, i: int) -> int:
        """SIGKILL node i's raylet (its workers, and their jobs, die with it); returns its pid."""
        flag = f"--node_manager_port={self.manager_ports[i]}"
        for pid, argv in _processes():
            if argv and argv[0].endswith(b"raylet") and flag.encode() in argv:
                os.kill(pid, signal.SIGKILL)
                return pid
        raise RuntimeError(f"no raylet with {flag}")

    def stop(self) -> None:
        """End this cluster's processes only (`ray stop` would end every Ray on the host):
        those whose command line names one of its temp dirs."""
        mine = f"/tmp/plora-ray-{os.getpid()}-".encode()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [pid for pid, argv in _processes() if any(mine in a for a in argv) and pid != os.getpid()]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if pids and sig == signal.SIGTERM:
                time.sleep(3)


def _processes():
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                yield int(proc.name), (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue


def space(args: argparse.Namespace, name: str, nodes: int, address: str) -> dict:
    grid = {"rank": [8, 16, 32, 64], "alpha": {"relative": [2]}, "learning_rate": [1e-4, 3e-4], "batch_size": [2, 4]}
    if args.smoke:
        grid = {"rank": [2, 4, 8, 16], "alpha": {"relative": [2]}, "learning_rate": [1e-3, 3e-3], "batch_size": [2, 4]}
    return {
        "name": name,
        "model": {"path": args.model or f"shape:{args.shape}", "dtype": "float32" if args.smoke else "bfloat16",
                  "max_seq_len": args.seq},
        "data": {"task": "builtin:shift", "num_train": 4096, "num_eval": 32, "max_eval_samples": 32},
        "lora": {"targets": list(DEFAULT_TARGETS)},
        "space": {"strategy": "grid", **grid},
        "training": {"steps": args.steps, "scheduler": "cosine", "warmup_ratio": 0.03,
                     "checkpoint_every_steps": args.checkpoint_every, "checkpoint_every_minutes": 5},
        "eval": {"metrics": ["loss"], "max_new_tokens": 4},
        "hardware": {"device": "cpu" if args.smoke else "cuda", "backend": "ray", "nodes": nodes,
                     "gpus_per_node": 1, "gpu_memory_gb": args.gpu_memory_gb, "ray": {"address": address}},
        "planner": {"max_adapters_per_job": args.max_adapters},
        "output": {"dir": str(args.out / "runs")},
    }


def journal(run_dir: Path) -> dict:
    con = sqlite3.connect(run_dir / "journal.sqlite")
    try:
        rows = con.execute("SELECT started, ended FROM jobs WHERE started IS NOT NULL").fetchall()
        status = dict(con.execute("SELECT status, COUNT(*) FROM adapters GROUP BY status").fetchall())
        events = con.execute("SELECT kind, subject FROM events").fetchall()
    finally:
        con.close()
    ends = [e for _, e in rows if e is not None]
    span = (max(ends) - min(s for s, _ in rows)) if rows and ends else None
    return {"makespan_s": span, "adapters": status, "lost": sorted({s for k, s in events if k == "lost"}),
            "crash_retries": sorted({s for k, s in events if k == "retry"})}


def _resumed_step(job_dir: Path) -> int | None:
    try:
        return json.loads((job_dir / "progress.json").read_text()).get("resumed_step")
    except (OSError, ValueError):
        return None


def once(run_dir: Path, n: int) -> bool:
    """Every adapter has exactly one final result, trained to its full budget."""
    results = sorted((run_dir / "adapters").glob("*/metrics.json"))
    rows = [json.loads(p.read_text()) for p in results]
    return len(rows) == n and all(r["status"] == "done" and r["steps"] == r["total_steps"] for r in rows)


def sweep(args: argparse.Namespace, name: str, nodes: int, cluster: TwoRaylets,
          kill_after_s: float | None = None) -> dict:
    spec = space(args, name, nodes, cluster.address)
    path = args.out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = args.out / "runs" / name
    log = open(args.out / f"{name}.log", "w")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "plora.cli", "sweep", str(path), "--restart"],
                            stdout=log, stderr=subprocess.STDOUT)
    killed = None
    if kill_after_s is not None:
        # mid-job: past the given time, and once some job has a checkpoint to resume from
        while proc.poll() is None and (time.time() - t0 < kill_after_s
                                       or not any(run_dir.glob("jobs/*/checkpoint/state.rank0.pt"))):
            time.sleep(0.2)
        if proc.poll() is None:
            killed = {"pid": cluster.kill_node(1), "at_s": round(time.time() - t0, 1)}
            print(f"  killed node 1's raylet (pid {killed['pid']}) at {killed['at_s']} s", flush=True)
    rc = proc.wait()
    log.close()
    wall = time.time() - t0
    n = 16
    row = {"run": name, "nodes": nodes, "returncode": rc, "wall_s": round(wall, 1), "killed": killed,
           **journal(run_dir), "every_adapter_once": once(run_dir, n)}
    row["resumed_at_step"] = {job: _resumed_step(run_dir / "jobs" / job) for job in row["lost"]}
    if rc != 0:
        print((args.out / f"{name}.log").read_text()[-3000:], file=sys.stderr)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--model", default=None, help="a model path instead of a random-init shape")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--max-adapters", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--gpu-memory-gb", type=float, default=80)
    p.add_argument("--kill-at", type=float, default=0.4, help="fraction of the first run's makespan")
    p.add_argument("--single", action="store_true", help="one node, one GPU; no kill")
    p.add_argument("--smoke", action="store_true", help="CPU, the shipped tiny model, short steps")
    args = p.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.model = args.model or "builtin:tiny-llama"
        args.steps, args.seq = args.steps or 120, args.seq or 32
        args.checkpoint_every = args.checkpoint_every or 10
    else:
        args.steps, args.seq = args.steps or 400, args.seq or 256
        args.checkpoint_every = args.checkpoint_every or 50
    nodes = 1 if args.single else 2
    cluster = TwoRaylets(args.out, nodes, gpu=not args.smoke, cpus=1 if args.smoke else 8)
    rows = []
    try:
        print(f"ray cluster at {cluster.address}: {nodes} node(s), {'CPU' if args.smoke else 'one GPU each'}", flush=True)
        rows.append(sweep(args, "clean", nodes, cluster))
        print(json.dumps(rows[-1]), flush=True)
        if not args.single and rows[-1]["makespan_s"]:
            rows.append(sweep(args, "node-killed", nodes, cluster, kill_after_s=args.kill_at * rows[-1]["wall_s"]))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        cluster.stop()
    (args.out / "ray_bench.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{'run':<12} {'nodes':>5} {'makespan':>9} {'wall':>7} {'done':>5} {'lost':>5} {'once':>5}  resumed at")
    for r in rows:
        span = f"{r['makespan_s']:.1f}s" if r["makespan_s"] else "—"
        resumed = ", ".join(f"{j}: step {s}" for j, s in r["resumed_at_step"].items()) or "—"
        print(f"{r['run']:<12} {r['nodes']:>5} {span:>9} {r['wall_s']:>6.1f}s {r['adapters'].get('done', 0):>5} "
              f"{len(r['lost']):>5} {str(r['every_adapter_once']):>5}  {resumed}")
    ok = all(r["returncode"] == 0 and r["every_adapter_once"] for r in rows)
    ok = ok and all(r["lost"] for r in rows if r["killed"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
