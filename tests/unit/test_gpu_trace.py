"""Where a step's GPU time went, read from a torch.profiler trace (ringflow/bench/gpu_trace.py):
against a trace built by hand here, and on a GPU against a real one."""

import json
import time

import pytest
import torch

from ringflow.bench import gpu_trace
from ringflow.errors import OutputError


def x(cat, name, start_ms, end_ms, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}


def test_a_hand_made_trace_gives_its_overlap_copy_rate_and_the_sync_across_its_gap():
    events = [
        x("kernel", "moe", 0, 10, stream=7), x("kernel", "moe", 13, 20, stream=7),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 5, 11, stream=9, bytes=330_000_000),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 19.5, 19.6, stream=7, bytes=8),
        x("cuda_runtime", "cudaEventSynchronize", 10.5, 13.2),
        x("cuda_runtime", "cudaLaunchKernel", 11.5, 11.6),
        x("cpu_op", "aten::mm", 0, 30),  # host ops outside the GPU's window count for nothing
    ]
    got = gpu_trace.summarize(events)
    assert got["window_ms"] == 20 and got["kernel_ms"] == 17 and got["kernels"] == 2
    assert got["h2d_ms"] == 6 and got["h2d_gb"] == 0.33 and got["h2d_gbps"] == 55.0
    assert got["overlap_ms"] == 5 and got["copy_only_ms"] == 1 and got["kernel_only_ms"] == 12
    assert got["idle_ms"] == 2
    (gap,) = got["gaps"]
    assert gap["at_ms"] == 11 and gap["ms"] == 2
    assert gap["host"][0] == "cudaEventSynchronize 2.0 ms"
    assert gap["host"][1] == "cudaLaunchKernel 0.1 ms"
    assert got["streams"]["9"]["copies_ms"] == 6 and got["streams"]["7"]["kernels_ms"] == 17


def test_copies_across_kernel_edges_memsets_and_a_lone_device_to_host_copy():
    """Two copies each straddling a kernel's edge (the overlap is summed over every pair), a
    memset counted as a kernel, a device-to-host copy alone in a stretch (busy, but neither a
    kernel nor a host-to-device copy), and ``gaps=1`` keeping only the longest."""
    events = [
        x("kernel", "a", 0, 4, stream=1), x("kernel", "b", 6, 10, stream=1),
        x("gpu_memset", "Memset (Device)", 12, 13, stream=1),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 3, 7, stream=2, bytes=4_000_000),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 9, 12.5, stream=2, bytes=3_500_000),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 14, 16, stream=1, bytes=8),
        x("kernel", "c", 17, 18, stream=1),
    ]
    got = gpu_trace.summarize(events, gaps=1)
    assert got["window_ms"] == 18
    assert got["kernel_ms"] == 10 and got["kernels"] == 3  # 4 + 4 + the memset's 1 + 1
    assert got["h2d_ms"] == 7.5 and got["h2d_gbps"] == 1.0
    # [3, 4] and [6, 7] of the first copy, [9, 10] and [12, 12.5] of the second
    assert got["overlap_ms"] == 3.5 and got["copy_only_ms"] == 4
    # busy: [0, 13], the DtoH [14, 16], [17, 18]: idle 1 + 1
    assert got["idle_ms"] == 2
    assert len(got["gaps"]) == 1 and got["gaps"][0]["ms"] == 1


def test_short_gaps_are_not_listed_and_the_longest_come_first():
    events = [x("kernel", "k", a, a + 1, stream=1) for a in (0, 1.1, 3, 7)]
    got = gpu_trace.summarize(events, min_gap_ms=0.5)
    assert [g["ms"] for g in got["gaps"]] == [3.0, 0.9]  # not the 0.1 after the first
    assert got["idle_ms"] == pytest.approx(4.0, abs=1e-9)
    assert got["h2d_gbps"] is None


