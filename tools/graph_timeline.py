"""Diagnostic: where time goes *inside* a replayed CUDA graph, ringflow's vs the hand ring's.

    python tools/graph_timeline.py [SCENARIO] [--out FILE]

Every gather and compute of the scenario is wrapped in a pair of timing events created with
``external=True``, which a capture records as event nodes of the graph, so a replay stamps each
node's start and end. Both graphs are replayed interleaved (after warm-up) and the median span
of each node is printed side by side with the same graphs' untimed medians. Used to find why
ringflow's captured graph of weights-stream-mixed ran 3% slower than the hand ring's.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ringflow.bench.hand_ring import Graphed, HandRing
from ringflow.bench.scenarios import SCENARIOS, scenario_parts
from ringflow.graphs.captured import CapturedExecutor
from ringflow.orchestrator.profile import Profile
from ringflow.bench import records
from ringflow.timing import stamped, timed_run


class Stamped:
    """work.gather / work.compute with external timing events around each call."""

    def __init__(self, work) -> None:
        self.marks: list = []
        self.gather = stamped("gather", work.gather, self.marks, external=True)
        self.compute = stamped("compute", work.compute, self.marks, external=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", nargs="?", default="weights-stream-mixed")
    parser.add_argument("--replays", type=int, default=12)
    parser.add_argument("--out")
    args = parser.parse_args()
    profile = Profile.load(SCENARIOS[args.scenario])
    lane = profile.lanes[0]
    pools, dag, work, gathered = scenario_parts(profile)
    pool = torch.cuda.graph_pool_handle()
    timed, variants = {}, {}
    for name in ("ringflow", "hand"):
        wrapped = Stamped(work)
        if name == "ringflow":
            graph = CapturedExecutor(dag, pools, wrapped.gather, wrapped.compute)
            graph.run()                       # captures on first run
            plain = CapturedExecutor(dag, pools, work.gather, work.compute)
            plain.run()
        else:
            hand_work = type("W", (), {})()
            hand_work.gather, hand_work.compute = wrapped.gather, wrapped.compute
            hand_work.shape, hand_work.dtype, hand_work.device = work.shape, work.dtype, \
                work.device
            graph = Graphed(HandRing(hand_work, profile.layers, gathered, lane).run, pool)
            plain = Graphed(HandRing(work, profile.layers, gathered, lane).run, pool)
        # the marks of the last recording are the ones the graph replays
        count = sum(1 for n in dag.nodes if n.kind.name in ("GATHER", "SYNC_GATHER", "COMPUTE"))
        timed[name] = (graph, wrapped.marks[-count:])
        variants[name] = plain
    spans = {name: {} for name in timed}
    totals = {name: [] for name in list(timed) + [f"{n}-untimed" for n in variants]}
    for r in range(args.replays + 2):  # the first two rounds warm up
        work.refresh(7000 + r, sources=False)
        for name, (graph, marks) in timed.items():
            origin, done = timed_run(graph.run)
            if r >= 2:
                totals[name].append(origin.elapsed_time(done))
                for kind, layer, _, start, end in marks:
                    spans[name].setdefault((kind, layer), []).append(
                        (origin.elapsed_time(start), origin.elapsed_time(end)))
        for name, plain in variants.items():
            origin, done = timed_run(plain.run)
            if r >= 2:
                totals[f"{name}-untimed"].append(origin.elapsed_time(done))
    med = {name: {f"{k}/L{l}": [statistics.median(s for s, _ in v), statistics.median(e for _, e in v)]
                  for (k, l), v in sorted(d.items(), key=lambda kv: (kv[0][1], kv[0][0]))}
           for name, d in spans.items()}
    print(f"{'node':<14} " + " ".join(f"{n + ' start-end (dur)':>30}" for n in med))
    for key in med["hand"]:
        cells = []
        for name in med:
            s, e = med[name].get(key, [float("nan")] * 2)
            cells.append(f"{s:9.3f}-{e:9.3f} ({e - s:6.3f})")
        print(f"{key:<14} " + " ".join(f"{c:>30}" for c in cells))
    summary = {k: statistics.median(v) for k, v in totals.items()}
    print("median total ms:", json.dumps({k: round(v, 3) for k, v in summary.items()}))
    if args.out:
        records.write(args.out, records.record("python3 tools/graph_timeline.py",
                                               scenario=args.scenario, median_total_ms=summary,
                                               median_spans_ms=med))


if __name__ == "__main__":
    main()
