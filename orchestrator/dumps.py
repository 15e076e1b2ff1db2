"""Dumps of a Dag: versioned JSON (round-trips), Graphviz DOT, and a text table.

JSON schema ``ringflow.dag`` version 2::

    {"schema": "ringflow.dag", "version": 2, "name": str, "layers": int,
     "pools": [{"lane", "pool", "slot_bytes", "slots", "requested_depth", "budget_bytes",
                "depth", "reserved_bytes"}],
     "streams": [str], "meta": {...},
     "nodes": [{"id", "kind", "stream", "lane", "layer", "slot", "event", "role", "forward",
                "nvtx"}],
     "prime": [nodes, as above],
     "edges": [{"src", "dst", "kind": "stream" | "event"}]}

Version 2 added ``forward`` (1: a gather of the next forward's lease) and ``prime`` (Note
[Forward boundary] in dag.py); version 1 dumps, which have neither, still load.

``nvtx``, ``depth``, ``reserved_bytes``, ``streams`` and ``edges`` are derived and written for
readers; :func:`from_json` rebuilds the Dag from the rest and checks they agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ringflow.errors import OutputError, PlanError
from ringflow.orchestrator.budget import PoolLayout
from ringflow.units import mib
from ringflow.orchestrator.dag import COMPUTE_STREAM, Dag, EventRole, Node, NodeKind

SCHEMA = "ringflow.dag"
VERSION = 2
_READS = (1, 2)


def _node_dict(n: Node) -> dict[str, Any]:
    return {"id": n.id, "kind": n.kind.value, "stream": n.stream, "lane": n.lane,
            "layer": n.layer, "slot": n.slot, "event": n.event,
            "role": None if n.role is None else n.role.value, "forward": n.forward,
            "nvtx": n.nvtx_name}


def _node(n: dict[str, Any]) -> Node:
    return Node(n["id"], NodeKind(n["kind"]), n["stream"], n["lane"], n["layer"], n["slot"],
                n["event"], None if n["role"] is None else EventRole(n["role"]),
                n.get("forward", 0))


def to_dict(dag: Dag) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "name": dag.name,
        "layers": dag.layers,
        "pools": [
            {"lane": p.lane, "pool": p.pool, "slot_bytes": p.slot_bytes, "slots": p.slots,
             "requested_depth": p.requested_depth, "budget_bytes": p.budget_bytes,
             "depth": p.depth, "reserved_bytes": p.reserved_bytes}
            for p in dag.pools
        ],
        "streams": list(dag.streams),
        "meta": dict(dag.meta),
        "nodes": [_node_dict(n) for n in dag.nodes],
        "prime": [_node_dict(n) for n in dag.prime],
        "edges": [{"src": e.src, "dst": e.dst, "kind": e.kind} for e in dag.edges],
    }


def to_json(dag: Dag, **extra: Any) -> str:
    """The versioned dump; ``extra`` keys join its top level (``write_files``' executor)."""
    return json.dumps({**to_dict(dag), **extra}, indent=1, sort_keys=True) + "\n"


def dump_stem(base: str, rank: int | None = None) -> str:
    """The file stem ``RINGFLOW_DUMP=base`` names: ``base`` without a ``.json`` ending, or, for
    a directory (one that exists, or a path ending in ``/``), ``ringflow-plan`` inside it (never
    the hidden ``dir/.json``); with ``rank`` (a worker among several: tensor parallelism),
    ``.rank<R>`` after it, so that the ranks never write one file."""
    if base.endswith(("/", "\\")) or Path(base).is_dir():
        stem = str(Path(base) / "ringflow-plan")
    else:
        stem = base[:-5] if base.endswith(".json") else base
    return stem if rank is None else f"{stem}.rank{rank}"


def write_json(path: str | Path, doc: Any,
               fix: str = "point RINGFLOW_DUMP at a writable path") -> Path:
    """``doc`` as indented JSON at ``path``: what ``RINGFLOW_DUMP`` writes besides plans, and
    every benchmark record (``ringflow/bench/records.py``); ``fix`` ends the error.

    Raises:
        OutputError: the file cannot be written (the OS error is the cause).
    """
    path = Path(path)
    try:
        path.write_text(json.dumps(doc, indent=1))
    except OSError as exc:
        raise OutputError(f"cannot write {path} ({exc.strerror or exc}); {fix}") from exc
    return path


def write_files(dag: Dag, stem: str, *, executor: str | None = None) -> tuple[Path, Path]:
    """``stem.json`` (the versioned dump) and ``stem.dot`` (Graphviz): what ``RINGFLOW_DUMP``
    writes. ``executor``: what ran the plan, when that is not what the plan alone says (a
    synchronous executor on a CPU runs every node on one stream): the JSON's ``executor``, and
    the Graphviz label.

    Raises:
        OutputError: either file cannot be written (the OS error is the cause).
    """
    paths = Path(f"{stem}.json"), Path(f"{stem}.dot")
    try:
        dot = to_dot(dag)
        if executor is not None:
            dot = dot.replace("{", f"{{\n  label={json.dumps('ran by: ' + executor)};", 1)
        paths[0].write_text(to_json(dag, **({"executor": executor} if executor else {})))
        paths[1].write_text(dot)
    except OSError as exc:
        raise OutputError(f"cannot write {paths[0]} and {paths[1]} ({exc.strerror or exc}); "
                          f"point RINGFLOW_DUMP at a writable path") from exc
    return paths


def from_dict(doc: dict[str, Any]) -> Dag:
    """Rebuild a Dag from :func:`to_dict` output.

    Raises:
        PlanError: wrong schema or version, or derived fields that disagree with the nodes.
    """
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise PlanError(f"not a ringflow Dag dump (expected schema '{SCHEMA}')")
    if doc.get("version") not in _READS:
        raise PlanError(f"Dag dump version {doc.get('version')!r} is not supported; this ringflow "
                        f"reads versions {', '.join(map(str, _READS))}: re-run `ringflow plan` "
                        f"to regenerate it")
    try:
        pools = tuple(
            PoolLayout(p["lane"], p["slot_bytes"], p["slots"], p["requested_depth"],
                       p["budget_bytes"], p["pool"])
            for p in doc["pools"]
        )
        nodes = tuple(_node(n) for n in doc["nodes"])
        prime = tuple(_node(n) for n in doc.get("prime", ()))
        dag = Dag(doc["name"], doc["layers"], pools, nodes, meta=dict(doc.get("meta", {})),
                  prime=prime)
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"malformed Dag dump: {exc!r}") from exc
    edges = [{"src": e.src, "dst": e.dst, "kind": e.kind} for e in dag.edges]
    if "edges" in doc and doc["edges"] != edges:
        raise PlanError("Dag dump edges disagree with its nodes; the dump was edited by hand")
    return dag


