#!/usr/bin/env python3
"""The floor under a DCP gather between two GPUs of one host: copy-engine peer copies.

    python3 tools/p2p_floor.py [--mib 38 236] [--json FILE]

One process, GPUs 0 and 1. For each size (default: one rank's part of the DCP exchange at 64k
and 400k context, 576 bf16 per token): a device-to-device copy from GPU 1 into GPU 0 issued on
GPU 0 (``cudaMemcpyPeerAsync``: a copy engine over NVLink), both directions at once, and the
overlap check the runtime relies on: a bf16 GEMM loop on GPU 0 alone, the copies alone, and both
together (the GEMM's slowdown says whether the copies took SMs). Medians of interleaved rounds.
The multi-process numbers (symmetric memory pulls vs NCCL all-gather of the same bytes) come
from ``python -m ringflow.bench.dcp --world 2`` (its ``exchange`` rows).
"""

import argparse
import sys

import torch

from ringflow.bench import records
from ringflow.timing import interleaved_medians, span_ms
from ringflow.units import MIB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[38.0, 236.0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("p2p_floor: needs two GPUs of one host", file=sys.stderr)
        return 2
    can = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
    s0 = torch.cuda.Stream(0)
    s1 = torch.cuda.Stream(1)
    side0 = torch.cuda.Stream(0)
    n = 8192
    a = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda:0", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    rows = []
    for mib in args.mib:
        count = int(mib * MIB) // 2
        src1 = torch.randn(count, device="cuda:1").to(torch.bfloat16)
        src0 = torch.randn(count, device="cuda:0").to(torch.bfloat16)
        dst0, dst1 = torch.empty_like(src1, device="cuda:0"), torch.empty_like(src0, device="cuda:1")
        nbytes = count * 2

        def pull():
            with torch.cuda.stream(s0):
                dst0.copy_(src1, non_blocking=True)

        def both():
            with torch.cuda.stream(s0):
                dst0.copy_(src1, non_blocking=True)
            with torch.cuda.stream(s1):
                dst1.copy_(src0, non_blocking=True)

        copies = max(1, int(round(8 * 38 / mib)))  # ~ the GEMM loop's length in copies

        def gemms():
            with torch.cuda.stream(side0):
                for _ in range(12):
                    torch.mm(a, b, out=c)

        def pulls():
            for _ in range(copies):
                pull()

        def together():
            gemms()
            pulls()

        ways = {"pull": (pull, [s0]), "both": (both, [s0, s1]), "gemm": (gemms, [side0]),
                "pulls": (pulls, [s0]), "gemm+pulls": (together, [side0, s0])}
        def sampler(fn, streams):
            def sample() -> float:
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                return span_ms(fn, streams)
            return sample

        med = interleaved_medians({name: sampler(fn, streams) for name, (fn, streams)
                                   in ways.items()}, args.rounds, warmup=2)
        assert torch.equal(dst0.cpu(), src1.cpu()), "the peer copy is wrong"
        row = {"mib": mib, "bytes": nbytes, "ms": med,
               "pull_gb_per_s": nbytes / med["pull"] / 1e6,
               "both_gb_per_s_each": nbytes / med["both"] / 1e6,
               "pulls_gb_per_s": copies * nbytes / med["pulls"] / 1e6,
               "gemm_alone_ms": med["gemm"], "pulls_alone_ms": med["pulls"],
               "together_ms": med["gemm+pulls"],
               "overlap_vs_max": med["gemm+pulls"] / max(med["gemm"], med["pulls"])}
        rows.append(row)
        src0 = src1 = dst0 = dst1 = None  # freed before the next size
    doc = records.record("python3 tools/p2p_floor.py", peer_access=can, results=rows)
    print(f"{'MiB':>6} {'pull GB/s':>10} {'both GB/s each':>15} {'gemm ms':>8} {'pulls ms':>9} "
          f"{'together ms':>12} {'/max':>6}")
    for r in rows:
        print(f"{r['mib']:>6.0f} {r['pull_gb_per_s']:>10.1f} {r['both_gb_per_s_each']:>15.1f} "
              f"{r['gemm_alone_ms']:>8.3f} {r['pulls_alone_ms']:>9.3f} {r['together_ms']:>12.3f} "
              f"{r['overlap_vs_max']:>6.3f}")
    if args.json:
        records.write(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
