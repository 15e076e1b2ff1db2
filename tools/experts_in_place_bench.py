#!/usr/bin/env python3
"""When should a step that needs more experts than the cache holds read the rest in place?

    python3 tools/experts_in_place_bench.py [--json FILE]

One Qwen3-30B-A3B-shaped MoE layer (128 experts of intermediate 768, hidden 2048, top-8, bf16)
in pinned host memory, read through a CUDA view as vLLM's UVA offloader makes it, a cache of 32
slots, vLLM's Triton ``fused_experts``; per step size (tokens), uniform random routings, the
cache warm from the steps before, median milliseconds per step:

* ``passes``: every expert a step misses is copied into the slots, ``slots`` per pass
  (``in_place_tokens: 0``);
* ``in-place``: pass 0 installs what fits, one more pass computes the rest straight from the
  host view (Note [Expert cache], step 5);
* ``uva``: vLLM's kernel over the host view alone (its UVA offloader with every expert there);
* ``resident``: every expert in device memory (the compute alone).

It checks that ``passes`` and ``in-place`` give ``resident``'s output (bf16 rounding: the
passes sum in another order), and prints the table last; ``experts.in_place_tokens``'s
default comes from where ``in-place`` stops being faster than ``passes``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ringflow.integrations.torch.expert_cache import ExpertCache  # noqa: E402

E, H, I, K, SLOTS = 128, 2048, 768, 8, 32
TOKENS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    resident = {"w13": torch.randn(E, 2 * I, H, device=dev, generator=g).to(torch.bfloat16) / 45,
                "w2": torch.randn(E, H, I, device=dev, generator=g).to(torch.bfloat16) / 28}
    pinned = {k: v.cpu().pin_memory() for k, v in resident.items()}
    view = {k: get_accelerator_view_from_cpu_tensor(v) for k, v in pinned.items()}

    def moe(x, weights, tw, ids, expert_map=None):
        return fused_experts(x, weights["w13"], weights["w2"], tw, ids, global_num_experts=E,
                             expert_map=None if expert_map is None else
                             expert_map.to(torch.int32))

    def lane(cache):
        def step(x, tw, ids):
            out = None
            for source, expert_map in cache.serve(ids):
                part = moe(x, source, tw, ids, expert_map)
                out = part if out is None else out.add_(part)
            return out
        return step

    caches = {name: ExpertCache(view, SLOTS, dev, in_place_tokens=t)
              for name, t in (("passes", 0), ("in-place", 1 << 20))}
    ways = {"passes": lane(caches["passes"]), "in-place": lane(caches["in-place"]),
            "uva": lambda x, tw, ids: moe(x, view, tw, ids),
            "resident": lambda x, tw, ids: moe(x, resident, tw, ids)}
    rows = []
    for tokens in TOKENS:
        steps = []
        for _ in range(args.repeats + 2):
            logits = torch.randn(tokens, E, device=dev, generator=g)
            tw, ids = torch.softmax(logits, -1).topk(K)
            steps.append((torch.randn(tokens, H, device=dev, generator=g).to(torch.bfloat16),
                          (tw / tw.sum(-1, keepdim=True)).float(), ids.to(torch.int32)))
        row = {"tokens": tokens}
        for name, fn in ways.items():
            times = []
            for i, (x, tw, ids) in enumerate(steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn(x, tw, ids)
                b.record()
                torch.cuda.synchronize()
                if i >= 2:
                    times.append(a.elapsed_time(b))
                if i == len(steps) - 1:
                    ref = moe(x, resident, tw, ids).float()
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    row[f"{name}_rel_err"] = round(err, 5)
            row[f"{name}_ms"] = round(statistics.median(times), 3)
        row["in_place_speedup"] = round(row["passes_ms"] / row["in-place_ms"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    bad = [r for r in rows for n in ways if r[f"{n}_rel_err"] > 0.02]
    faster = [r["tokens"] for r in rows if r["in_place_speedup"] > 1.0]
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python3 tools/experts_in_place_bench.py " + " ".join(sys.argv[1:]),
           "shape": {"experts": E, "hidden": H, "intermediate": I, "top_k": K, "slots": SLOTS,
                     "dtype": "bfloat16"},
           "rows": rows, "in_place_faster_up_to": max(faster) if faster else 0,
           "wrong": [r["tokens"] for r in bad]}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{'tokens':>7} {'passes':>9} {'in-place':>9} {'uva':>9} {'resident':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['passes_ms']:>9.3f} {r['in-place_ms']:>9.3f} "
              f"{r['uva_ms']:>9.3f} {r['resident_ms']:>9.3f} {r['in_place_speedup']:>8.2f}")
    print(f"in place faster up to {doc['in_place_faster_up_to']} tokens; wrong: {doc['wrong']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