def test_a_trace_without_gpu_work_or_a_file_that_is_no_trace_is_refused(tmp_path):
    with pytest.raises(OutputError, match="no GPU activity"):
        gpu_trace.summarize([x("cpu_op", "aten::mm", 0, 1)])
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"schemaVersion": 1}))
    with pytest.raises(OutputError, match="no traceEvents"):
        gpu_trace.load(bad)
    with pytest.raises(OutputError, match="cannot read"):
        gpu_trace.load(tmp_path / "missing.json")


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path):
    """vLLM's profiler gzips its traces unless told not to."""
    import gzip

    doc = {"traceEvents": [x("kernel", "k", 0, 2, stream=1)]}
    (tmp_path / "t.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert gpu_trace.summarize(gpu_trace.load(tmp_path / "t.json.gz"))["kernel_ms"] == 2


def test_the_copy_engines_waits_inside_the_step_name_the_kernels_across_them():
    """A lone step that copies two layers: the copy engine starts late (the first layer's
    attention), waits under the first layer's MoE for its retire, and copies a tail after the
    last kernel, which is no wait; small map copies do not count as bulk."""
    mb = 1 << 20
    events = [
        x("kernel", "flash_attn", 0, 2, stream=7), x("kernel", "fused_moe_kernel", 2, 4, stream=7),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 2.5, 2.6, stream=7, bytes=1024),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 3, 10, stream=9, bytes=400 * mb),
        x("kernel", "fused_moe_kernel", 10, 12, stream=7),  # the layer the copy served
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 12.5, 20, stream=9, bytes=400 * mb),
        x("kernel", "fused_moe_kernel", 20, 22, stream=7),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 22, 30, stream=9, bytes=400 * mb),
    ]
    got = gpu_trace.summarize(events)["copy_gaps"]
    assert got["first_copy_ms"] == 3
    assert got["bulk_copies"] == 2  # the tail's starts at the last kernel's end: not the step's
    # [0, 3] before the first copy, [10, 12.5] under the MoE, [20, 22] after the last one
    assert got["idle_ms"] == 7.5
    assert [(g["at_ms"], g["ms"]) for g in got["gaps"]] == [(0, 3), (10, 2.5), (20, 2)]
    assert got["gaps"][0]["kernels"] == ["flash_attn 2.0 ms", "fused_moe_kernel 1.0 ms"]
    assert got["gaps"][1]["kernels"] == ["fused_moe_kernel 2.0 ms"]
    assert "issued_ms" not in got["gaps"][0]  # no host calls in this trace: nothing to say


def test_a_wait_names_whether_the_host_issued_the_next_copy_late():
    """The copy after the first wait was issued 2.9 ms in, after that wait began: the host
    was behind (a sync in the step); the one after the second wait was issued at 1 ms and
    waited for an event."""
    mb = 1 << 20
    events = [
        x("kernel", "fused_moe_kernel", 0, 3, stream=7),
        x("cuda_runtime", "cudaMemcpyAsync", 2.9, 2.95, correlation=5),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 3, 8, stream=9, bytes=300 * mb,
          correlation=5),
        x("cuda_runtime", "cudaMemcpyAsync", 1, 1.05, correlation=6),
        x("kernel", "fused_moe_kernel", 8, 10, stream=7),
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 10, 14, stream=9, bytes=300 * mb,
          correlation=6),
        x("kernel", "fused_moe_kernel", 14, 15, stream=7),
    ]
    first, second = sorted(gpu_trace.copy_gaps(events)["gaps"], key=lambda g: g["at_ms"])[:2]
    assert (first["at_ms"], first["issued_ms"], first["issued_late"]) == (0, 2.9, True)
    assert (second["at_ms"], second["issued_ms"], second["issued_late"]) == (8, 1, False)
    assert gpu_trace.summarize([x("kernel", "k", 0, 1, stream=1)])["copy_gaps"] is None
    copies_only = [x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 1, stream=9, bytes=mb)]
    assert gpu_trace.summarize(copies_only)["copy_gaps"] is None  # no kernel: no step to wait in
    with pytest.raises(OutputError, match="no kernels"):
        gpu_trace.copy_gaps(copies_only)


