#!/usr/bin/env python3
"""The placement model's prediction against the measured forward, for benchmark runs already
recorded (``ringflow bench`` results JSON): no GPU needed.

    python3 tools/placement_vs_measured.py profiles/results/bench-h200.json [...] [--json F]

For each scenario the model (Note [Placement model], what ``offload: {count: N}`` places by)
is given the run's own gather-only and compute-only times, spread evenly over the gathered
layers and over every layer, the scenario's profile (``profiles/bench/``) and the ring the run
used; ``captured`` is one forward alone, ``cross`` a forward among forwards with the
cross-forward plan (runs that recorded ``steady_ms``; from the steady compute-only, beside
and sync times where those were recorded, as ``ringflow bench`` does). Runs from before
``ringflow bench`` printed the prediction itself, or before the model had a term, are checked
this way.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rows_of(path: Path, profiles: dict) -> list[dict]:
    from ringflow.bench.scenarios import predicted_ms, steady_inputs
    from ringflow.orchestrator.budget import PoolLayout

    doc = json.loads(path.read_text())
    rows = []
    for run in doc.get("results") or doc.get("rows") or []:
        profile = profiles.get(run["scenario"].split("/")[0])
        if profile is None:
            print(f"[placement] {path.name}: no profile for {run['scenario']}", file=sys.stderr)
            continue
        gathered = (set(range(profile.layers)) if profile.gathered_layers is None
                    else set(profile.gathered_layers))
        slots = PoolLayout.fit(profile.lanes[0], profile.slot.nbytes, run.get("depth", profile.depth),
                               int(profile.workspace_mib * 2**20)).slots
        predicted = predicted_ms(run["ms"], profile.layers, gathered, slots)
        row = {"file": path.name, "gpu": doc.get("gpu"), "scenario": run["scenario"],
               "lanes": len(profile.lanes), "slots": slots,
               "predicted_ms": round(predicted["captured"], 3),
               "captured_ms": round(run["ms"]["captured"], 3),
               "captured_vs_predicted": round(run["ms"]["captured"] / predicted["captured"], 4)}
        steady = run.get("steady_ms") or {}
        cross = steady.get("cross")
        if "compute" in steady:  # steady inputs where recorded, as ringflow bench predicts
            predicted = predicted_ms(steady_inputs(run["ms"], steady), profile.layers, gathered,
                                     slots)
        if cross is not None:
            row.update(predicted_cross_ms=round(predicted["cross"], 3),
                       steady_cross_ms=round(cross, 3),
                       cross_vs_predicted=round(cross / predicted["cross"], 4))
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from ringflow.bench import records
    from ringflow.orchestrator.profile import load_profile

    profiles = {}
    for path in sorted((ROOT / "profiles" / "bench").glob("*.yaml")):
        profile = load_profile(path)
        profiles[profile.name] = profile
    rows = [row for path in args.results for row in rows_of(path, profiles)]
    print("| run | scenario | lanes | slots | predicted ms | captured ms | captured / predicted "
          "| cross predicted | cross steady | cross / predicted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['file']} | {r['scenario']} | {r['lanes']} | {r['slots']} | "
              f"{r['predicted_ms']} | {r['captured_ms']} | {r['captured_vs_predicted']} | "
              f"{r.get('predicted_cross_ms', '-')} | {r.get('steady_cross_ms', '-')} | "
              f"{r.get('cross_vs_predicted', '-')} |")
    if args.json:
        records.write(args.json, records.record(
            "python3 tools/placement_vs_measured.py " + " ".join(str(p) for p in args.results),
            rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
