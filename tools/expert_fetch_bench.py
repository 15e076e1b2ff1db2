"""How to bring a MoE step's missed experts to the GPU (issue #39): measured on one GPU.

The router's choice lives on the GPU, so a mechanism that stays inside a CUDA graph with no host
sync must take the expert ids from device memory. Measured here, with experts of a
Qwen3-30B-A3B layer (w13 [2*768, 2048] and w2 [2048, 768] bf16: 9.4 MB each) in pinned memory:

- ``sm``: ringflow's device-indexed fetch (kernels/expert_fetch.py), for several grid sizes;
- ``ce``: the copy engines, one ``copy_`` per expert with ids known on the host (what a host
  sync on the router's output would allow: the bound for copy engines, not graph-safe);
- ``ce-bulk``: one contiguous copy of the same bytes (the link's rate);

each alone, and each beside a bf16 matmul that fills the GPU on another stream (how much each
slows the compute and is slowed by it). It also checks the fetch bit for bit against torch and
inside a CUDA graph replayed with new device-side ids.

    python3 tools/expert_fetch_bench.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ringflow.kernels.expert_fetch import fetch_experts  # noqa: E402

H, I = 2048, 768
EXPERTS, SLOTS = 64, 32


def timed(fn, repeats: int = 15, stream=None) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs, timed with CUDA events."""
    stream = stream or torch.cuda.current_stream()
    times = []
    for _ in range(repeats + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(EXPERTS, 2 * I, H, generator=g).to(torch.bfloat16).pin_memory(),
            torch.randn(EXPERTS, H, I, generator=g).to(torch.bfloat16).pin_memory()]
    cache = [torch.full((SLOTS, *h.shape[1:]), float("nan"), dtype=h.dtype, device=dev)
             for h in host]
    expert_bytes = sum(h[0].numel() * h.element_size() for h in host)

    # correctness: eager, then in a graph replayed with new ids written to the same tensors
    ids = torch.empty(SLOTS, dtype=torch.int32, device=dev)
    slots = torch.empty(SLOTS, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)

    def route(seed: int, n: int):
        r = torch.Generator().manual_seed(seed)
        e = torch.randperm(EXPERTS, generator=r)[:n]
        s = torch.randperm(SLOTS, generator=r)[:n]
        ids[:n].copy_(e)
        slots[:n].copy_(s)
        count.fill_(n)
        return e, s

    def fetch(programs: int = 32):
        for h, c in zip(host, cache):
            fetch_experts(h, c, ids, slots, count, programs=programs)

    def exact(e, s) -> bool:
        torch.cuda.synchronize()
        return all(torch.equal(c[s.to(dev)].cpu(), h[e]) for h, c in zip(host, cache))

    checks = {}
    e, s = route(1, 8)
    fetch()
    checks["eager"] = exact(e, s)
    before = [c.clone() for c in cache]
    route(2, 0)
    fetch()
    torch.cuda.synchronize()
    checks["count_0_writes_nothing"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before, cache))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        route(3, 5)
        fetch()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fetch()
    for seed, n in ((4, 12), (5, 1), (6, SLOTS)):
        e, s = route(seed, n)
        graph.replay()
        checks[f"graph_replay_{n}"] = exact(e, s)
    print(f"[expert-fetch] checks {checks}", file=sys.stderr, flush=True)

    # a matmul that fills the GPU, on its own stream
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def matmuls():
        for _ in range(4):
            a @ b

    rows = []
    mm_alone = timed(matmuls)
    for n in (1, 8, 32):
        route(100 + n, n)
        e_host = torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(100 + n))[:n]
        variants = {f"sm-{p}": (lambda p=p: fetch(p)) for p in (8, 16, 32, 64, 132)}

        def ce(e_host=e_host, n=n):
            for k in range(n):
                for h, c in zip(host, cache):
                    c[k].copy_(h[int(e_host[k])], non_blocking=True)

        def ce_bulk(n=n):
            for h, c in zip(host, cache):
                c[:n].copy_(h[:n], non_blocking=True)

        variants["ce"], variants["ce-bulk"] = ce, ce_bulk
        for name, fn in variants.items():
            alone = timed(fn)
            # both at once: the fetch on copy_stream, the matmuls on mm_stream, timed end to end
            def both(fn=fn):
                start = torch.cuda.current_stream()
                for st in (mm_stream, copy_stream):
                    st.wait_stream(start)
                with torch.cuda.stream(mm_stream):
                    matmuls()
                with torch.cuda.stream(copy_stream):
                    fn()
                for st in (mm_stream, copy_stream):
                    start.wait_stream(st)
            together = timed(both)
            rows.append({"experts": n, "variant": name, "bytes": n * expert_bytes,
                         "alone_ms": round(alone, 3),
                         "gb_per_s": round(n * expert_bytes / alone / 1e6, 1),
                         "with_matmul_ms": round(together, 3),
                         "matmul_alone_ms": round(mm_alone, 3),
                         "hidden_share": round(1 - (together - mm_alone) / alone, 3)})
            print(f"[expert-fetch] {rows[-1]}", file=sys.stderr, flush=True)
    print("| experts | variant | alone ms | GB/s | with matmul ms (matmul alone) | hidden |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['experts']} | {r['variant']} | {r['alone_ms']} | {r['gb_per_s']} | "
              f"{r['with_matmul_ms']} ({r['matmul_alone_ms']}) | {r['hidden_share']} |")
    if args.json:
        from ringflow.bench import records
        records.write(args.json, records.record(
            "python3 tools/expert_fetch_bench.py", gpu=torch.cuda.get_device_name(),
            expert_bytes=expert_bytes, checks=checks, rows=rows))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
