"""Per-lane timeline of one forward from CUDA event timestamps: its Gantt plot, and the same
spans as a Chrome trace (Trace Event Format) that Perfetto and chrome://tracing open.

Every gather and compute of one eager forward is bracketed by timing events on the stream it
runs on; times are read relative to an event recorded before the forward, so the gather lane
and the compute lane share one clock and overlap is visible at a glance.
"""

from __future__ import annotations

import json
from pathlib import Path

from ringflow.errors import ConfigError, OutputError
from ringflow.graphs.eager import EagerExecutor
from ringflow.orchestrator.dag import Dag
from ringflow.timing import forward_spans, stamped


def record_timeline(dag: Dag, pools, work) -> list[dict]:
    """``[{"lane", "kind", "layer", "start_ms", "end_ms"}]`` of one eager forward."""
    marks: list = []
    ex = EagerExecutor(dag, pools, stamped("gather", work.gather, marks),
                       stamped("compute", work.compute, marks))
    return forward_spans(ex.run, marks)


def require_matplotlib(option: str) -> None:
    """Raise unless matplotlib imports (no ringflow install pulls it in). Call it before any
    measurement, so that a missing plotter never costs a whole benchmark run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"{option} draws timelines with matplotlib, which is not installed; "
                          f"`pip install matplotlib`, or drop {option}") from exc


def plot_timeline(spans: list[dict], path: Path, title: str) -> Path:
    """A Gantt chart: gather lane above compute lane, one bar per node."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ["compute", "gather"]  # bottom to top
    colors = {"gather": "tab:blue", "compute": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 2.6))
    for span in spans:
        y = rows.index(span["kind"])
        width = max(span["end_ms"] - span["start_ms"], 1e-3)
        ax.broken_barh([(span["start_ms"], width)], (y - 0.35, 0.7), color=colors[span["kind"]],
                       edgecolor="black", linewidth=0.3)
        if width > 0.04 * max(s["end_ms"] for s in spans):
            ax.text(span["start_ms"] + width / 2, y, f"L{span['layer']}", ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), ["compute lane", "gather lane"])
    ax.set_xlabel("ms since the forward started")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: Perfetto's rows, top to bottom: the gather lane above the compute lane, as in the PNG
_TRACE_ROWS = {"gather": 1, "compute": 2}


def chrome_trace(spans: list[dict], title: str) -> dict:
    """``spans`` (from :func:`record_timeline`) as a Trace Event Format document: one process
    named ``title``, one thread per kind (gather lane, compute lane), one complete event
    (``ph: X``) per node, microseconds since the forward started."""
    events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": title}}]
    for kind, tid in _TRACE_ROWS.items():
        events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                    "args": {"name": f"{kind} lane"}},
                   {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                    "args": {"sort_index": tid}}]
    for span in spans:
        if span["kind"] not in _TRACE_ROWS:
            raise ConfigError(f"a timeline span of kind {span['kind']!r}; expected one of "
                              f"{sorted(_TRACE_ROWS)}")
        events.append({"name": f"{span['kind']} L{span['layer']}", "cat": span["kind"],
                       "ph": "X", "pid": 1, "tid": _TRACE_ROWS[span["kind"]],
                       "ts": round(span["start_ms"] * 1e3, 3),
                       "dur": round(max(span["end_ms"] - span["start_ms"], 0.0) * 1e3, 3),
                       "args": {"lane": span["lane"], "layer": span["layer"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(spans: list[dict], path: Path, title: str) -> Path:
    """Write :func:`chrome_trace` to ``path``.

    Raises:
        OutputError: the file cannot be written.
    """
    path = Path(path)
    try:
        path.write_text(json.dumps(chrome_trace(spans, title)))
    except OSError as exc:
        raise OutputError(f"cannot write the trace {path}: {exc.strerror}; give a writable "
                          f"directory") from exc
    return path


def traces_from_results(results: Path, out_dir: Path) -> list[Path]:
    """One trace per scenario of a ``ringflow bench --json`` file whose rows carry a timeline
    (those measured with ``--plot`` or ``--trace``).

    Raises:
        ConfigError: the file is not a bench results file, or no row has a timeline.
        OutputError: a trace cannot be written.
    """
    try:
        doc = json.loads(Path(results).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read bench results {results}: {exc}") from exc
    rows = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ConfigError(f"{results} is not a `ringflow bench --json` file (no 'results' list)")
    timed = [r for r in rows if isinstance(r, dict) and r.get("timeline")]
    if not timed:
        raise ConfigError(f"no row of {results} has a timeline; measure with `ringflow bench "
                          f"--trace DIR` (or --plot)")
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot make the trace folder {out_dir}: {exc.strerror}; give a "
                          f"writable directory") from exc
    return [write_trace(r["timeline"], out_dir / f"{r['scenario'].replace('/', '-')}.trace.json",
                        f"{r['scenario']}: one forward, ringflow eager") for r in timed]
