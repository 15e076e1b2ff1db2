#!/usr/bin/env python3
"""Why a layer computing beside a host-to-device copy runs slower, on one GPU.

    python3 tools/copy_contention.py [--scenario one-slot-placed] [--rounds 8] [--json FILE]

``ringflow bench`` finds hidden copies are not free: the placed one-slot scenario's compute runs
about 11% slower beside its copies, 4% in h2d-balanced, and the hand-written ring pays the same,
so the plan is not the cause. This probe takes the scenario's own compute and copies (its
synthetic workload) and times, interleaved round by round, each replayed as a CUDA graph:

* ``compute``, ``gather``: the scenario's compute-only and copy-only forwards;
* ``beside``: the two as independent branches of one graph (what the bench's slowdown is);
* ``beside/chunked``: the same bytes copied in 32 MiB pieces (does one long DMA matter?);
* ``beside/d2h``: the copies reversed, device to pinned host (does the write into HBM matter?);
* ``beside/eager``: the two issued eagerly on two streams (does the graph matter?);
* ``gemm``, ``gemm+gather``: a plain bf16 GEMM loop of about the compute's length, alone and
  beside the copies (does the kind of compute matter? peer copies left a GEMM untouched,
  ``p2p-floor-h200x2.json``).

Two checks of the timing itself, since a GPU at its power limit runs a forward faster when
the SMs idled just before: ``compute`` and ``beside`` timed right after a copy-only forward and
right after a compute-only one (``order``), and five variants timed 6 forwards back to back
(``steady``, each in its own steady state).

While each runs back to back for a few seconds, ``nvidia-smi`` is sampled for the SM clock,
power and the clock-event reasons (does the GPU lower its clock when copies add power?).
Prints a table; ``--json`` writes the record.
"""

import argparse
import statistics
import subprocess
import sys
import threading
import time

import torch

from ringflow.bench import records
from ringflow.bench.hand_ring import Graphed, side_by_side
from ringflow.bench.names import SCENARIOS
from ringflow.bench.scenarios import scenario_parts
from ringflow.orchestrator.profile import Profile
from ringflow.timing import elapsed_ms, interleaved_medians, interleaved_ms
from ringflow.units import MIB

#: what to sample, newest drivers first (instant power: the plain figure is a 1 s average)
QUERIES = ["clocks.sm,clocks.mem,power.draw.instant,clocks_event_reasons.active",
           "clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active",
           "clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"]


