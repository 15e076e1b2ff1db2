"""Measurement: ``ringflow bench`` scenarios and ``ringflow tune``, the hand-written ring they are
compared with, the DCP all-gather benchmark, timelines, the synthetic workload, and the records
their results are written as. Nothing here is imported by the runtime."""
