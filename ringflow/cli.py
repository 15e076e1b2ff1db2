"""The ``ringflow`` command.

``plan`` prints or writes a profile's Dag and budget arithmetic (no GPU needed); ``run`` drives
the built-in synthetic workload through the executors and prints a table; ``bench`` and
``tune`` measure on a GPU (see ringflow/bench/scenarios.py).

Bad input gets one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

from ringflow.arguments import Parser, non_negative, positive
from ringflow.errors import (CaptureError, ConfigError, DeviceError, OutputError, ProfileError,
                             RingflowError)
from ringflow.orchestrator.dumps import DOT_FULL_MAX_LAYERS
from ringflow.units import mib

log = logging.getLogger("ringflow")


_DESCRIPTION = ("Plan, prove and run per-layer prefetch: while layer l computes, the data layer "
                "l + depth needs is gathered on a side stream into a bounded ring of "
                "preallocated slots.")
_EPILOG = ("PROFILE is a profile YAML path or a built-in name: {names} (profiles/README.md "
           "documents every field). 'ringflow COMMAND --help' lists a command's options. A "
           "mistake prints one line on stderr and exits with status 2.")


def _builtin_names() -> str:
    from ringflow.orchestrator.profile import builtin_profiles

    return ", ".join(builtin_profiles())


def _parser() -> argparse.ArgumentParser:
    from ringflow import __version__
    from ringflow.bench.names import SCENARIOS

    names = _builtin_names()
    parser = Parser(prog="ringflow", description=_DESCRIPTION,
                     epilog=_EPILOG.format(names=names))
    parser.add_argument("--version", action="version", version=f"ringflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser,
                                title="commands", metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("profile", help=f"a profile YAML path, or a built-in name ({names})")
        p.add_argument("--layers", type=positive, help="override the profile's layer count")
        p.add_argument("--depth", type=non_negative, help="override the profile's depth")

    plan = sub.add_parser("plan", help="print or write a profile's plan (the Dag of gather, "
                                       "compute and event nodes) and its budget arithmetic; no "
                                       "GPU needed")
    common(plan)
    plan.add_argument("--format", choices=("text", "json", "dot"), default="text",
                      help="text: the budget arithmetic and a table of every node (default); "
                           "json: the versioned dump (schema ringflow.dag), which from_json "
                           "reads back; dot: Graphviz, one cluster per stream, plans of more "
                           f"than {DOT_FULL_MAX_LAYERS} layers condensed (see --full)")
    plan.add_argument("--full", action="store_true",
                      help=f"with --format dot: draw every node even past "
                           f"{DOT_FULL_MAX_LAYERS} layers (Graphviz may take minutes)")
    plan.add_argument("--out", type=Path, help="write here instead of stdout")
    plan.add_argument("--cuda-graph-dot", type=Path, metavar="FILE",
                      help="also capture the synthetic workload on the GPU and write the real "
                           "CUDA graph's DOT to FILE (needs a CUDA GPU)")

    place = sub.add_parser("place", help="choose which layers to offload (a profile's "
                                         "offload.layers: {count: N}): the placement, its "
                                         "predicted forward time and simple patterns' for "
                                         "comparison; no GPU needed")
    place.add_argument("--layers", type=positive, required=True, help="decoder layers")
    place.add_argument("--count", type=positive, required=True, help="layers to offload")
    place.add_argument("--slots", type=positive, default=2, help="ring slots (depth + 1)")
    place.add_argument("--compute-ms", required=True, type=_times,
                       help="per-layer compute time: one value, or one per layer (commas)")
    place.add_argument("--copy-ms", required=True, type=_times,
                       help="per-layer weight copy time: one value, or one per layer (commas)")
    place.add_argument("--no-cross-forward", action="store_true",
                       help="copies start with their forward (offload.cross_forward: false)")
    place.add_argument("--slowdown", type=float, default=0.0,
                       help="ms of compute lost per ms beside a copy, charged in the predicted "
                            "times (ringflow bench measures it per scenario; Note [Placement "
                            "model]); the choice itself does not depend on it (default 0)")
    place.add_argument("--handoff-ms", type=float, default=0.0,
                       help="latency of one copy/compute dependency, charged in the predicted "
                            "times (ringflow bench measures it from its sync graph; it matters "
                            "for layers of microseconds); the choice does not use it (default 0)")

    experts = sub.add_parser("place-experts", help="predict a MoE decode step with routed "
                                                   "experts fetched into a GPU cache: misses "
                                                   "from a hit rate or a simulated routing, "
                                                   "times from the measured fetch rate; no GPU "
                                                   "needed")
    experts.add_argument("--layers", type=positive, default=48, help="MoE layers (default 48)")
    experts.add_argument("--expert-layers", type=positive,
                         help="layers whose experts live in host memory (default: all)")
    experts.add_argument("--experts", type=positive, default=128,
                         help="routed experts per layer (default 128)")
    experts.add_argument("--top-k", type=positive, default=8, help="experts per token (8)")
    experts.add_argument("--slots", type=positive, default=32,
                         help="cached experts per layer (default 32: a quarter of 128)")
    experts.add_argument("--tokens", type=positive, default=1, help="tokens per step (1)")
    experts.add_argument("--expert-mib", type=float, default=9.0,
                         help="MiB of one expert (default 9.0: Qwen3-30B-A3B in bf16)")
    experts.add_argument("--compute-ms", type=float, default=0.1,
                         help="per-layer compute of a step, all resident (default 0.1)")
    experts.add_argument("--hit-rate", type=float,
                         help="the cache's hit rate, measured; without it, simulated")
    experts.add_argument("--zipf", type=float, default=1.0,
                         help="routing skew of the simulation (0: uniform; default 1)")
    experts.add_argument("--steps", type=positive, default=200,
                         help="simulated steps (default 200)")
    experts.add_argument("--host-rates", metavar="JSON",
                         help="the host's measured rates (tools/host_rates.py --out): also "
                              "predict the step with each layer's misses split between the "
                              "copy and the CPU (Note [Host split])")

    run = sub.add_parser("run", help="run the synthetic workload through the executors and "
                                     "check them against a reference (on a CPU: the "
                                     "synchronous path)")
    common(run)
    run.add_argument("--forwards", type=positive, default=5, help="timed forwards (default 5)")

    bench = sub.add_parser("bench", help="measure ringflow against the synchronous path and a "
                                         "hand-written ring on the scenarios of profiles/bench/ "
                                         "(needs a GPU)")
    bench.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                       help=f"{', '.join(SCENARIOS)} (default: all)")
    bench.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    bench.add_argument("--plot", type=Path, metavar="DIR",
                       help="write a timeline PNG per scenario (needs matplotlib)")
    bench.add_argument("--trace", type=Path, metavar="DIR",
                       help="write a Chrome/Perfetto trace (SCENARIO.trace.json) of one forward "
                            "per scenario")
    bench.add_argument("--replays", type=positive, default=15, help="timed replays (default 15)")

    trace = sub.add_parser("trace", help="write a Chrome/Perfetto trace of every timeline in a "
                                         "`ringflow bench --json` file (no GPU needed)")
    trace.add_argument("results", type=Path, metavar="FILE",
                       help="a bench results JSON: a path, or the name of one shipped with "
                            "ringflow (profiles/results/, e.g. bench-h200.json)")
    trace.add_argument("--out", type=Path, default=Path("."), metavar="DIR",
                       help="where the SCENARIO.trace.json files go (default: here)")

    tune = sub.add_parser("tune", help="measure every depth that fits a profile's budget and "
                                       "write a copy with the fastest (needs a GPU)")
    tune.add_argument("profile", help=f"a profile YAML path, or a built-in name ({names})")
    tune.add_argument("--out", type=Path, help="where to write the tuned copy "
                                               "(default: <name>.tuned.yaml here)")
    tune.add_argument("--replays", type=positive, default=10,
                      help="timed replays of each depth (default 10)")
    tune.add_argument("--max-depth", type=non_negative, default=3,
                      help="deepest ring to try (default 3)")
    return parser


def _profile(args: argparse.Namespace):
    from ringflow.orchestrator.profile import Profile

    profile = Profile.load(args.profile)
    if profile.layers is None and args.command == "run":
        raise ProfileError(None, _vllm_only(args.profile, profile), profile.source)
    profile.require_run_fields()  # `plan` explains a vLLM-only profile
    changes = {k: v for k, v in (("layers", args.layers), ("depth", args.depth)) if v is not None}
    return profile.replace(**changes) if changes else profile


def _vllm_only(ref: str, profile) -> str:
    """Why ``ringflow run`` cannot run a profile with only vLLM sections, and what can."""
    from ringflow.orchestrator.profile import Profile, builtin_profiles
    from ringflow.orchestrator.schema import RUN_FIELDS

    runnable = ", ".join(name for name in builtin_profiles()
                         if Profile.load(name).layers is not None)
    return (f"profile '{profile.name}' has only vLLM sections ({profile.vllm_sections_text}), "
            f"which the vLLM plugin plans from the model it loads: use it with "
            f"`RINGFLOW_PROFILE={ref} python -m vllm.entrypoints.openai.api_server --model "
            f"MODEL` (`vllm serve MODEL` on vLLM's CUDA build; `ringflow plan {ref}` "
            f"explains); `ringflow run` needs a profile with {RUN_FIELDS}, such as {runnable}")


def _cmd_plan(args: argparse.Namespace) -> int:
    from ringflow.orchestrator import dumps
    from ringflow.orchestrator.planner import Planner

    if args.full and args.format != "dot":
        raise ConfigError("--full applies to --format dot only; add --format dot or drop --full")
    if args.cuda_graph_dot is not None:
        _require_gpu()  # before the plan is printed, not after
    profile = _profile(args)
    dag = Planner.from_profile(profile).plan()
    if args.format == "json":
        text = dumps.to_json(dag)
    elif args.format == "dot":
        text = dumps.to_dot(dag, full=True if args.full else None)
    else:
        text = dumps.to_text(dag, profile.kv_token_bytes)
    if args.out is None:
        sys.stdout.write(text)
    else:
        try:
            args.out.write_text(text)
        except OSError as exc:
            raise OutputError(f"cannot write {args.out}: {exc.strerror}") from exc
        for line in dumps.budget_lines(dag, profile.kv_token_bytes):
            print(line)
        condensed = args.format == "dot" and dumps.condenses(dag, True if args.full else None)
        note = ", condensed: --full draws every node" if condensed else ""
        print(f"wrote {args.format} plan ({len(dag.nodes)} nodes{note}) to {args.out}")
    if args.cuda_graph_dot is not None:
        _write_cuda_graph_dot(profile, dag, args.cuda_graph_dot)
    return 0


def _times(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or a comma list of "
                                         f"numbers (milliseconds)") from None
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: times must be finite and >= 0")
    return values


def _cmd_place(args: argparse.Namespace) -> int:
    from ringflow.orchestrator.placement import choose, forward_ms

    def per_layer(values: list[float], name: str) -> list[float]:
        if len(values) == 1:
            return values * args.layers
        if len(values) != args.layers:
            raise ConfigError(f"{name} has {len(values)} values for {args.layers} layers; give "
                              f"one value or one per layer")
        return values

    compute = per_layer(args.compute_ms, "--compute-ms")
    copy = per_layer(args.copy_ms, "--copy-ms")
    cross = not args.no_cross_forward
    placed = choose(compute, copy, args.count, args.slots, cross)

    def predict(layers) -> float:
        return forward_ms(compute, copy, layers, args.slots, cross, args.slowdown,
                          args.handoff_ms)

    ms = predict(placed.layers)
    print(f"offload.layers {{count: {args.count}}} of {args.layers} through {args.slots} "
          f"slot(s): layers {list(placed.layers)}")
    print(f"predicted forward {ms:.3f} ms; all resident {placed.resident_ms:.3f} "
          f"ms ({ms / placed.resident_ms:.3f}x)"
          + (f", charging {args.slowdown} ms per ms beside a copy" if args.slowdown else "")
          + (f", {args.handoff_ms} ms per copy/compute hand-off" if args.handoff_ms else ""))
    rivals = {"the last layers": list(range(args.layers - args.count, args.layers))}
    if args.layers % args.count == 0 and args.count > 1:
        every = args.layers // args.count
        rivals[f"{{every: {every}, last: 1}}"] = [i for i in range(args.layers)
                                                  if i % every == every - 1]
    every = 2 * args.layers // args.count  # the same count as pairs of adjacent layers
    if args.count % 2 == 0 and every > 2 and args.layers % every == 0:
        rivals[f"{{every: {every}, last: 2}}"] = [i for i in range(args.layers)
                                                  if i % every >= every - 2]
    for name, layers in rivals.items():
        ms = predict(layers)
        print(f"  {name}: {ms:.3f} ms ({ms / placed.resident_ms:.3f}x)")
    return 0


def _cmd_place_experts(args: argparse.Namespace) -> int:
    from ringflow.integrations.torch.expert_cache import simulate_hit_rate
    from ringflow.orchestrator.expert_model import predict
    from ringflow.orchestrator.host_split import HostRates
    if args.slots > args.experts:
        raise ConfigError(f"--slots {args.slots} exceeds --experts {args.experts}")
    rates = HostRates.load(args.host_rates) if args.host_rates else None
    distinct = None
    if args.hit_rate is None:
        args.hit_rate, distinct = simulate_hit_rate(args.experts, args.top_k, args.slots, args.tokens,
                                           args.steps, args.zipf)
        source = f"simulated over {args.steps} steps, zipf {args.zipf}"
    else:
        source = "given"
    step = predict(layers=args.layers, expert_layers=args.expert_layers or args.layers,
                   experts=args.experts, top_k=args.top_k, tokens=args.tokens,
                   expert_bytes=int(args.expert_mib * 2**20), compute_ms=args.compute_ms,
                   hit_rate=args.hit_rate, distinct=distinct)
    resident = args.layers * args.compute_ms
    print(f"{args.slots} of {args.experts} experts cached per layer, {args.tokens} token(s) "
          f"per step, top-{args.top_k}: hit rate {args.hit_rate:.3f} ({source}); "
          f"{step.distinct:.1f} experts asked, {step.misses:.2f} fetched per layer "
          f"({step.fetch_ms:.3f} ms)")
    rows = [("predicted step", step.step_ms), ("missed-bytes bound", step.bound_ms),
            ("whole-layer streaming", step.whole_layer_ms), ("all resident", resident)]
    if rates is not None:
        rows.insert(1, _host_split_row(args, step, rates))
    for name, ms in rows:
        print(f"  {name}: {ms:.3f} ms ({1e3 * args.tokens / ms:.1f} tok/s)")
    return 0


def _host_split_row(args: argparse.Namespace, step, rates) -> tuple[str, float]:
    """The step with each expert layer's misses split between the copy and the host's CPU
    (Note [Host split]), and a line saying the split."""
    from ringflow.orchestrator.host_split import split
    expert_bytes = int(args.expert_mib * 2**20)
    best = split(max(0, round(step.misses)), args.tokens * args.top_k / step.distinct,
                 expert_bytes, rates)
    layers = args.expert_layers or args.layers
    ms = args.layers * args.compute_ms + layers * best.ms
    print(f"host ({rates.extra.get('host', {}).get('cpu', 'unknown CPU')}, {rates.threads} "
          f"threads, {rates.cpu_ms(1, expert_bytes):.3f} ms per expert at 1 token, handoff "
          f"{rates.handoff_ms:.3f} ms): of {best.misses} misses per layer, {best.to_host} on "
          f"the CPU and {best.copied} copied: {best.ms:.3f} ms against {best.copy_ms:.3f} ms "
          f"copying all ({best.gain:.2f}x)")
    return "predicted step, host split", ms


def _require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("--cuda-graph-dot captures the plan on a GPU, and no CUDA device was "
                            "found; run it on a GPU machine, or drop the option")


def _write_cuda_graph_dot(profile, dag, path: Path) -> None:
    import torch

    from ringflow.graphs.captured import CapturedExecutor
    from ringflow.graphs.graph_view import read_graph, write_dot
    from ringflow.graphs.slots import SlotPool
    from ringflow.bench.workload import SyntheticWorkload

    pools = [SlotPool.for_profile(profile, lane, "cuda") for lane in profile.lanes]
    work = SyntheticWorkload(profile, "cuda")
    ex = CapturedExecutor(dag, pools, work.gather, work.compute, keep_graph=True,
                          gather_priority=profile.gather_priority, capture=profile.capture)
    graph = ex.capture()
    if graph is None:
        raise CaptureError("the plan could not be captured (see the log line above); run "
                           "`ringflow run` with the same profile to see the failing callable")
    try:
        write_dot(graph, str(path))
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc}") from exc
    view = read_graph(graph)
    counts = {}
    for node in view.nodes:
        counts[node.type] = counts.get(node.type, 0) + 1
    summary = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    print(f"wrote the captured CUDA graph ({summary}; {len(view.edges)} edges) to {path}",
          file=sys.stderr)
    torch.cuda.synchronize()
    for pool in pools:
        pool.close()


#: a forward slower than this (seconds) is reported as it finishes: a large profile on a CPU
PROGRESS_AFTER_S = 2.0


def _time_forwards(executor, forwards: int, cuda: bool) -> list[float]:
    """Milliseconds of each of ``forwards`` forwards, sorted; a slow one is logged as it ends."""
    from ringflow.timing import elapsed_ms

    times = []
    for i in range(forwards):
        if cuda:
            times.append(elapsed_ms(executor.run))
        else:
            t0 = time.perf_counter()
            executor.run()
            times.append((time.perf_counter() - t0) * 1e3)
        if times[-1] > PROGRESS_AFTER_S * 1e3:
            log.info("%s: forward %d of %d took %.1f s", executor.kind, i + 1, forwards,
                     times[-1] / 1e3)
    return sorted(times)


def _cmd_run(args: argparse.Namespace) -> int:
    import torch

    from ringflow.graphs.captured import CapturedExecutor
    from ringflow.graphs.eager import EagerExecutor
    from ringflow.graphs.sync import SyncExecutor
    from ringflow.orchestrator.planner import Planner
    from ringflow.graphs.slots import SlotPool
    from ringflow.bench.workload import SyntheticWorkload

    profile = _profile(args)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    if not cuda:
        log.warning("no CUDA device found; running the synchronous path (SyncExecutor) on the CPU")
    pools = [SlotPool.for_profile(profile, lane, device) for lane in profile.lanes]
    dag = Planner.from_profile(profile).plan()
    gathered = set(range(profile.layers)) if profile.gathered_layers is None \
        else set(profile.gathered_layers)
    kinds = 3 if cuda else 1
    log.info("profile '%s': each forward gathers %s (%d layer(s) x %d lane(s) of %s); %d "
             "executor(s) x %d forwards, plus the reference", profile.name,
             mib(len(gathered) * len(profile.lanes) * pools[0].slot_bytes), len(gathered),
             len(profile.lanes), mib(pools[0].slot_bytes), kinds, 1 + args.forwards)
    work = SyntheticWorkload(profile, device)
    forwards = 1 + kinds * (1 + args.forwards)  # the reference, then each executor's
    t0 = time.perf_counter()
    reference = work.reference(gathered)
    took = time.perf_counter() - t0
    if took > PROGRESS_AFTER_S or not cuda:  # measured, never predicted from one layer
        log.info("the reference forward took %.1f s here; %d more forwards follow (about %.0f s "
                 "at that pace)", took, forwards - 1, took * (forwards - 1))

    executors = [SyncExecutor(dag, pools, work.gather, work.compute)]
    if cuda:
        options = dict(gather_priority=profile.gather_priority, capture=profile.capture)
        executors.append(EagerExecutor(dag, pools, work.gather, work.compute, **options))
        executors.append(CapturedExecutor(dag, pools, work.gather, work.compute, **options))
    rows = []
    for ex in executors:
        t0 = time.perf_counter()
        ex.run()  # warm-up, and the result we check
        first = time.perf_counter() - t0
        if first > PROGRESS_AFTER_S:
            log.info("%s: the first forward took %.1f s; %d timed forward(s) follow (about %.0f "
                     "s)", ex.kind, first, args.forwards, first * args.forwards)
        out = work.outputs()
        diff = max(float((out[k].float() - reference[k].float()).abs().max()) for k in out)
        same = all(torch.equal(out[k], reference[k]) for k in out)
        ms = _time_forwards(ex, args.forwards, cuda)
        rows.append((ex.kind, str(device), ms, diff, same))
    for pool in pools:
        pool.close()

    print(f"profile '{profile.name}': {profile.layers} layers, lanes {', '.join(profile.lanes)}, "
          f"depth {dag.pools[0].depth}, {profile.workload.gather} gather, pools "
          f"{mib(sum(p.reserved_bytes for p in dag.pools))}")
    header = f"{'executor':<9} {'device':<7} {'ms/forward':>11} {'min..max':>19} {'vs sync':>8} " \
             f"{'max|diff| vs reference':>23} {'bit-identical':>14}"
    print(header)
    print("-" * len(header))
    median = [ms[len(ms) // 2] for _, _, ms, _, _ in rows]
    for (kind, dev, ms, diff, same), mid in zip(rows, median):
        spread = f"{ms[0]:.3f}..{ms[-1]:.3f}"
        print(f"{kind:<9} {dev:<7} {mid:>11.3f} {spread:>19} {median[0] / mid:>7.2f}x "
              f"{diff:>23.3g} {str(same):>14}")
    print(f"ms/forward: median of {args.forwards} (min..max beside it); reference: the same "
          f"workload run straight, each layer gathering into a fresh buffer and then computing, "
          f"no plan and no ring; bit-identical: every output equal to the reference's")
    return 0 if all(r[4] for r in rows) else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from ringflow.bench.scenarios import bench

    return bench(args.scenarios, json_path=args.json, plot_dir=args.plot, replays=args.replays,
                 trace_dir=args.trace)


def _cmd_trace(args: argparse.Namespace) -> int:
    from ringflow.bench.timeline import traces_from_results

    results = args.results
    if not results.exists():  # a results file ringflow ships (profiles/results), by name
        from importlib import resources
        shipped = resources.files("ringflow.profiles").joinpath("results", results.name)
        if shipped.is_file():
            results = Path(str(shipped))
    for path in traces_from_results(results, args.out):
        print(f"wrote {path} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from ringflow.bench.tune import tune
    from ringflow.orchestrator.profile import Profile

    profile = Profile.load(args.profile).require_run_fields()
    out = args.out or Path(f"{profile.name}.tuned.yaml")
    return tune(profile, out=out, replays=args.replays, max_depth=args.max_depth)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    args = _parser().parse_args(argv)
    from ringflow import envs
    envs.warn_unknown(log)
    try:
        return {"plan": _cmd_plan, "place": _cmd_place, "place-experts": _cmd_place_experts, "run": _cmd_run, "bench": _cmd_bench,
                "trace": _cmd_trace, "tune": _cmd_tune}[args.command](args)
    except RingflowError as exc:
        print(f"ringflow: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader (head, less) closed the pipe: stop without a word
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not raise
        return 1
