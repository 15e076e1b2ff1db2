"""Per-lane timeline of one forward from CUDA event timestamps, and its Gantt plot.

Every gather and compute of one eager forward is bracketed by timing events on the stream it
runs on; times are read relative to an event recorded before the forward, so the gather lane
and the compute lane share one clock and overlap is visible at a glance.
"""

from __future__ import annotations

from pathlib import Path

from ringflow.errors import ConfigError
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