def from_json(text: str) -> Dag:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"Dag dump is not JSON: {exc}") from exc
    return from_dict(doc)


def _dot_id(stream: str) -> str:
    return "cluster_" + "".join(c if c.isalnum() else "_" for c in stream)


DOT_FULL_MAX_LAYERS = 16  # to_dot draws every node up to this many layers, and condenses above
DOT_KEEP_LAYERS = 2  # layers a condensed graph still draws node by node, at each end

_FILL = {NodeKind.GATHER: "lightblue", NodeKind.SYNC_GATHER: "orange",
         NodeKind.COMPUTE: "palegreen", NodeKind.RELEASE: "lightgrey"}


def _kind(n: Node) -> str:
    return str(n.kind) if n.role is None else f"{n.kind}.{n.role}"


def condenses(dag: Dag, full: bool | None = None) -> bool:
    """Whether :func:`to_dot` draws runs of middle layers as summary nodes."""
    if full is None:
        full = dag.layers <= DOT_FULL_MAX_LAYERS
    return not full and DOT_KEEP_LAYERS <= dag.layers - DOT_KEEP_LAYERS - 1


def to_dot(dag: Dag, *, full: bool | None = None) -> str:
    """Graphviz: one cluster per stream (lane), stream edges solid, event edges dashed.

    Args:
        full: ``True`` draws every node. ``False`` condenses: the first and last
            ``DOT_KEEP_LAYERS`` layers node by node, and on each stream the run of nodes of the
            layers between as one summary node (its layers and node counts by kind; the event
            edges it stands for become one dashed edge labelled with their count). ``None``
            (default): every node up to ``DOT_FULL_MAX_LAYERS`` layers, condensed above, since
            Graphviz takes minutes past a few hundred nodes (a 61-layer, two-lane plan has 854).

    In a plan with several lanes, nodes on the shared compute stream name their lane.
    """
    first, last = DOT_KEEP_LAYERS, dag.layers - DOT_KEEP_LAYERS - 1  # the layers condensed
    condensed = condenses(dag, full)
    name_lanes = len(dag.lanes) > 1
    lines = [f'digraph "{dag.name}" {{', "  rankdir=TB;", '  node [shape=box, fontsize=10];']
    if condensed:
        lines.append(f'  label="{dag.name}: {len(dag.nodes)} nodes, layers L{first}..L{last} '
                     f'condensed into one node per stream (ringflow plan --format dot --full '
                     f'draws every node)"; labelloc=t;')
    where: dict[int, str] = {}  # node id -> the DOT node that draws it
    for stream in dag.streams:
        lines.append(f'  subgraph {_dot_id(stream)} {{')
        lines.append(f'    label="{stream}"; style=rounded;')
        run: list[Node] = []
        for n in dag.on_stream(stream) + [None]:
            if n is not None and condensed and n.layer is not None and first <= n.layer <= last:
                run.append(n)
                continue
            if run:  # the run of condensed nodes that just ended on this stream
                summary = f"s{run[0].id}"
                lines.append(f'    {summary} [label="{_summary_label(run)}", '
                             f'style="rounded,filled,dashed", fillcolor=lightyellow];')
                where.update((m.id, summary) for m in run)
                run = []
            if n is None:
                break
            label = n.label + (f" ({n.lane})" if name_lanes and n.stream == COMPUTE_STREAM else "")
            shape = "ellipse" if n.kind in (NodeKind.RECORD, NodeKind.WAIT) else "box"
            lines.append(f'    n{n.id} [label="{label}", shape={shape}, style=filled, '
                         f'fillcolor={_FILL.get(n.kind, "white")}];')
            where[n.id] = f"n{n.id}"
        lines.append("  }")
    drawn: dict[tuple[str, str, str], list[str]] = {}  # (src, dst, kind) -> events it stands for
    for e in dag.edges:
        src, dst = where[e.src], where[e.dst]
        if src != dst:  # inside one summary node: not drawn
            drawn.setdefault((src, dst, e.kind), []).append(dag.nodes[e.dst].event)
    for (src, dst, kind), events in drawn.items():
        if kind == "event":
            label = events[0] if len(events) == 1 else f"{len(events)} events"
            lines.append(f'  {src} -> {dst} [style=dashed, color=blue, label="{label}"];')
        else:
            lines.append(f"  {src} -> {dst};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _summary_label(run: list[Node]) -> str:
    """``L2..L58 (lanes)`` over the node counts by kind, as a DOT label (``\\n`` breaks)."""
    layers = [n.layer for n in run]
    lanes = ", ".join(dict.fromkeys(n.lane for n in run))
    counts: dict[str, int] = {}
    for n in run:
        counts[_kind(n)] = counts.get(_kind(n), 0) + 1
    body = ", ".join(f"{count} {kind}" for kind, count in counts.items())
    return f"L{min(layers)}..L{max(layers)} ({lanes}): {len(run)} nodes\\n{body}"


def budget_lines(dag: Dag, kv_token_bytes: int | None = None) -> list[str]:
    """The budget arithmetic of every lane, the total, and (optionally) the KV tokens it costs."""
    lines = [p.arithmetic() for p in dag.pools]
    total = sum(p.reserved_bytes for p in dag.pools)
    lines.append(f"total reserved: {total:,} B ({mib(total)}) in {len(dag.pools)} "
                 f"allocation(s), made once before the KV cache is sized")
    if kv_token_bytes:
        tokens = total // (kv_token_bytes * dag.layers)
        lines.append(f"KV cost: {total:,} B / ({kv_token_bytes} B/token/layer x {dag.layers} "
                     f"layers) = {tokens:,} KV tokens")
    return lines


def to_text(dag: Dag, kv_token_bytes: int | None = None) -> str:
    """A table of the nodes in issue order, after the budget arithmetic."""
    out = [f"plan '{dag.name}': {dag.layers} layers, lanes {', '.join(dag.lanes)}, "
           f"{len(dag.nodes)} nodes on {len(dag.streams)} streams"]
    out += ["  " + line for line in budget_lines(dag, kv_token_bytes)]
    if dag.carried:
        carried = ", ".join(f"{lane} L{layer} (slot {slot})" for lane, layer, slot in dag.carried)
        out.append(f"  carried into every forward, filled by the previous one's tail: {carried}; "
                   f"the first forward primes them ({len(dag.prime)} nodes); '@F+1' marks a "
                   f"gather of the next forward's lease")
    header = f"{'id':>5}  {'stream':<14} {'kind':<14} {'lane':<8} {'layer':>5} {'slot':>4}  " \
             f"{'event':<18} after"
    out += ["", header, "-" * len(header)]
    for node, preds in zip(dag.nodes, dag.predecessors):
        after = ", ".join(f"n{src}" + ("~" if kind == "event" else "") for src, kind in preds)
        layer = "" if node.layer is None else f"{node.layer}" + ("@F+1" if node.forward else "")
        slot = "" if node.slot is None else node.slot
        out.append(f"{node.id:>5}  {node.stream:<14} {_kind(node):<14} {node.lane:<8} {layer!s:>5} "
                   f"{slot!s:>4}  {node.event or '':<18} {after}")
    out.append("(after: direct predecessors; ~ marks an event edge)")
    return "\n".join(out) + "\n"