def test_the_h100s_4_layer_arena_trace_waited_at_its_start_and_under_two_moe_layers():
    """The stored H100 trace of the arena's lone 8k prompt (4 layers, tree df16898): the
    copy engine started 6.4 ms in (layer 0 and the arena's first layer's attention ran
    before its first fill was issued) and waited 1.6 ms under each of two layers' MoE; the
    2.6 GB of bulk copies before the last kernel are the step's, the rest its tail."""
    from pathlib import Path

    trace = (Path(__file__).resolve().parents[2] / "profiles/results/logs"
             / "trace-arena-8k-h100-df16898.json.gz")
    got = gpu_trace.summarize(gpu_trace.load(trace))["copy_gaps"]
    assert got["first_copy_ms"] == pytest.approx(6.43, abs=0.01)
    assert got["idle_ms"] == pytest.approx(9.68, abs=0.01)
    assert got["bulk_gb"] == pytest.approx(2.617, abs=0.001)
    assert [g["ms"] > 1.5 for g in got["gaps"]] == [True, True, True]
    assert all(g["kernels"][0].startswith("fused_moe_kernel") for g in got["gaps"][1:])
    # the first fill was issued only 6.4 ms in (the arena read its tables there, a host sync,
    # before early starts); the waits under the MoE were for retire events, queued long before
    assert got["gaps"][0]["issued_late"] and not any(g["issued_late"] for g in got["gaps"][1:])


@pytest.mark.cuda
def test_on_a_gpu_a_copy_beside_matmuls_overlaps_and_a_host_sleep_is_a_gap(tmp_path):
    """A real trace: a pinned 256 MiB copy on ringflow's own stream beside a loop of matmuls
    overlaps them at a host link's rate, and a host sleep between two kernels (after a
    synchronize) is the trace's longest gap."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run `pytest -m cuda` on one")
    from torch.profiler import ProfilerActivity, profile

    from ringflow.graphs.streams import dedicated_streams

    src = torch.randn(64 << 20).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    side = dedicated_streams(src, dst.device, ["trace-test"], priority=0)["trace-test"]
    for _ in range(3):  # warm: cuBLAS handles, the copy path
        a @ a
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        for _ in range(40):
            a @ a
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        time.sleep(0.01)
        a @ a
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    got = gpu_trace.summarize(gpu_trace.load(path))
    assert torch.equal(dst.cpu(), src)
    assert got["h2d_gb"] == pytest.approx(src.numel() * 4 / 1e9, rel=1e-3), got
    assert 5 < got["h2d_gbps"] < 200, got
    assert got["overlap_ms"] > 0.5 * got["h2d_ms"], got  # the matmuls outlast the copy
    longest = got["gaps"][0]
    assert longest["ms"] >= 9, got
    print(json.dumps({k: v for k, v in got.items() if k != "streams"}))


def test_ringflows_own_ranges_are_counted_on_the_host_from_the_steps_first_gpu_event():
    """RINGFLOW_TORCH_RANGES puts ringflow's ranges in the trace (``user_annotation`` on the
    host; the profiler's GPU-side copies, ``gpu_user_annotation``, and vLLM's own ranges are
    not ringflow's): per name, how many, their host time, where the first began."""
    events = [
        x("kernel", "embedding", 2, 3, stream=7), x("kernel", "moe", 4, 9, stream=7),
        x("user_annotation", "ringflow/experts/prepare", 0.5, 1.5),
        x("user_annotation", "ringflow/experts/moe/L0", 3, 4),
        x("user_annotation", "ringflow/experts/moe/L0", 6, 6.5),
        x("gpu_user_annotation", "ringflow/experts/moe/L0", 4, 9),
        x("user_annotation", "execute_context_1(8192)_generation_0(0)", 0, 10),
    ]
    got = gpu_trace.summarize(events)["ringflow_ranges"]
    assert got == {"ringflow/experts/prepare": {"count": 1, "ms": 1.0, "first_at_ms": -1.5},
                   "ringflow/experts/moe/L0": {"count": 2, "ms": 1.5, "first_at_ms": 1.0}}
    assert list(got) == ["ringflow/experts/prepare", "ringflow/experts/moe/L0"]
    assert gpu_trace.summarize(events[:2])["ringflow_ranges"] is None
