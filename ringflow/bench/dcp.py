"""dcp-allgather: MLA decode whose full compressed KV is all-gathered across a DCP group one or
more layers ahead of the attention that reads it (the motivating work: TP8/DCP4, +7.9% at 400k).

    python -m ringflow.bench.dcp [--world N] [--contexts 65536 409600] [--layers 61]
        [--batch 1] [--heads 16] [--extra-gemm 16384] [--depths 1 2] [--replays 10]
        [--transports nccl peer] [--json FILE] [--plot DIR]

One process per GPU (``--world`` GPUs of one host). Every rank holds its DCP shard of each
request's KV (576 bf16 per token, vLLM's interleave of 1) in a paged cache; a layer's gather
fills a slot with the full KV in sequence order, per transport: ``nccl`` (pack this rank's
rows, all-gather the parts over the gather lane's own communicator, restore the order:
``ringflow.kernels.dcp_all_gather``) or ``peer`` (write this rank's rows into their places in
its slot, then copy engines pull the peers' rows from their slots in symmetric memory with 2-D
copies straight into place: ``ringflow.kernels.dcp_gather`` with a ``PeerExchange``); the
layer's compute is an absorbed-MLA decode attention of ``--heads`` heads over the gathered KV
plus a ``--extra-gemm``-square GEMM standing for the rest of the layer (projections, MLP/MoE).
Two caches alternate between layers, so a gather of the wrong layer shows.

Variants per transport, each captured into a CUDA graph and replayed interleaved (medians):
``sync`` (depth 0: gather then compute on one stream), ``ringflow dN`` (depth N), ``gather``
alone, ``exchange`` alone (only the bytes between GPUs: with ``peer`` that is the copy-engine
floor, reported in GB/s received per rank), and ``compute`` alone (max of gather and compute is
the ideal). Reported per context: ms per forward, hidden = (sync −
ringflow) / min(gather, compute), decode tokens/s per GPU, pool bytes and the KV tokens the pool
costs (pool bytes over one token's KV on one rank: layers × 1152 B / world). Before timing, one
eager forward checks every layer's slot against the full KV (bit-exact), for every variant.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from ringflow.bench import records
from ringflow.bench.hand_ring import Graphed
from ringflow.errors import ConfigError, DeviceError, MeasurementError, RingflowError
from ringflow.testing.dcp import BLOCK, ROW, full_kv, shard
from ringflow.timing import forward_spans, interleaved_ms, stamped
from ringflow.units import MIB


class Model:
    """The per-rank decode model: attention over the gathered KV plus a square GEMM per layer."""

    def __init__(self, args, batch: int, context: int, device) -> None:
        gen = torch.Generator(device=device).manual_seed(5)
        self.layers, self.batch, self.context = args.layers, batch, context
        self.q = torch.randn(batch, args.heads, ROW, generator=gen, device=device).to(torch.bfloat16)
        self.w = (torch.randn(args.extra_gemm, args.extra_gemm, generator=gen, device=device)
                  / args.extra_gemm ** 0.5).to(torch.bfloat16) if args.extra_gemm else None
        self.x = torch.randn(max(batch, 16), args.extra_gemm or 1, generator=gen,
                             device=device).to(torch.bfloat16)
        self.out = torch.empty(2, batch, args.heads, 512, dtype=torch.bfloat16, device=device)
        self.y = torch.empty_like(self.x)

    def compute(self, layer: int, kv: torch.Tensor) -> None:
        kv = kv[: self.batch * self.context].view(self.batch, self.context, ROW)
        scores = torch.einsum("bhd,bcd->bhc", self.q, kv) * ROW ** -0.5
        torch.bmm(torch.softmax(scores.float(), dim=-1).to(kv.dtype), kv[..., :512],
                  out=self.out[layer % 2])
        if self.w is not None:
            torch.mm(self.x, self.w, out=self.y)


def _rank(rank: int, world: int, args) -> None:
    import torch.distributed as dist

    from ringflow.integrations.torch.kv_prefetch import DcpGroup, KVLayout, KVPrefetcher, KVSource

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    lane_group = dist.new_group(list(range(world)))  # the gather lane's own communicator
    rows = []
    for context in args.contexts:
        batch = args.batch
        fulls = [full_kv(batch, context, seed, device) for seed in (1, 2)]
        shards = [shard(f, batch, context, rank, world) for f in fulls]
        lens = torch.full((batch,), context, device=device, dtype=torch.int32)
        model = Model(args, batch, context, device)
        layout = KVLayout("rows", (ROW,), torch.bfloat16, BLOCK)

        def source(layer: int) -> KVSource:
            cache, table = shards[layer % 2]
            return KVSource(cache, table, lens, batch * context)

        def forward_with(pf):
            def forward() -> None:
                for layer in range(args.layers):
                    pf.begin(layer, source)
                    model.compute(layer, pf.gathered(layer))
                    pf.end(layer)
            return forward

        def prefetcher(depth: int, transport: str, name: str) -> KVPrefetcher:
            pf = KVPrefetcher(layout, batch * context, max_requests=batch, depth=depth,
                              workspace_bytes=1 << 40, device=device, name=name,
                              dcp=DcpGroup(lane_group, world, rank, transport=transport))
            if pf.transport.name != transport:
                raise MeasurementError(f"DCP transport {transport!r} fell back to "
                                       f"{pf.transport.name!r} ({pf.transport.fallback}), so "
                                       f"its rows would measure {pf.transport.name}; drop "
                                       f"{transport} from --transports, or run where symmetric "
                                       f"memory works")
            return pf

        variants, pools, prefetchers = {}, {}, {}
        for transport in args.transports:
            for depth in [0, *args.depths]:
                pf = prefetcher(depth, transport, f"dcp-d{depth}-{transport}")
                pf.plan(args.layers)
                _check(pf, source, fulls, args.layers)
                name = f"{'sync' if depth == 0 else f'ringflow d{depth}'}/{transport}"
                variants[name] = Graphed(forward_with(pf))
                pools[name] = pf.reserved_bytes
                prefetchers[transport] = pf  # the deepest: its ring has two slots at least
            variants[f"gather/{transport}"] = Graphed(_gather_only(prefetchers[transport], source,
                                                                  args.layers))
            variants[f"exchange/{transport}"] = Graphed(_exchange_only(prefetchers[transport],
                                                                      args.layers))
        slot = prefetchers[args.transports[0]].pool.storage

        def compute_only() -> None:
            for layer in range(args.layers):
                model.compute(layer, slot[layer % 2])

        if args.plot:  # every rank takes part (the gathers are collectives); rank 0 plots
            for transport in args.transports:
                pf = prefetcher(args.depths[0], transport, f"timeline-{transport}")
                spans = _timeline(pf, model, source, args.layers)
                del pf
                if rank == 0:
                    from ringflow.bench.timeline import plot_timeline
                    Path(args.plot).mkdir(parents=True, exist_ok=True)
                    plot_timeline(spans, Path(args.plot) /
                                  f"dcp-allgather-{context}-{records.gpu_slug()}x{world}-"
                                  f"{transport}.png",
                                  title=f"dcp-allgather over {transport}, {world} GPU(s), "
                                        f"context {context:,}: one forward, ringflow eager, "
                                        f"depth {args.depths[0]}")
        variants["compute"] = Graphed(compute_only)
        result = interleaved_ms({name: graph.run for name, graph in variants.items()},
                                args.replays, warmup=2)
        pf = prefetchers[args.transports[0]]
        out = pf.pool.storage[0][: pf.capacity]  # either transport moves the peers' rows of it
        rows.append({"context": context, "batch": batch, "rank": rank, "ms": result,
                     "pool_bytes": pools, "exchange_bytes": (world - 1) * out.nbytes // world})
        del variants, fulls, prefetchers
        shards = slot = None  # the closures above hold them until the next context
        torch.cuda.empty_cache()
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        _report(args, world, everyone)


def _gather_only(pf, source, layers: int):
    """Each layer's gather into alternating slots of ``pf``'s ring, with no compute."""
    def run() -> None:
        for layer in range(layers):
            pf.gather_into(layer % 2, source(layer))
    return run


def _exchange_only(pf, layers: int):
    """Only the exchange of the parts (what NCCL or the copy engines move), per layer."""
    def run() -> None:
        for layer in range(layers):
            pf.exchange_into(layer % 2)
    return run


def _timeline(pf, model, source, layers: int) -> list[dict]:
    """Gather and compute spans of one eager forward (after a warm-up), on one clock."""
    marks: list = []
    pf.plan(layers, wrap_gather=lambda gather: stamped("gather", gather, marks))
    compute = stamped("compute", lambda layer, lane, kv: model.compute(layer, kv), marks)

    def forward():
        for layer in range(layers):
            pf.begin(layer, source)
            compute(layer, "kv", pf.gathered(layer))
            pf.end(layer)

    return forward_spans(forward, marks)


def _check(pf, source, fulls, layers: int) -> None:
    """One eager forward: every layer's slot equals that layer's full KV, bit for bit."""
    bad = []
    for layer in range(layers):
        pf.begin(layer, source)
        lens = source(layer).context_lens
        got, full = pf.gathered(layer), fulls[layer % 2].view(len(lens), -1, ROW)
        for start, want in zip(pf.request_starts(lens).tolist(), full):
            if not torch.equal(got[start: start + want.shape[0]], want):
                bad.append(layer)
                break
        pf.end(layer)
    if bad:
        raise MeasurementError(f"DCP all-gather: the slots of layers {bad} differ from the full "
                               f"KV; the measurement is void (report this with the command "
                               f"line)")


def _report(args, world: int, everyone) -> None:
    results = []
    for i, context in enumerate(args.contexts):
        per_rank = [rows[i] for rows in everyone]
        ms = {k: max(r["ms"][k] for r in per_rank) for k in per_rank[0]["ms"]}  # slowest rank
        compute = ms["compute"]
        moved = per_rank[0]["exchange_bytes"]
        entry = {"context": context, "batch": args.batch, "layers": args.layers, "world": world,
                 "ms": ms, "exchange_bytes_per_layer": moved, "transports": {}}
        token_bytes = args.layers * ROW * 2 / world   # one token's KV on one rank
        for transport in args.transports:
            gather, sync = ms[f"gather/{transport}"], ms[f"sync/{transport}"]
            exchange = ms[f"exchange/{transport}"]
            t_entry = {"sync_ms": sync, "gather_ms": gather, "exchange_ms": exchange,
                       "exchange_gb_per_s": moved * args.layers / exchange / 1e6 if moved else None,
                       "ideal_ms": max(gather, compute),
                       "sync_tokens_per_s_per_gpu": 1000 * args.batch / sync / world,
                       "sync_pool_bytes": per_rank[0]["pool_bytes"][f"sync/{transport}"],
                       "variants": {}}
            for name in ms:
                if name.startswith("ringflow") and name.endswith(f"/{transport}"):
                    t = ms[name]
                    pool = per_rank[0]["pool_bytes"][name]
                    t_entry["variants"][name.split("/")[0]] = {
                        "ms": t, "speedup_vs_sync": sync / t, "vs_ideal": t / max(gather, compute),
                        "gather_hidden_pct": 100 * (sync - t) / max(min(gather, compute), 1e-9),
                        "tokens_per_s_per_gpu": 1000 * args.batch / t / world,
                        "pool_bytes": pool, "kv_tokens_displaced": int(pool // token_bytes)}
            entry["transports"][transport] = t_entry
        results.append(entry)
    doc = records.record("python -m ringflow.bench.dcp", gpus=world, replays=args.replays,
                         heads=args.heads, extra_gemm=args.extra_gemm, results=results)
    print(_table(results))
    if args.json:
        records.write(args.json, doc)


def _table(results) -> str:
    lines = [f"{'context':>8} {'transport':<9} {'variant':<12} {'ms':>9} {'x sync':>7} "
             f"{'/ideal':>7} {'hidden':>7} {'tok/s/GPU':>10} {'pool MiB':>9} {'KV tokens':>10}"]
    for e in results:
        for transport, t in e["transports"].items():
            lines.append(f"{e['context']:>8} {transport:<9} {'sync':<12} {t['sync_ms']:>9.3f} "
                         f"{'1.00x':>7} {t['sync_ms'] / t['ideal_ms']:>7.3f} {'-':>7} "
                         f"{t['sync_tokens_per_s_per_gpu']:>10.1f} "
                         f"{t['sync_pool_bytes'] / MIB:>9.1f} {'-':>10}")
            for name, v in t["variants"].items():
                lines.append(f"{e['context']:>8} {transport:<9} {name:<12} {v['ms']:>9.3f} "
                             f"{v['speedup_vs_sync']:>6.2f}x {v['vs_ideal']:>7.3f} "
                             f"{v['gather_hidden_pct']:>6.1f}% {v['tokens_per_s_per_gpu']:>10.1f} "
                             f"{v['pool_bytes'] / MIB:>9.1f} {v['kv_tokens_displaced']:>10,}")
            rate = (f", {t['exchange_gb_per_s']:.0f} GB/s received per rank"
                    if t["exchange_gb_per_s"] else "")
            lines.append(f"{'':>8} {transport:<9} gather alone {t['gather_ms']:.3f} ms, exchange "
                         f"alone {t['exchange_ms']:.3f} ms{rate}")
        lines.append(f"{'':>8} compute alone {e['ms']['compute']:.3f} ms")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from ringflow.arguments import Parser, non_negative, positive

    parser = Parser(prog="python -m ringflow.bench.dcp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=positive, default=torch.cuda.device_count() or 1,
                        help="GPUs of this host, one process each, in one DCP group (>= 1; "
                             "default: every visible GPU)")
    parser.add_argument("--contexts", type=positive, nargs="+", default=[65536, 409600],
                        metavar="TOKENS", help="context lengths to measure, one table row group "
                                               "each (default 65536 409600)")
    parser.add_argument("--layers", type=positive, default=61,
                        help="decoder layers per forward (default 61)")
    parser.add_argument("--batch", type=positive, default=1,
                        help="decode requests per step, each of the full context (default 1)")
    parser.add_argument("--heads", type=positive, default=16,
                        help="attention heads of the absorbed-MLA compute (default 16)")
    parser.add_argument("--extra-gemm", type=non_negative, default=16384, metavar="N",
                        help="side of the square GEMM standing for the rest of each layer; 0 "
                             "for none (default 16384)")
    parser.add_argument("--depths", type=positive, nargs="+", default=[1, 2],
                        help="ringflow lookaheads to time, each >= 1; depth 0 (the sync "
                             "variant) is always measured (default 1 2)")
    parser.add_argument("--transports", nargs="+", choices=["nccl", "peer"],
                        default=["nccl", "peer"],
                        help="how the ranks' parts are exchanged, each measured (default: nccl "
                             "peer; peer is copy engines over symmetric memory)")
    parser.add_argument("--replays", type=positive, default=10,
                        help="timed replays of each variant, interleaved (default 10)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--plot", metavar="DIR", help="write one timeline PNG per context to DIR "
                                                      "(needs matplotlib)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.plot:
        from ringflow.bench.timeline import require_matplotlib

        require_matplotlib("--plot")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found == 0:
        raise DeviceError("it measures on CUDA GPUs and no CUDA device was found; run it on a "
                          "GPU machine (--world N GPUs of one host)")
    if found < args.world:
        raise DeviceError(f"--world {args.world} needs {args.world} CUDA GPUs of one host and "
                          f"this one has {found}; lower --world to {found} or run it on a "
                          f"larger machine")
    if args.batch > 1 and any(c % args.world for c in args.contexts):
        raise ConfigError(f"with --batch {args.batch} the compute reads the requests packed, "
                          f"which a DCP slot is only when every context is a multiple of "
                          f"--world {args.world}; pick such contexts or --batch 1")
    from ringflow.testing.spawn import spawn_group
    with tempfile.TemporaryDirectory() as tmp:
        spawn_group(args.world, _rank, args, backend="nccl", rendezvous=f"{tmp}/rdzv")


if __name__ == "__main__":
    try:
        main()
    except RingflowError as exc:
        print(f"ringflow.bench.dcp: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
