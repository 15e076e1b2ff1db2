"""SyncExecutor: the Dag linearised onto the current stream (or the CPU).

Every node runs in issue order on whatever stream is current; records and waits are no-ops
because one stream orders everything. It is the reference the other executors must match, the
CPU path, and the capture-safe fallback: it never host-syncs, queries an event or allocates.
"""

from __future__ import annotations

from ringflow.graphs.executor import DagExecutor


class SyncExecutor(DagExecutor):
    """Runs a Dag with no concurrency: gathers and computes in the plan's order, one stream."""

    kind = "sync"

    def _may_sync(self) -> bool:
        import torch

        # after a fault inside someone's capture, syncing would invalidate their capture too
        return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
