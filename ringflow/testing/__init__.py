"""Test helpers users can reuse to check their own plans, executors and engines.

* :mod:`~ringflow.testing.tracing`: :class:`TracingWorkload`, which says whether every read saw
  the write the plan intended;
* :mod:`~ringflow.testing.races`: :class:`RaceWindows`, device-side delays that open races;
* :mod:`~ringflow.testing.models`: a decoder layer and stack with vLLM's calling convention, and a
  stack of paged attention layers (the KV consumer an engine would be);
* :mod:`~ringflow.testing.spawn`: :func:`spawn_group`, a process group of fresh processes;
* :mod:`~ringflow.testing.dcp`: a DCP group's full KV and each rank's shard of it;
* :mod:`~ringflow.testing.busy_python`: :class:`BusyPython`, a thread running Python while
  something else is measured.

Import from the submodules; this package imports nothing.
"""
