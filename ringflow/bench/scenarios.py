"""``ringflow bench`` and ``ringflow tune``: ringflow measured side by side with what a user
would otherwise run, on one GPU, in one process.

Each scenario is a profile under ``profiles/bench/``. For one scenario, interleaved replay by
replay, with CUDA events and fresh inputs before every replay:

* ``sync``      the plan's synchronous path (gather, then compute) captured in a CUDA graph;
* ``eager``     ringflow's EagerExecutor (Python issues every node each forward);
* ``captured``  ringflow's CapturedExecutor (one graph launch per forward);
* ``hand``      :class:`HandRing`, the two-slot ring a user would write, captured the same way;
* ``gather`` and ``compute`` alone, captured: the larger of the two is the ideal;
* ``beside``    the two in one graph on two branches with no edge between them: the floor of any
  overlap of these copies with this compute on this GPU (a layer computing beside a copy runs
  slower), whose excess over the ideal the placement model charges (Note [Placement model]),
  as it charges the sync graph's excess over gather plus compute as hand-offs between them;
* ``cross``     ringflow captured with every lane cross-forward (Note [Forward boundary]): the
  next forward's first slots filled during this forward's last layers.

Single forwards are timed one by one (events around each); steady state times a run of
back-to-back forwards (the way an engine runs step after step) and divides: the ``steady``
table holds sync, captured, cross and hand that way, and compute-only (all layers resident) and
``beside``, since a single forward on a GPU at its power limit runs faster after a variant
that left the SMs idle (``tools/copy_contention.py``).

Outputs of eager, captured and hand are checked bit-identical to sync. Reported: median ms,
ratios, percent of the gather hidden = (sync - captured) / min(gather, compute), pool bytes,
peak allocated bytes, allocator calls during the captured replays. Progress goes to stderr; the
table is printed last.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ringflow.bench import records
from ringflow.bench.hand_ring import Graphed, HandRing, side_by_side
from ringflow.bench.workload import SyntheticWorkload
from ringflow.errors import ConfigError, DeviceError
from ringflow.graphs.captured import CapturedExecutor
from ringflow.graphs.eager import EagerExecutor
from ringflow.graphs.slots import SlotPool
from ringflow.orchestrator.planner import Planner
from ringflow.orchestrator.profile import Profile
from ringflow.orchestrator.vocab import GATHER_PRIORITIES
from ringflow.bench.names import SCENARIOS
from ringflow.timing import interleaved_ms

STEADY_RUN = 6  # forwards back to back per steady-state sample


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclass
class Result:
    scenario: str
    profile: str
    layers: int
    depth: int
    ms: dict[str, float]
    equal: dict[str, bool]
    pool_bytes: int
    peak_allocated_bytes: int
    replay_allocator_calls: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ideal(self) -> float:
        return max(self.ms["gather"], self.ms["compute"])

    def ratios(self) -> dict[str, float]:
        ms = self.ms
        hidden = (ms["sync"] - ms["captured"]) / max(min(ms["gather"], ms["compute"]), 1e-9)
        return {
            "speedup_vs_sync": ms["sync"] / ms["captured"],
            "captured_vs_ideal": ms["captured"] / self.ideal,
            "captured_vs_hand": ms["captured"] / ms["hand"],
            "eager_vs_captured": ms["eager"] / ms["captured"],
            "captured_vs_sync": ms["captured"] / ms["sync"],
            "gather_hidden_pct": 100.0 * hidden,
        }

    def to_dict(self) -> dict:
        return {"scenario": self.scenario, "profile": self.profile, "layers": self.layers,
                "depth": self.depth, "ms": self.ms, "ideal_ms": self.ideal,
                "ratios": self.ratios(), "outputs_equal_to_sync": self.equal,
                "pool_bytes": self.pool_bytes, "peak_allocated_bytes": self.peak_allocated_bytes,
                "replay_allocator_calls": self.replay_allocator_calls, **self.extra}


def _outputs(variant, work: SyntheticWorkload) -> dict[str, torch.Tensor]:
    work.refresh(424_242, sources=False)
    variant.run()
    torch.cuda.synchronize()
    return work.outputs()


def _allocations() -> int:
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


def run_profile(name: str, profile: Profile, *, replays: int = 15, priority: str | None = None,
                timeline_dir: Path | None = None, trace_dir: Path | None = None) -> Result:
    """Measure one scenario (see the module docstring).

    Interrupted (Ctrl-C, an error), it leaves no device or pinned memory behind: the frames of
    the measurement hold the graphs, slots and pinned sources, so they are cleared before the
    exception travels on.
    """
    try:
        return _measure(name, profile, replays=replays, priority=priority,
                        timeline_dir=timeline_dir, trace_dir=trace_dir)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        release_memory()
        raise


def release_memory() -> None:
    """Return cached device and pinned host memory once nothing refers to it any more.

    .. note::
        cuBLAS's per-stream workspaces (32 MiB each, kept by torch for the process) are not
        released here: a live CUDA graph captured on such a stream may still use its workspace.
    """
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None:
        empty_host_cache()


def scenario_parts(profile: Profile):
    """What every measurement of ``profile`` starts from, on the GPU: its pools, plan,
    synthetic workload and the set of gathered layers."""
    pools = [SlotPool.for_profile(profile, lane_name, "cuda") for lane_name in profile.lanes]
    dag = Planner.from_profile(profile).plan()
    work = SyntheticWorkload(profile, "cuda")
    gathered = set(range(profile.layers)) if profile.gathered_layers is None \
        else set(profile.gathered_layers)
    return pools, dag, work, gathered


def _measure(name: str, profile: Profile, *, replays: int, priority: str | None,
             timeline_dir: Path | None, trace_dir: Path | None) -> Result:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    priority = priority or profile.gather_priority
    lane = profile.lanes[0]
    _say(f"{name}: allocating pools and {profile.workload.store_layers} source layers")
    pools, dag, work, gathered = scenario_parts(profile)
    graph_pool = torch.cuda.graph_pool_handle()

    def gather_only() -> None:
        for i, layer in enumerate(sorted(gathered)):
            work.gather(layer, lane, pools[0].storage[i % pools[0].slots])

    def compute_only() -> None:
        for layer in range(profile.layers):
            work.compute(layer, lane, pools[0].storage[0] if layer in gathered else None)

    _say(f"{name}: capturing sync, ringflow, hand ring, gather-only, compute-only, both beside")
    variants = {
        "sync": CapturedExecutor(dag, pools, work.gather, work.compute, capture="sync"),
        "eager": EagerExecutor(dag, pools, work.gather, work.compute, gather_priority=priority),
        "captured": CapturedExecutor(dag, pools, work.gather, work.compute,
                                     gather_priority=priority),
        "hand": Graphed(HandRing(work, profile.layers, gathered, lane).run, graph_pool),
        "gather": Graphed(gather_only, graph_pool),
        "compute": Graphed(compute_only, graph_pool),
        "beside": Graphed(side_by_side(gather_only, compute_only, torch.cuda.Stream()),
                          graph_pool),
    }
    # rings of its own: its carried slots stay leased between forwards
    cross_pools = [SlotPool.for_profile(profile, lane_name, "cuda") for lane_name in profile.lanes]
    cross_dag = Planner.from_profile(profile.replace(cross_forward=list(profile.lanes))).plan()
    variants["cross"] = CapturedExecutor(cross_dag, cross_pools, work.gather, work.compute,
                                         gather_priority=priority)
    for variant in variants.values():
        if isinstance(variant, CapturedExecutor):
            variant.run()
    want = _outputs(variants["sync"], work)
    equal, diff = {}, {}
    for key in ("eager", "captured", "hand", "cross"):
        got = _outputs(variants[key], work)
        equal[key] = all(torch.equal(got[k], want[k]) for k in want)
        diff[key] = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
    if not all(equal.values()):
        _say(f"{name}: OUTPUTS DIFFER from sync: max |diff| {diff}")
    _say(f"{name}: timing {replays} interleaved replays of each")
    runs = {name: variant.run for name, variant in variants.items()}
    # fresh queries every round (waits for the GPU)
    ms = interleaved_ms(runs, replays, warmup=2,
                        before_round=lambda r: work.refresh(10_000 + r, sources=False))
    # compute-only and beside too: on a GPU at its power limit a forward timed alone runs
    # faster after a copy-only forward left the SMs idle; back to back, each is timed in its
    # own steady state (Note [Placement model])
    steady = interleaved_ms({k: runs[k] for k in ("sync", "captured", "cross", "hand", "compute",
                                                  "beside")}, replays,
                            warmup=1, repeat=STEADY_RUN,
                            before_round=lambda r: work.refresh(20_000 + r, sources=False))
    before = _allocations()
    for _ in range(50):
        variants["captured"].run()
    torch.cuda.synchronize()
    calls = _allocations() - before
    noop = EagerExecutor(dag, pools, lambda *a: None, lambda *a: None, gather_priority=priority)
    extra = {"steady_ms": steady, "carried": [list(c) for c in cross_dag.carried],
             "steady_cross_vs_ideal": steady["cross"] / max(ms["gather"], ms["compute"]),
             "steady_cross_hidden_pct": 100.0 * (steady["sync"] - steady["cross"]) /
             max(min(ms["gather"], ms["compute"]), 1e-9),
             "eager_dispatch_us_per_node": _eager_dispatch_us(noop, len(dag.nodes)),
             "eager_issue_us_per_node": _eager_dispatch_us(variants["eager"], len(dag.nodes)),
             "nodes": len(dag.nodes), "gather_priority": priority, "max_abs_diff": diff}
    extra["predicted_ms"] = predicted_ms(ms, profile.layers, gathered, pools[0].slots)
    extra["captured_vs_predicted"] = ms["captured"] / extra["predicted_ms"]["captured"]
    extra["predicted_steady_ms"] = predicted_ms(steady_inputs(ms, steady), profile.layers,
                                                gathered, pools[0].slots)
    extra["steady_cross_vs_predicted"] = steady["cross"] / extra["predicted_steady_ms"]["cross"]
    extra["steady_cross_vs_resident"] = steady["cross"] / steady["compute"]
    extra["steady_captured_vs_resident"] = steady["captured"] / steady["compute"]
    if timeline_dir is not None or trace_dir is not None:
        from ringflow.bench.timeline import plot_timeline, record_timeline, write_trace

        spans = record_timeline(dag, pools, work)
        title = f"{name}: one forward, ringflow eager, depth {dag.pools[0].depth}"
        stem = f"{name.replace('/', '-')}-{records.gpu_slug()}"  # by experiment and GPU
        if timeline_dir is not None:
            extra["timeline_png"] = plot_timeline(spans, timeline_dir / f"{stem}.png", title).name
        if trace_dir is not None:
            extra["timeline_trace"] = write_trace(spans, trace_dir / f"{stem}.trace.json",
                                                  title).name
        extra["timeline"] = spans
    result = Result(name, profile.source or profile.name, profile.layers, dag.pools[0].depth, ms,
                    equal, sum(p.reserved_bytes for p in pools), torch.cuda.max_memory_allocated(),
                    calls, extra)
    for pool in pools + cross_pools:
        pool.close()
    del variants, work
    return result


def slowdown(ms: dict[str, float]) -> float:
    """Compute time lost per ms of compute beside a copy, from the ``beside`` graph (gather-only
    and compute-only on two branches): its excess over the larger of the two, per ms of the
    smaller, in 0..1 (1: the two serialise, as SM gathers beside a full GPU do). 0 for runs
    recorded before ``beside`` was measured."""
    if "beside" not in ms:
        return 0.0
    excess = ms["beside"] - max(ms["gather"], ms["compute"])
    return min(1.0, max(0.0, excess / max(min(ms["gather"], ms["compute"]), 1e-9)))


def handoff_ms(ms: dict[str, float], gathered: int) -> float:
    """The latency of one copy/compute dependency inside a graph, from the ``sync`` graph:
    every gather and compute in one chain, two hand-offs per gathered layer, so what it takes
    beyond gather-only plus compute-only, per hand-off (>= 0; Note [Placement model]). 0 for
    runs without a sync time."""
    if "sync" not in ms or not gathered:
        return 0.0
    return max(0.0, ms["sync"] - ms["gather"] - ms["compute"]) / (2 * gathered)


def steady_inputs(ms: dict[str, float], steady: dict[str, float]) -> dict[str, float]:
    """The model's inputs for a forward among forwards: compute-only, beside and sync timed
    back to back where they were (runs recorded before some were timed use the single ones),
    gather-only from the single forwards (a copy engine keeps no power state)."""
    return {**ms, **{k: steady[k] for k in ("compute", "beside", "sync") if k in steady}}


def predicted_ms(ms: dict[str, float], layers: int, gathered: set[int],
                 slots: int) -> dict[str, float]:
    """What the placement model (Note [Placement model], the one ``offload: {count: N}``
    places by) predicts for this run: its measured gather-only and compute-only times spread
    evenly over the gathered layers and over every layer, its measured :func:`slowdown` and
    :func:`handoff_ms`.
    ``captured``: one forward alone; ``cross``: a forward among forwards, cross-forward on;
    ``*_unslowed``: the same with the slowdown left out (what the placement search sees)."""
    from ringflow.orchestrator.placement import forward_ms

    compute = [ms["compute"] / layers] * layers
    copy = [ms["gather"] / len(gathered) if i in gathered else 0.0 for i in range(layers)]
    chosen, k = sorted(gathered), slowdown(ms)
    h = handoff_ms(ms, len(chosen))
    return {"captured": forward_ms(compute, copy, chosen, slots, False, k, h),
            "cross": forward_ms(compute, copy, chosen, slots, True, k, h),
            "captured_unslowed": forward_ms(compute, copy, chosen, slots, False, 0.0, h),
            "cross_unslowed": forward_ms(compute, copy, chosen, slots, True, 0.0, h),
            "slowdown": k, "handoff_ms": h}


def _eager_dispatch_us(executor: EagerExecutor, nodes: int) -> float:
    """Host time to issue one forward, per node (median of 20; the GPU is not waited for).

    With no-op callables this is ringflow's own dispatch cost (leases, events, stream
    switches, NVTX); with the workload's callables it includes their kernel launches."""
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        executor.run()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times) / nodes


