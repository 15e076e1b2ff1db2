"""ringflow.graphs: executors that run a planned Dag (eager streams, synchronous, captured)."""
