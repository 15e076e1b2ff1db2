"""ringflow.timing: the one place CUDA timing events are made (bench, tune, run, timelines)."""

import pytest
import torch

from ringflow.timing import elapsed_ms, forward_spans, stamped

pytestmark = pytest.mark.cuda


def test_elapsed_ms_times_the_work_issued_on_the_current_stream():
    torch.cuda._sleep(1000)  # load the kernel
    once = elapsed_ms(lambda: torch.cuda._sleep(2_000_000))
    thrice = elapsed_ms(lambda: torch.cuda._sleep(2_000_000), repeat=3)
    assert once > 0 and 2.5 * once < thrice < 3.5 * once


def test_stamped_calls_become_spans_on_one_clock_in_issue_order():
    marks = []
    gather = stamped("gather", lambda layer, lane, t: torch.cuda._sleep(200_000), marks)
    compute = stamped("compute", lambda layer, lane, t: torch.cuda._sleep(400_000), marks)

    def forward():
        for layer in range(3):
            gather(layer, "kv", None)
            compute(layer, "kv", None)

    spans = forward_spans(forward, marks)
    assert [(s["kind"], s["layer"], s["lane"]) for s in spans] == \
        [(k, layer, "kv") for layer in range(3) for k in ("gather", "compute")]
    ends = [0.0] + [s["end_ms"] for s in spans]
    assert all(prev <= s["start_ms"] < s["end_ms"] for prev, s in zip(ends, spans))


def test_the_eager_timeline_of_demo_has_every_gather_and_compute():
    from ringflow import Planner, SlotPool, load_profile
    from ringflow.bench.timeline import record_timeline
    from ringflow.bench.workload import SyntheticWorkload

    profile = load_profile("demo")
    pools = [SlotPool.for_profile(profile, lane, "cuda") for lane in profile.lanes]
    dag = Planner.from_profile(profile).plan()
    spans = record_timeline(dag, pools, SyntheticWorkload(profile, "cuda"))
    kinds = sorted((s["kind"], s["layer"]) for s in spans)
    assert kinds == sorted((k, layer) for layer in range(8) for k in ("compute", "gather"))
    assert all(0 <= s["start_ms"] <= s["end_ms"] for s in spans)
    for pool in pools:
        pool.close()
