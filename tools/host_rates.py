"""What the host can compute of a MoE layer (issue #47, item 1): measured on the machine it runs on.

Note [Host rates]
    The split of Note [Host split] needs three rates of the host beside the GPU:

    * how fast its CPU reads DRAM, over 1..N threads (a sum over a buffer far larger than the
      caches, torch's CPU kernels with that many threads);
    * one expert's SwiGLU MLP for 1, 2, 4, 8, 16 tokens, in bf16 and float32, as the lane runs
      it (``kernels/host_moe.moe_on_host``, each run on another expert so its bytes come from
      DRAM), with the CPU's torch kernels (which ISA torch dispatched to, and whether oneDNN
      and AMX are there, is recorded);
    * the same two while the copy engines move pinned memory to the GPU at full rate (on a GPU
      machine: the copy and the CPU share the memory bus), and the copy's rate meanwhile;
    * the expert through the host share's worker, alone and beside a thread busy in Python (as
      vLLM's scheduler is): the worker runs no Python, so it should not notice;
    * the handoff of a step that hands the host nothing (its staging, the doorbell the stream
      writes, the flag it waits on, the copy back): eager, and replayed in a CUDA graph.

    Its ``model`` entry (bf16 expert times at the chosen thread count, under copy load where
    measured, and the replayed handoff) is what ``HostRates.load`` reads for ``ringflow
    place-experts --host-rates`` and the profile's ``experts.host_rates``.

    python3 tools/host_rates.py [--out profiles/results/host-rates-<gpu>.json] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ringflow.bench import records  # noqa: E402
from ringflow.integrations.torch.host_experts import (  # noqa: E402
    CopyLoad, measure_expert_ms, measure_handoff_ms)
from ringflow.testing.busy_python import BusyPython  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def host_info() -> dict:
    amx = getattr(getattr(torch._C, "_cpu", None), "_is_amx_tile_supported", None)
    return {"cpu": cpu_name(), "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn": torch.backends.mkldnn.is_available(),
            "amx_tiles": bool(amx()) if amx else None}


def read_gbps(buf: torch.Tensor, threads: int, repeats: int) -> float:
    """GB/s of torch's sum over ``buf`` with ``threads`` threads (best of ``repeats``)."""
    torch.set_num_threads(threads)
    buf.sum()  # warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * buf.element_size() / best / 1e9