class Sampler:
    """``nvidia-smi`` samples (time, SM MHz, memory MHz, W, event reasons) on a thread."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.samples: list[tuple[float, list[str]]] = []
        self.period, self.stop = period_s, threading.Event()
        self.queries = list(QUERIES)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _once(self) -> list[str] | None:
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={self.queries[0]}", "-i", "0",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode or "[N/A]" in out.stdout or "Not Supported" in out.stdout:
            if len(self.queries) > 1:  # this driver lacks a field: the next query
                self.queries.pop(0)
            return None
        return [v.strip() for v in out.stdout.strip().split(",")]

    def _run(self) -> None:
        while not self.stop.is_set():
            values = self._once()
            if values is not None:
                self.samples.append((time.perf_counter(), values))
            self.stop.wait(self.period)

    def window(self, t0: float, t1: float) -> dict:
        rows = [v for t, v in self.samples if t0 <= t <= t1]
        if not rows:
            return {}

        def med(i):
            try:
                return statistics.median(float(r[i]) for r in rows)
            except ValueError:
                return None
        return {"samples": len(rows), "sm_mhz": med(0), "mem_mhz": med(1), "watts": med(2),
                "event_reasons": sorted({r[3] for r in rows})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="one-slot-placed", choices=sorted(SCENARIOS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--hold-s", type=float, default=3.0,
                        help="seconds each variant runs back to back while clocks are sampled")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("copy_contention: needs a GPU", file=sys.stderr)
        return 2
    profile = Profile.load(SCENARIOS[args.scenario])
    if profile.workload.gather != "h2d":
        print(f"copy_contention: {args.scenario} does not copy from the host", file=sys.stderr)
        return 2
    pools, _, work, gathered = scenario_parts(profile)
    lane, ring = profile.lanes[0], pools[0]
    order = sorted(gathered)

    def gather_only() -> None:
        for i, layer in enumerate(order):
            work.gather(layer, lane, ring.storage[i % ring.slots])

    def chunked() -> None:
        for i, layer in enumerate(order):
            src = work.store[i % len(work.store)].view(-1)
            dst = ring.storage[i % ring.slots].view(-1)[: src.numel()]
            step = 32 * MIB // src.element_size()
            for at in range(0, src.numel(), step):
                dst[at:at + step].copy_(src[at:at + step], non_blocking=True)

    host = torch.empty_like(work.store[0], device="cpu").pin_memory()

    def d2h() -> None:
        for i, _ in enumerate(order):
            slot = ring.storage[i % ring.slots].view(-1)[: host.numel()].view(host.shape)
            host.copy_(slot, non_blocking=True)

    def compute_only() -> None:
        for layer in range(profile.layers):
            work.compute(layer, lane, ring.storage[0] if layer in gathered else None)

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    reps = [1]

    def gemm() -> None:
        for _ in range(reps[0]):
            torch.matmul(a, b, out=c)

    side = torch.cuda.Stream()

    # the GEMM loop sized to the compute's length
    probe = Graphed(compute_only)
    compute_ms = interleaved_ms({"c": probe.run}, 3, warmup=1)["c"]
    one = interleaved_ms({"g": Graphed(gemm).run}, 3, warmup=1)["g"]
    reps[0] = max(1, round(compute_ms / one))
    pool = torch.cuda.graph_pool_handle()
    graphs = {"compute": probe.run, "gather": Graphed(gather_only, pool).run,
              "beside": Graphed(side_by_side(gather_only, compute_only, side), pool).run,
              "beside/chunked": Graphed(side_by_side(chunked, compute_only, side), pool).run,
              "beside/d2h": Graphed(side_by_side(d2h, compute_only, side), pool).run,
              "beside/eager": side_by_side(gather_only, compute_only, side),
              "gemm": Graphed(gemm, pool).run,
              "gemm+gather": Graphed(side_by_side(gather_only, gemm, side), pool).run}
    only = {"chunked": Graphed(chunked, pool).run, "d2h": Graphed(d2h, pool).run}
    ms = interleaved_ms({**graphs, **{f"{k}-only": v for k, v in only.items()}}, args.rounds,
                        warmup=2)

    def after(prev, run) -> float:
        prev()
        return elapsed_ms(run)  # queued right behind prev's work

    after_ms = interleaved_medians({f"{a} after {b}": (lambda a=a, b=b: after(graphs[b], graphs[a]))
                                 for a in ("compute", "beside") for b in ("gather", "compute")},
                                args.rounds)
    steady = interleaved_ms({k: graphs[k] for k in ("compute", "beside", "beside/eager", "gemm",
                                                     "gemm+gather")}, args.rounds, repeat=6)
    sampler = Sampler()
    sampler.thread.start()
    time.sleep(0.5)
    clocks = {"idle": sampler.window(0.0, time.perf_counter())}
    for name, run in graphs.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.hold_s:
            run()
            torch.cuda.synchronize()
        clocks[name] = sampler.window(t0 + 0.5, time.perf_counter())
    sampler.stop.set()
    sampler.thread.join()

    def excess(both: str, copy: str, comp: str) -> dict:
        lo, hi = sorted((ms[copy], ms[comp]))
        return {"ms": ms[both], "excess_ms": ms[both] - hi,
                "slowdown_per_ms_beside": (ms[both] - hi) / lo}

    rows = {"beside": excess("beside", "gather", "compute"),
            "beside/chunked": excess("beside/chunked", "chunked-only", "compute"),
            "beside/d2h": excess("beside/d2h", "d2h-only", "compute"),
            "beside/eager": excess("beside/eager", "gather", "compute"),
            "gemm+gather": excess("gemm+gather", "gather", "gemm")}
    doc = records.record("python3 tools/copy_contention.py", scenario=args.scenario,
                         sampled=sampler.queries[0],
                         rounds=args.rounds, gemm_reps=reps[0], gemm_n=n, ms=ms, rows=rows,
                         order_ms=after_ms, steady_ms=steady,
                         steady_slowdown_per_ms_beside={
                             "beside": (steady["beside"] - steady["compute"]) / ms["gather"],
                             "beside/eager": (steady["beside/eager"] - steady["compute"]) /
                             ms["gather"],
                             "gemm+gather": (steady["gemm+gather"] - steady["gemm"]) /
                             ms["gather"]},
                         clocks=clocks, copied_bytes=sum(work.store[i % len(work.store)]
                                                         .nbytes for i in range(len(order))))
    if args.json:
        records.write(args.json, doc)
    print(f"{args.scenario}: compute {ms['compute']:.2f} ms, copies {ms['gather']:.2f} ms "
          f"({doc['copied_bytes'] / ms['gather'] / 1e6:.1f} GB/s), gemm x{reps[0]} "
          f"{ms['gemm']:.2f} ms")
    print("| variant | ms | excess ms | slowdown per ms beside | SM MHz | W | reasons |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in graphs:
        r, k = rows.get(name, {}), clocks.get(name, {})
        print(f"| {name} | {ms[name]:.2f} | {r.get('excess_ms', 0):.2f} | "
              f"{r.get('slowdown_per_ms_beside', 0):.3f} | {k.get('sm_mhz')} | {k.get('watts')} "
              f"| {','.join(k.get('event_reasons', []))} |")
    print(f"| idle | - | - | - | {clocks['idle'].get('sm_mhz')} | {clocks['idle'].get('watts')} "
          f"| {','.join(clocks['idle'].get('event_reasons', []))} |")
    print("order (ms):", {k: round(v, 2) for k, v in after_ms.items()})
    print("steady, 6 back to back (ms):", {k: round(v, 2) for k, v in steady.items()})
    print("steady slowdown per ms beside:",
          {k: round(v, 3) for k, v in doc["steady_slowdown_per_ms_beside"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
