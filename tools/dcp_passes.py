#!/usr/bin/env python3
"""The SM passes of a DCP gather, per layer, on one GPU: what each transport costs the SMs.

    python3 tools/dcp_passes.py [--contexts 65536 409600] [--world 2] [--json FILE]

For rank 0 of a ``--world`` group (ringflow.testing.dcp's shards: 576 bf16 per token, interleave 1,
decode batch 1), each pass is captured 20 times into a CUDA graph and timed by replaying it:
the peer transport's own rows (Triton, and the torch ops it replaced), the NCCL transport's
pack and order restoring (Triton, and torch ops), and the 2-D copy that pulls a peer's rows,
here within one GPU, beside a contiguous copy of the same bytes. Every pass is checked against
its torch twin first. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ringflow.bench import records
from ringflow.timing import elapsed_ms
from ringflow.units import MIB


def _time_ms(fn, repeat: int = 20) -> float:
    """ms per call of ``fn``, ``repeat`` calls captured into one graph and replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        for _ in range(repeat):
            fn()
    graph.replay()
    return elapsed_ms(graph.replay) / repeat


def measure(context: int, world: int) -> dict:
    from ringflow.testing.dcp import ROW, full_kv, shard
    from ringflow.kernels import dcp_local_lens, dcp_slot_rows, paged_gather
    from ringflow.kernels.kv_gathers import restore_order, write_own_rows
    from ringflow.kernels.peer_exchange import copy_strided

    device = torch.device("cuda")
    full = full_kv(1, context, 1, device)
    cache, table = shard(full, 1, context, 0, world)
    lens = torch.tensor([context], device=device)
    rows = dcp_slot_rows(context, 1, world)
    local = dcp_local_lens(lens, world)
    staging = torch.randn(world, rows // world, ROW, device=device).to(torch.bfloat16)
    out, twin = (torch.empty(rows, ROW, dtype=torch.bfloat16, device=device) for _ in range(2))
    peer = torch.randn(rows, ROW, device=device).to(torch.bfloat16)

    def same(fused, unfused) -> None:
        fused(out)
        unfused(twin)
        if not torch.equal(out, twin):
            raise SystemExit(f"context {context}: a fused pass differs from its torch ops")

    own = lambda o, f=True: write_own_rows(cache, table, lens, o, world, 0, 1, fused=f)  # noqa: E731
    restore = lambda o, f=True: restore_order(staging, local, lens, o, 1, fused=f)  # noqa: E731
    for pass_ in (own, restore):
        out.fill_(7.0)  # rows a pass does not write must match too (NaN never equals itself)
        twin.fill_(7.0)
        same(pass_, lambda o, p=pass_: p(o, False))
    chunks = (rows // world, world, 1, ROW)
    half = out.numel() // world * (world - 1)
    pulled = out.nbytes * (world - 1) / world
    result = {
        "context": context, "world": world, "slot_mib": out.nbytes / MIB,
        "own_rows_us": _time_ms(lambda: own(out)) * 1e3,
        "own_rows_torch_us": _time_ms(lambda: own(out, False)) * 1e3,
        "pack_us": _time_ms(lambda: paged_gather(cache, table, local[:, 0], staging[0])) * 1e3,
        "restore_us": _time_ms(lambda: restore(out)) * 1e3,
        "restore_torch_us": _time_ms(lambda: restore(out, False)) * 1e3,
        "copy_2d_us": _time_ms(lambda: copy_strided(out.view(chunks)[:, 1],
                                                     peer.view(chunks)[:, 1])) * 1e3,
        "copy_contiguous_us": _time_ms(lambda: out.view(-1)[:half].copy_(
            peer.view(-1)[:half])) * 1e3,
    }
    result["copy_2d_gb_per_s"] = pulled / result["copy_2d_us"] / 1e3
    result["copy_contiguous_gb_per_s"] = pulled / result["copy_contiguous_us"] / 1e3
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[65536, 409600])
    parser.add_argument("--world", type=int, default=2, help="DCP group size (default 2)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("dcp_passes: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [measure(c, args.world) for c in args.contexts]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per layer, rank 0 of "
          f"{args.world}")
    print("context | own rows (torch) | pack | restore (torch) | 2-D copy | contiguous copy")
    for r in rows:
        print(f"{r['context']:,} | {r['own_rows_us']:.1f} ({r['own_rows_torch_us']:.1f}) | "
              f"{r['pack_us']:.1f} | {r['restore_us']:.1f} ({r['restore_torch_us']:.1f}) | "
              f"{r['copy_2d_us']:.1f} ({r['copy_2d_gb_per_s']:.0f} GB/s) | "
              f"{r['copy_contiguous_us']:.1f} ({r['copy_contiguous_gb_per_s']:.0f} GB/s)")
    if args.json:
        records.write(args.json, records.record("python3 tools/dcp_passes.py", rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
