"""The profile's experts section: what it accepts, what it refuses, and the front end's check
of its layers against the model's config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ringflow.errors import ProfileError
from ringflow.integrations.vllm.frontend import check_layers
from ringflow.integrations.vllm.surfaces import needed
from ringflow.orchestrator.profile import Profile


def load(section):
    return Profile.from_mapping({"experts": section}, vllm=True)


def test_an_experts_profile_is_a_vllm_profile_that_round_trips():
    p = load({"layers": {"every": 4, "last": 1}, "slots": 8})
    assert p.layers is None and p.experts.layers == (4, 1) and p.experts.slots == 8
    assert Profile.from_mapping(p.to_mapping(), vllm=True) == p
    assert "experts" in needed(p) and "weights" not in needed(p)
    assert load({}).experts.layers == "all" and load({}).experts.slots is None


@pytest.mark.parametrize("section, field", [
    ({"layers": []}, "experts.layers"),
    ({"layers": [1, 1]}, "experts.layers"),
    ({"layers": {"count": 2}}, "experts.layers"),
    ({"slots": 0}, "experts.slots"),
    ({"lookahead": "often"}, "experts.lookahead"),
    ({"in_place_tokens": -1}, "experts.in_place_tokens"),
])
def test_bad_experts_sections_name_their_field(section, field):
    with pytest.raises(ProfileError) as err:
        load(section)
    assert err.value.field.startswith(field), err.value


def test_default_slots_are_a_quarter_of_the_experts_and_at_least_top_k():
    spec = load({}).experts
    assert spec.slots_for(128, 8) == 32 and spec.slots_for(16, 8) == 8
    assert load({"slots": 500}).experts.slots_for(64, 6) == 64


def test_the_front_end_checks_expert_layers_against_the_models_config():
    config = SimpleNamespace(model_config=SimpleNamespace(
        hf_text_config=SimpleNamespace(num_hidden_layers=4)))
    check_layers(load({"layers": [0, 3]}), config)
    with pytest.raises(ProfileError, match=r"layers \[7\] do not exist"):
        check_layers(load({"layers": [3, 7]}), config)


@pytest.mark.parametrize("change, words", [
    ({"activation": SimpleNamespace(name="SILU_NO_MUL")}, "not SiLU-gated"),
    ({"moe_config": SimpleNamespace(swiglu_limit=7.0)}, "clamped or scaled"),
    ({"quant_method": type("UnquantizedFusedMoEMethod", (), {"is_monolithic": True})()},
     "monolithic"),
    ({"w13_bias": object()}, "biases"),
    ({"local_num_experts": 8}, "expert parallelism"),
    ({"quant_method": type("Fp8MoEMethod", (), {"is_monolithic": False})()},
     r"quantized: fp8 \(Fp8MoEMethod\).*without --quantization"),
    ({"quant_method": type("Mxfp4MoEMethod", (), {"is_monolithic": False})()},
     r"quantized: mxfp4"),
    ({"quant_method": type("GPTQMarlinMoEMethod", (), {"is_monolithic": False})()},
     r"quantized: int4 \(Marlin\)"),
    ({"quant_method": type("AWQMoEMethod", (), {"is_monolithic": False})()},
     r"quantized: int4 \(AWQ\)"),
])
def test_layers_the_lane_cannot_compute_are_refused_by_name(change, words):
    from ringflow.errors import UnsupportedModelError
    from ringflow.integrations.vllm.experts import check_layer
    plain = dict(activation=SimpleNamespace(name="SILU"), moe_config=SimpleNamespace(),
                 quant_method=type("UnquantizedFusedMoEMethod", (), {"is_monolithic": False})(),
                 global_num_experts=16, local_num_experts=16, layer_name="model.layers.2.mlp",
                 w13_weight=SimpleNamespace(is_cuda=False))
    check_layer(2, SimpleNamespace(), SimpleNamespace(**plain))  # SiLU, unquantized: taken
    with pytest.raises(UnsupportedModelError, match=words):
        check_layer(2, SimpleNamespace(), SimpleNamespace(**{**plain, **change}))


@pytest.mark.parametrize("in_host, kernel, words", [
    (False, "TritonExperts", "device memory: start vLLM with --cpu-offload-gb"),
    (True, "FlashInferExperts", "FlashInferExperts, which ignores an expert map: start vLLM "
                                "with --moe-backend triton"),
])
def test_gpu_layers_need_their_experts_in_host_memory_and_a_kernel_that_maps(
        monkeypatch, in_host, kernel, words):
    """On a GPU (Note [Experts in vLLM]): the experts must be where vLLM's UVA offloader puts
    them, and the kernel must honour expert_map; each refusal says which flag to pass."""
    from ringflow.errors import UnsupportedModelError
    from ringflow.integrations.vllm import experts as lane
    monkeypatch.setattr(lane, "_in_host_memory", lambda t: t.host)
    method = type("UnquantizedFusedMoEMethod", (), {"is_monolithic": False})()

    def layer(host, kernel_name):
        method.moe_kernel = SimpleNamespace(fused_experts=type(kernel_name, (), {})())
        w = SimpleNamespace(is_cuda=True, host=host)
        return SimpleNamespace(activation=SimpleNamespace(name="SILU"),
                               moe_config=SimpleNamespace(), quant_method=method,
                               global_num_experts=16, local_num_experts=16,
                               layer_name="model.layers.2.mlp", w13_weight=w, w2_weight=w)
    flags = "start vLLM with --cpu-offload-gb 3 --cpu-offload-params experts"
    lane.check_layer(2, SimpleNamespace(), layer(True, "TritonExperts"), flags)  # taken
    with pytest.raises(UnsupportedModelError, match=words):
        lane.check_layer(2, SimpleNamespace(), layer(in_host, kernel), flags)


def test_each_pass_runs_its_fetch_and_its_moe_in_nvtx_ranges(monkeypatch):
    """One range per pass for the fetch and one for the MoE, named by the decoder layer: a
    step of 3 tokens x top-2 over 1 slot takes ceil(min(4, 6) / 1) = 4 passes."""
    import torch

    from ringflow.graphs import nvtx_ranges
    from ringflow.integrations.torch.expert_cache import ExpertCache
    from ringflow.integrations.torch.expert_lane import ExpertLane, TorchCompute
    from ringflow.integrations.vllm import experts as lane

    class Recorder:
        name, pushed, depth = "test", [], 0

        def handle(self, message):
            return message

        def push(self, h):
            self.pushed.append(h)
            self.depth += 1

        def pop(self):
            self.depth -= 1

    recorder = Recorder()
    monkeypatch.setattr(nvtx_ranges, "backend", recorder)
    g = torch.Generator().manual_seed(0)
    host = {"w13": torch.randn(4, 8, 6, generator=g), "w2": torch.randn(4, 6, 4, generator=g)}
    layer = SimpleNamespace(w13_weight=host["w13"], layer_name="model.layers.5.mlp.experts")
    cache = ExpertCache(host, 1, "cpu")
    layer.forward_modular = lane._forward(5, ExpertLane({5: cache}, {5: TorchCompute()}))
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    out = layer.forward_modular(torch.randn(3, 6, generator=g), torch.full((3, 2), 0.5), ids)
    assert out.shape == (3, 6) and torch.isfinite(out).all() and recorder.depth == 0
    assert recorder.pushed == ["ringflow/experts/fetch/L5", "ringflow/experts/moe/L5"] * 4


def test_weight_verbs_and_sleep_are_refused_while_a_lane_serves_experts():
    """The lane's slots and ring hold copies of the experts: a call that moves or rewrites
    weights behind reload_weights' back (weight transfer, sleep levels 1 and 2) is refused
    with one line naming the section, as for weight streaming."""
    from ringflow.errors import EngineError
    from ringflow.integrations.vllm import surfaces, weights
    from ringflow.integrations.vllm.state import PluginState

    class Model:
        pass

    state, model = PluginState(), Model()
    verb = weights.refusal(surfaces.by_key()[
        "vllm.v1.worker.gpu_worker.Worker.update_weights"])
    calls = []
    verb(state, lambda worker: calls.append(worker), SimpleNamespace())
    assert len(calls) == 1  # no lane: passed through
    state.expert_lanes[model] = SimpleNamespace()
    with pytest.raises(EngineError, match="serves routed experts from host memory.*experts "
                                          "section"):
        verb(state, lambda worker: calls.append(worker), SimpleNamespace())
    core = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"ringflow": {
        "name": "e", "experts": {"layers": "all"}}}))
    with pytest.raises(EngineError, match=r"sleep\(level=1\).*routed experts"):
        weights.on_engine_sleep(state, lambda c, level: None, core, 1)
    assert weights.on_engine_sleep(state, lambda c, level: "paused", core, 0) == "paused"
