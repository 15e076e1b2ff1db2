"""vLLM's breakable CUDA graphs and ringflow's layer ops (Note [Capture breaks] in layer_ops.py,
``integrations/vllm/graph_mode.py``), on the CPU with vLLM's own break decorator: a capture
object stands in for vLLM's (segments need CUDA graphs), everything else is vLLM's code.
The H200 runs the same in vLLM's engine (tests/vllm_engine/test_cuda_vllm.py, "breakable")."""

import logging
from types import SimpleNamespace

import pytest
import torch

from helpers.vllm_required import require_vllm
from ringflow.integrations.torch.weight_stream import WeightStreamer
from ringflow.integrations.vllm import compat, graph_mode
from ringflow.integrations.vllm.state import PluginState
from ringflow.testing.models import decoder_stack, run_stack

SMALL = dict(hidden=64, intermediate=96, heads=4, dtype=torch.float32)


class Capture:
    """What vLLM's BreakableCUDAGraphCapture does at a break, minus the CUDA graphs: the
    segment ends, the call runs now and is kept for every replay."""

    def __init__(self):
        self._capturing = True
        self.eager = []

    def add_eager(self, fn):
        self.eager.append(fn)
        return fn()

    def replay(self):  # the captured segments (the layers' kernels) are not rerun here
        for fn in self.eager:
            fn()


@pytest.fixture
def breakable(monkeypatch):
    require_vllm()
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    from vllm.compilation import breakable_cudagraph
    capture = Capture()
    monkeypatch.setattr(breakable_cudagraph.BreakableCUDAGraphCapture, "current",
                        classmethod(lambda cls: capture))
    return capture


def config():
    return SimpleNamespace(compilation_config=SimpleNamespace(
        use_breakable_cudagraph=None, cudagraph_mode=SimpleNamespace(name="PIECEWISE"),
        mode=SimpleNamespace(name="NONE"), splitting_ops=[]))


def test_each_layer_op_is_a_break_and_a_replay_reruns_the_stepper(breakable):
    breaker, capture = graph_mode.capture_breaker(PluginState(), config(), "join")
    assert breaker is not None and capture == "join"
    layers = decoder_stack(4, **SMALL)
    x = torch.randn(5, 64)
    want = run_stack(layers, x)
    ws = WeightStreamer(layers, [1, 3], depth=1, workspace_bytes=1 << 22, breaker=breaker)
    assert torch.equal(run_stack(layers, x), want)  # the capture-time forward
    assert len(breakable.eager) == 2 * len(ws.stepper.boundaries)  # before and after each
    forwards = ws.stepper.forwards
    breakable.replay()  # vLLM's replay: every stepper call again, in order
    assert ws.stepper.forwards == forwards + 1 and not ws.stepper.in_forward
    breakable._capturing = False  # between segments vLLM's break just calls
    assert torch.equal(run_stack(layers, x), want)
    assert len(breakable.eager) == 2 * len(ws.stepper.boundaries)


def test_without_vllms_break_the_copies_stay_on_vllms_stream_said_once(breakable, monkeypatch,
                                                                       caplog):
    real = compat.get
    monkeypatch.setattr(compat, "get", lambda state, key: None if key == graph_mode.BREAK
                        else real(state, key))
    state = PluginState()
    with caplog.at_level(logging.INFO, logger="ringflow"):
        for _ in range(2):
            assert graph_mode.capture_breaker(state, config(), "join") == (None, "sync")
        assert graph_mode.capture_breaker(state, config(), "error") == (None, "error")
    said = [r.getMessage() for r in caplog.records if "eager_break_during_capture" in
            r.getMessage()]
    assert len(said) == 1 and "capture policy sync" in said[0]


def test_no_breaker_where_vllm_does_not_break_its_captures(monkeypatch):
    require_vllm()
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    assert graph_mode.capture_breaker(PluginState(), config(), "join") == (None, "join")


def test_the_start_up_line_names_breakable_graphs(breakable, caplog):
    with caplog.at_level(logging.INFO, logger="ringflow"):
        graph_mode.log_graph_mode(PluginState(), config(), layer_ops_in=True, context=True)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("vLLM runs breakable CUDA graphs (cudagraph_mode=PIECEWISE")
    assert "break the capture too" in line and "nothing is compiled" not in line
    assert "MLA context consumer runs inside vLLM's attention op" in line
