"""ringflow.graphs: executors that run a planned Dag (eager streams, synchronous, captured).

Imports the orchestrator below it, never the integrations above it or the kernels (they reach a
plan as callables).
"""
