"""The names of ``ringflow bench``'s scenarios and their profiles, without importing torch (the
command line lists them in ``--help``)."""

#: scenario -> its profile under profiles/
SCENARIOS = {
    "h2d-balanced": "bench/h2d_balanced",
    "weights-stream": "bench/weights_stream",
    "weights-stream-mixed": "bench/weights_stream_mixed",
    "compute-bound": "bench/compute_bound",
    "device-gather": "bench/device_gather",
    "small-layers": "bench/small_layers",
    "depth-sweep": "bench/depth_sweep",
    "one-slot": "bench/one_slot",
    "one-slot-placed": "bench/one_slot_placed",
}
