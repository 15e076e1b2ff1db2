"""ringflow.graphs: execute a planned Dag. Slot pools and leases (the ring's memory), ringflow's
own streams, NVTX ranges, and the executors (eager streams, CUDA graphs, synchronous, and the
LayerStepper that issues a plan from an engine's own layer loop).

Imports the orchestrator below it, never the integrations above it or the kernels (they reach a
plan as callables).
"""