def run_scenario(name: str, *, replays: int = 15, timeline_dir: Path | None = None,
                 trace_dir: Path | None = None) -> list[Result]:
    if name not in SCENARIOS:
        raise ConfigError(f"unknown scenario '{name}'; scenarios: {', '.join(SCENARIOS)}")
    profile = Profile.load(SCENARIOS[name])
    if name == "depth-sweep":
        fitting = int(profile.workspace_bytes // profile.slot.nbytes) - 1
        return [run_profile(f"{name}/d{d}", profile.replace(depth=d), replays=replays)
                for d in range(0, fitting + 1)]
    if name == "device-gather":
        return [run_profile(f"{name}/{p}", profile, replays=replays, priority=p,
                            timeline_dir=timeline_dir if p == "normal" else None,
                            trace_dir=trace_dir if p == "normal" else None)
                for p in GATHER_PRIORITIES]
    return [run_profile(name, profile, replays=replays, timeline_dir=timeline_dir,
                        trace_dir=trace_dir)]


def _section(head: str, body: list[str], footer: str) -> list[str]:
    """One block of the results table: its header, a rule, its rows, what the columns mean."""
    return [head, "-" * len(head), *body, footer]


def table(rows: list[dict]) -> str:
    """The results table, from :meth:`Result.to_dict` rows (also read back from JSON)."""
    body = []
    for r in rows:
        ms, q, equal = r["ms"], r["ratios"], r["outputs_equal_to_sync"]
        same = "yes" if all(equal.values()) else ",".join(k for k, v in equal.items() if not v)
        body.append(
            f"{r['scenario']:<26} {ms['sync']:>8.3f} {ms['eager']:>8.3f} {ms['captured']:>9.3f}"
            f" {ms['hand']:>8.3f} {r['ideal_ms']:>8.3f} {q['speedup_vs_sync']:>6.2f}x"
            f" {q['captured_vs_ideal']:>7.3f} {q['captured_vs_hand']:>6.3f}"
            f" {q['gather_hidden_pct']:>6.1f}% {r['eager_dispatch_us_per_node']:>8.2f} {same:>6}")
    lines = _section(
        f"{'scenario':<26} {'sync':>8} {'eager':>8} {'captured':>9} {'hand':>8} {'ideal':>8}"
        f" {'x sync':>7} {'/ideal':>7} {'/hand':>6} {'hidden':>7} {'us/node':>8} {'equal':>6}",
        body, "ms: median per forward; x sync = sync / captured; hidden = (sync - captured) / "
              "min(gather, compute); us/node: eager dispatch with no-op callables; equal: "
              "outputs bit-identical to sync (else the variants that differ)")
    steady = [r for r in rows if "steady_ms" in r]
    if steady:
        def steady_row(r: dict) -> str:
            st = r["steady_ms"]
            resident = st.get("compute")  # absent in runs recorded before it was timed
            return (f"{r['scenario']:<26} {st['sync']:>8.3f} {st['captured']:>9.3f} "
                    f"{st['cross']:>8.3f} {st['hand']:>8.3f} "
                    f"{resident if resident is not None else float('nan'):>9.3f} "
                    f"{r['ideal_ms']:>8.3f} {r['steady_cross_vs_ideal']:>11.3f} "
                    f"{r.get('steady_cross_vs_resident', float('nan')):>9.3f} "
                    f"{r['steady_cross_hidden_pct']:>6.1f}% {len(r['carried']):>8}")

        lines += [""] + _section(
            f"{'steady state':<26} {'sync':>8} {'captured':>9} {'cross':>8} {'hand':>8} "
            f"{'resident':>9} {'ideal':>8} {'cross/ideal':>11} {'cross/res':>9} {'hidden':>7} "
            f"{'carried':>8}",
            [steady_row(r) for r in steady],
            f"steady state: ms per forward over {STEADY_RUN} forwards back to back; cross: every "
            f"lane cross-forward; resident: compute-only (all layers resident) back to back; "
            f"ideal: the single-forward one; carried: slots a forward starts with")
    placed = [r for r in rows if "predicted_ms" in r]
    if placed:
        def row(r: dict) -> str:
            pred, ms = r["predicted_ms"], r["ms"]
            unslowed = pred.get("captured_unslowed", pred["captured"])
            cross = r.get("predicted_steady_ms", pred)  # steady-state inputs where recorded
            return (f"{r['scenario']:<26} {pred['captured']:>9.3f} {unslowed:>9.3f} "
                    f"{ms['captured']:>9.3f} {r['captured_vs_predicted']:>6.3f} "
                    f"{ms['captured'] / unslowed:>6.3f} {cross['cross']:>10.3f} "
                    f"{r['steady_ms']['cross']:>12.3f} {r['steady_cross_vs_predicted']:>6.3f} "
                    f"{pred.get('slowdown', 0.0):>8.3f} {cross.get('slowdown', 0.0):>8.3f} "
                    f"{1000 * pred.get('handoff_ms', 0.0):>10.2f}")

        lines += [""] + _section(
            f"{'placement model':<26} {'predicted':>9} {'unslowed':>9} {'captured':>9} "
            f"{'/pred':>6} {'/unsl':>6} {'pred cross':>10} {'steady cross':>12} {'/pred':>6} "
            f"{'slowdown':>8} {'steady':>8} {'handoff us':>10}",
            [row(r) for r in placed],
            "predicted: the placement model (what offload {count: N} places by) from this run's "
            "gather-only and compute-only times spread evenly over the layers, charging "
            "`slowdown` ms per ms of compute beside a copy (measured: gather and compute graphs "
            "side by side) and `handoff` per copy/compute dependency (measured: sync graph - "
            "gather-only - compute-only, per hand-off); unslowed: the same without the "
            "slowdown, as the placement search sees it; pred cross and the steady slowdown from "
            "compute-only and beside back to back")
    return "\n".join(lines)


def merge(parts: list[Path], out: Path) -> str:
    """Join per-scenario JSON files (one process per scenario) into one; return the table."""
    docs = [json.loads(p.read_text()) for p in parts if p.exists()]
    if not docs:
        raise ConfigError(f"no bench results to merge: none of {[str(p) for p in parts]} exists")
    merged = {k: v for k, v in docs[0].items() if k != "results"}
    merged["command"] = "tools/gpu-bench (one `ringflow bench SCENARIO` process per scenario)"
    merged["results"] = [r for d in docs for r in d["results"]]
    records.write(out, merged)
    return table(merged["results"])


def bench(names: list[str], *, json_path: Path | None, plot_dir: Path | None,
          replays: int, trace_dir: Path | None = None) -> int:
    names = names or list(SCENARIOS)
    for name in names:
        if name not in SCENARIOS:
            raise ConfigError(f"unknown scenario '{name}'; scenarios: {', '.join(SCENARIOS)}")
    if plot_dir is not None:
        from ringflow.bench.timeline import require_matplotlib

        require_matplotlib("--plot")
    if not torch.cuda.is_available():
        raise DeviceError("ringflow bench measures on a GPU and no CUDA device was found; run it "
                            "on a GPU machine")
    for folder in (plot_dir, trace_dir):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    for name in names:
        results += run_scenario(name, replays=replays, timeline_dir=plot_dir, trace_dir=trace_dir)
        _say(table([results[-1].to_dict()]).splitlines()[-2])
    if json_path is not None:
        records.write(json_path, records.record("ringflow", replays=replays,
                                                results=[r.to_dict() for r in results]))
        _say(f"wrote {json_path}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table([r.to_dict() for r in results]))
    return 0 if all(all(r.equal.values()) for r in results) else 1