def thread_count(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def replay_ms(graph, repeats: int) -> float:
    """Milliseconds of one replay of ``graph``: the median of ``repeats`` replays timed with
    CUDA events, after one untimed."""
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def stream_expert_ms(store: dict, threads: int, tokens=(1, 4, 16), repeats: int = 3) -> dict:
    """One expert through the host share as vLLM's FULL decode graph runs it: 32 steps of one
    expert each (each on another expert, so its bytes come from DRAM) staged, rung and joined
    on a CUDA stream, captured once into a CUDA graph and replayed (one Python call per
    replay, so a thread busy in Python beside it holds up only that call), timed with CUDA
    events; ms per expert."""
    from ringflow.integrations.torch.host_experts import HostExperts
    w13 = store["w13"]
    experts, width = w13.shape[0], w13.shape[2]
    share = HostExperts({0: store}, width, 1, max(tokens), "cuda", w13.dtype, threads)
    masks = torch.eye(experts, dtype=torch.bool, device="cuda")
    picks = list(range(min(32, experts)))
    out = {}
    try:
        for t in tokens:
            rows = torch.randn(t, width, device="cuda").to(w13.dtype)
            weights = torch.ones(t, 1, device="cuda")
            ids = [torch.full((t, 1), e, device="cuda") for e in picks]

            def steps():
                for e in picks:
                    share.launch(0, rows, weights, ids[e], masks[e])
                    share.join(t)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                steps()  # once eagerly: the worker's threads and the copies warm
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                steps()
            out[t] = round(replay_ms(graph, repeats) / len(picks), 4)
            del graph
    finally:
        torch.cuda.synchronize()
        share.close()
    return out


def replayed_handoff_ms(store: dict, repeats: int = 50) -> float:
    """The host share of a step that hands the host nothing (staging, doorbell, wait, copy
    back) captured in a CUDA graph, replayed: ms per replay against a graph without it."""
    from ringflow.integrations.torch.host_experts import HostExperts
    width = store["w13"].shape[2]
    share = HostExperts({0: store}, width, 1, 1, "cuda", store["w13"].dtype)
    x = torch.empty(0, width, dtype=store["w13"].dtype, device="cuda")
    weights = torch.empty(0, 1, device="cuda")
    ids = torch.empty(0, 1, dtype=torch.int64, device="cuda")
    mine = torch.zeros(share.experts, dtype=torch.bool, device="cuda")
    try:
        stream = torch.cuda.Stream()
        marker = torch.zeros(1, device="cuda")
        graphs = {}
        for name, with_node in (("bare", False), ("node", True)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    marker.add_(1)
                    if with_node:
                        share.launch(0, x, weights, ids, mine)
                        share.join(0)
                    marker.add_(1)
            graphs[name] = graph
        return replay_ms(graphs["node"], repeats) - replay_ms(graphs["bare"], repeats)
    finally:
        share.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--hidden", type=int, default=2048, help="model width (Qwen3-30B-A3B)")
    ap.add_argument("--inter", type=int, default=768, help="expert width (Qwen3-30B-A3B)")
    ap.add_argument("--experts", type=int, default=64,
                    help="experts measured over (64 x 9.4 MB: past any CPU cache)")
    ap.add_argument("--read-mib", type=int, default=2048, help="buffer of the read sweep")
    ap.add_argument("--threads", type=int, nargs="*",
                    help="thread counts to sweep (default 1, 2, 4, ... up to the usable CPUs)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a test run")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.inter, args.experts, args.read_mib = 256, 128, 8, 64
    info = host_info()
    usable = info["usable_cpus"]
    sweep = args.threads or sorted({min(t, usable) for t in (1, 2, 4, 8, 16, usable)})
    cuda = torch.cuda.is_available()
    g = torch.Generator().manual_seed(0)
    buf = torch.rand((args.read_mib << 20) // 4, generator=g)
    stores = {}
    for dtype in (torch.bfloat16, torch.float32):
        stores[str(dtype).removeprefix("torch.")] = {
            "w13": (torch.randn(args.experts, 2 * args.inter, args.hidden, generator=g) * 0.02
                    ).to(dtype),
            "w2": (torch.randn(args.experts, args.hidden, args.inter, generator=g) * 0.02
                   ).to(dtype)}
    expert_bytes = {name: sum(t[0].numel() * t.element_size() for t in s.values())
                    for name, s in stores.items()}
    rows = []
    for threads in sweep:
        torch.set_num_threads(threads)
        row = {"threads": threads, "read_gbps": round(read_gbps(buf, threads, 3), 2)}
        for name, store in stores.items():
            row[f"expert_ms_{name}"] = {t: round(ms, 4) for t, ms in
                                        measure_expert_ms(store, threads=threads).items()}
        rows.append(row)
    best = min(rows, key=lambda r: r["expert_ms_bfloat16"][1])
    torch.set_num_threads(best["threads"])
    quiet = measure_expert_ms(stores["bfloat16"], threads=best["threads"])
    with BusyPython():  # the worker runs no Python: it should not notice
        busy = measure_expert_ms(stores["bfloat16"], threads=best["threads"])
    beside_python = {"threads": best["threads"],
                     "worker_ms_quiet": {t: round(ms, 4) for t, ms in quiet.items()},
                     "worker_ms_busy_python": {t: round(ms, 4) for t, ms in busy.items()},
                     "note": "worker_ms_*: staged and joined from Python on the CPU (the "
                             "caller's polls wait for the GIL beside the busy thread)"}
    if cuda:  # as a GPU step runs it: no Python between the stream and the worker
        beside_python["stream_ms_quiet"] = stream_expert_ms(stores["bfloat16"], best["threads"])
        with BusyPython():
            beside_python["stream_ms_busy_python"] = stream_expert_ms(stores["bfloat16"],
                                                                      best["threads"])
    loaded = None
    if cuda:
        with CopyLoad("cuda", 256) as copy:
            loaded = {"threads": best["threads"],
                      "read_gbps": round(read_gbps(buf, best["threads"], 3), 2),
                      "expert_ms_bfloat16": {t: round(ms, 4) for t, ms in measure_expert_ms(
                          stores["bfloat16"]).items()}}
        loaded["copy_gbps_meanwhile"] = round(copy.gbps, 2)
        with CopyLoad("cuda", 256) as alone:
            time.sleep(1.0)
        loaded["copy_gbps_alone"] = round(alone.gbps, 2)
    handoff = {"eager_ms": round(measure_handoff_ms(stores["bfloat16"],
                                                    "cuda" if cuda else "cpu"), 4),
               "where": ("cuda stream" if cuda
                         else "cpu only: Python's writes and polls of the flags")}
    if cuda:  # Note [Host node]: the doorbell and the wait, inside a replayed graph
        handoff["replayed_ms"] = round(replayed_handoff_ms(stores["bfloat16"]), 4)
    model_ms = (loaded or best)["expert_ms_bfloat16"]
    doc = records.record("tools/host_rates.py", host=info, shapes={
        "hidden": args.hidden, "inter": args.inter, "experts": args.experts,
        "expert_bytes": expert_bytes}, sweep=rows, beside_python=beside_python,
        under_copy=loaded, handoff=handoff,
        model={"expert_ms": model_ms, "expert_bytes": expert_bytes["bfloat16"],
               "handoff_ms": handoff.get("replayed_ms", handoff["eager_ms"]),
               "threads": best["threads"],
               "source": "bf16 expert under copy load" if loaded else "bf16 expert, no GPU"})
    if args.out:
        records.write(args.out, doc)
    print(f"host: {info['cpu']}, {usable} usable CPUs, torch CPU {info['torch_cpu_capability']}, "
          f"oneDNN {info['onednn']}, AMX tiles {info['amx_tiles']}")
    print(f"{'threads':>7} {'read GB/s':>9} " + " ".join(
        f"{'bf16 ' + str(t) + 't ms':>11}" for t in (1, 4, 16)) + f" {'fp32 1t ms':>11}")
    for r in rows:
        print(f"{r['threads']:>7} {r['read_gbps']:>9} " + " ".join(
            f"{r['expert_ms_bfloat16'][t]:>11}" for t in (1, 4, 16))
            + f" {r['expert_ms_float32'][1]:>11}")
    print(f"through the host share's worker ({thread_count(best['threads'])}), bf16 1 token: "
          f"{beside_python['worker_ms_quiet'][1]} ms, beside a busy Python thread "
          f"{beside_python['worker_ms_busy_python'][1]} ms (joined from Python)")
    if cuda:
        print(f"  replayed in a CUDA graph: {beside_python['stream_ms_quiet'][1]} ms, beside a "
              f"busy Python thread {beside_python['stream_ms_busy_python'][1]} ms")
    if loaded:
        print(f"under copy load ({thread_count(loaded['threads'])}): read {loaded['read_gbps']} GB/s, "
              f"bf16 1 token {loaded['expert_ms_bfloat16'][1]} ms; copy "
              f"{loaded['copy_gbps_meanwhile']} GB/s meanwhile, {loaded['copy_gbps_alone']} "
              f"alone")
    print(f"handoff: {handoff}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
