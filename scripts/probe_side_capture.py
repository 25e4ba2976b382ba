"""Whether a CUDA graph can be captured on a side thread while the main thread replays
another graph of the same memory pool and reads its results back (what a job's side lane
does, `plora.train.side_lane`), and whether the side capture replays as its eager step does.

    python scripts/probe_side_capture.py MODE

MODE: what the main thread does meanwhile, and how the side thread captures:
``idle-warm`` (sleeps), ``warm`` (replays, reads with ``tolist``), ``own-stream-warm``
(replays on a stream of its own, reads after a stream sync), ``warm-relaxed``; without
``warm`` the side thread makes its cuBLAS handle inside the capture. On an H200 (torch 2.11):
every mode without ``warm`` invalidates the capture (a library handle made inside it); with
it each side graph equals the eager step, and a main thread that waits in ``tolist`` (the
interpreter lock held) stretches a 0.01 s capture to 3.5 s, one that waits in a stream
synchronisation to 0.11 s.
"""

from __future__ import annotations

import threading
import time

import torch


def build(width: int, depth: int, device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(device)


def step(model, opt, x, out):
    opt.zero_grad(set_to_none=False)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    out.copy_(loss.detach())


def main() -> None:
    import sys
    mode = sys.argv[1] if len(sys.argv) > 1 else "warm"
    try:
        variant(mode)
    except Exception as e:  # noqa: BLE001
        print(mode, "failed outside the capture:", repr(e)[:300])


def variant(mode: str) -> None:
    print("==", mode)
    dev = torch.device("cuda")
    model = build(2048, 24, dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    xa = torch.randn(4096, 2048, device=dev)
    xb = torch.randn(1024, 2048, device=dev)
    oa, ob = torch.zeros((), device=dev), torch.zeros((), device=dev)
    side = torch.cuda.Stream()
    # warm-up on the side stream (cuBLAS workspaces), as a capture wants
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(model, opt, xa, oa)
        step(model, opt, xb, ob)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    ga = torch.cuda.CUDAGraph()
    with torch.cuda.graph(ga, stream=side):
        step(model, opt, xa, oa)
    pool = ga.pool()
    result: dict = {}

    def capture_b():
        t0 = time.perf_counter()
        try:
            gb = torch.cuda.CUDAGraph()
            s2 = torch.cuda.Stream()
            if "warm" in mode:  # this thread's cuBLAS handle and its workspace on s2, made before the capture
                s2.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s2):
                    a = torch.randn(64, 64, device=dev)
                    (a @ a).sum().item()
                    torch.nn.functional.linear(a, a).sum().item()
                s2.synchronize()
            cm = "relaxed" if mode.endswith("relaxed") else "thread_local"
            with torch.cuda.graph(gb, stream=s2, pool=pool, capture_error_mode=cm):
                step(model, opt, xb, ob)
            result["graph"] = gb
        except Exception as e:  # noqa: BLE001
            result["error"] = repr(e)
        result["seconds"] = time.perf_counter() - t0

    th = threading.Thread(target=capture_b)
    t0 = time.perf_counter()
    losses = []
    mine = torch.cuda.Stream()
    mine.wait_stream(torch.cuda.current_stream())
    th.start()
    while th.is_alive():
        if mode.startswith("idle"):
            time.sleep(0.01)
            losses.append(0)
        elif mode == "replay-sync":
            ga.replay()
            torch.cuda.current_stream().synchronize()
            losses.append(0)
        elif mode.startswith("own-stream"):
            with torch.cuda.stream(mine):
                ga.replay()
                host = oa.to("cpu", non_blocking=True)
                mine.synchronize()
                losses.append(float(host))
        else:
            ga.replay()
            losses.append(oa.tolist())
    th.join()
    torch.cuda.current_stream().wait_stream(mine)
    main_s = time.perf_counter() - t0
    print(f"side capture: {result.get('error', 'ok')} in {result['seconds']:.3f} s; "
          f"main replayed {len(losses)} steps meanwhile ({main_s:.3f} s)")
    if "graph" not in result:
        return
    # the side graph against eager: same weights, same input
    state = {k: v.clone() for k, v in model.state_dict().items()}
    result["graph"].replay()
    torch.cuda.synchronize()
    got = ob.item()
    after_graph = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    step(model, opt, xb, ob)
    torch.cuda.synchronize()
    want = ob.item()
    diff = max((after_graph[k] - v).abs().max().item() for k, v in model.state_dict().items())
    print(f"side graph loss {got:.6f} eager {want:.6f}; weights differ by {diff:.3e}")
    for _ in range(3):
        ga.replay()
        result["graph"].replay()
    torch.cuda.synchronize()
    print("interleaved replays ok:", oa.item(), ob.item())


if __name__ == "__main__":
    main()
