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
    ({"slots": "Auto"}, "experts.slots"),
    ({"slots": 1.5}, "experts.slots"),
    ({"slots": {}}, "experts.slots"),
    ({"slots": {"1": 0}}, "experts.slots"),
    ({"slots": {"one": 8}}, "experts.slots"),
    ({"slots": {1: "auto"}}, "experts.slots"),
    ({"auto_percent": 0}, "experts.auto_percent"),
    ({"auto_percent": 101}, "experts.auto_percent"),
    ({"lookahead": "often"}, "experts.lookahead"),
    ({"in_place_tokens": -1}, "experts.in_place_tokens"),
    ({"decode_from_ring": "yes"}, "experts.decode_from_ring"),
    ({"layer_buffers": "ring"}, "experts.layer_buffers"),
    ({"layer_buffers": -1}, "experts.layer_buffers"),
])
def test_bad_experts_sections_name_their_field(section, field):
    with pytest.raises(ProfileError) as err:
        load(section)
    assert err.value.field.startswith(field), err.value


@pytest.mark.parametrize("section, words", [
    ({"decode_from_ring": True, "layer_buffers": 0}, "layer_buffers 0"),
    ({"decode_from_ring": True, "layer_buffers": 4}, "the 4 chosen layers, got layer_buffers 4"),
    ({"decode_from_ring": True, "lend_slots": True}, "set one of them"),
    ({"decode_from_ring": True, "layer_buffers": "slots"}, "layer_buffers: slots has none"),
])
def test_held_layers_that_cannot_be_held_are_refused_by_name(section, words):
    """``decode_from_ring`` (Note [Small steps read the held layers]) needs a ring smaller
    than the chosen layers, and no lend; off, it holds none."""
    from ringflow.integrations.vllm.experts import held_layers
    spec = load(section).experts
    with pytest.raises(ProfileError, match=words) as err:
        held_layers(spec, [0, 1, 2, 3], None)
    assert err.value.field == "experts.decode_from_ring"
    assert held_layers(load({"decode_from_ring": True}).experts, [3, 5, 7], None) == [3, 5]
    assert held_layers(load({}).experts, [3, 5, 7], None) == []
    held = load({"decode_from_ring": True})
    assert held.experts.decode_from_ring and Profile.from_mapping(held.to_mapping(),
                                                                  vllm=True) == held


def test_default_slots_are_a_quarter_of_the_experts_and_at_least_top_k():
    spec = load({}).experts
    assert spec.slots_for(128, 8) == 32 and spec.slots_for(16, 8) == 8
    assert load({"slots": 500}).experts.slots_for(64, 6) == 64


@pytest.mark.parametrize("chosen, held, slots", [(4, 2, 64), (8, 2, 42), (4, 1, 42)])
def test_default_slots_of_held_layers_go_to_the_others(chosen, held, slots):
    """``decode_from_ring`` with the default slots: the held layers' quarter of the experts
    spread over the layers with slots (rounded down: never more memory than without), as the
    H100 bench measured it; a number of slots stays that number."""
    spec = load({"decode_from_ring": True}).experts
    assert spec.slots_for(128, 8, held=held, chosen=chosen) == slots
    assert (chosen - held) * slots <= chosen * 32
    assert load({"slots": 32, "decode_from_ring": True}).experts.slots_for(
        128, 8, held=held, chosen=chosen) == 32


def test_auto_slots_take_the_stated_share_of_what_the_budget_leaves():
    from ringflow.orchestrator.sections import auto_slots
    spec = load({"slots": "auto", "auto_percent": 40}).experts
    assert spec.slots == "auto" and spec.auto_percent == 40
    assert Profile.from_mapping(load({"slots": "auto"}).to_mapping(), vllm=True).experts.slots \
        == "auto"
    assert spec.slots_for(128, 8) == 32  # where no budget is known: the default
    expert = 9_437_184  # one Qwen3-30B-A3B expert in bf16
    # 40% of 100 GiB over 48 layers of 9 MiB experts: 94 per layer
    assert auto_slots(100 << 30, 40, 48, expert, 128, 8) == (100 << 30) * 40 // 100 // (
        48 * expert) == 94
    assert auto_slots(1 << 40, 40, 48, expert, 128, 8) == 128  # never more than the experts
    with pytest.raises(ProfileError, match=r"holds 5 experts per layer .* fewer than top_k "
                                           r"\(8\); raise experts.auto_percent") as err:
        auto_slots(48 * 5 * expert * 4, 25, 48, expert, 128, 8)
    assert err.value.field == "experts.slots"
    with pytest.raises(ProfileError, match="holds 0 experts"):  # the ring took it all
        auto_slots(-(1 << 30), 25, 48, expert, 128, 8)


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
     r"fp8 \(Fp8MoEMethod\).*on a GPU only"),
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
    (False, "TritonExperts", "device memory: ringflow puts the chosen layers' experts"),
    (True, "FlashInferExperts", "FlashInferExperts, which ignores an expert map: start vLLM "
                                "with --moe-backend triton"),
])
def test_gpu_layers_need_their_experts_in_host_memory_and_a_kernel_that_maps(
        monkeypatch, in_host, kernel, words):
    """On a GPU (Note [Experts in vLLM]): the experts must be in host memory (where ringflow
    or vLLM's UVA offloader put them), and the kernel must honour expert_map; each refusal
    says what to change."""
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
    lane.check_layer(2, SimpleNamespace(), layer(True, "TritonExperts"))  # taken
    with pytest.raises(UnsupportedModelError, match=words):
        lane.check_layer(2, SimpleNamespace(), layer(in_host, kernel))


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


def fp8_layer(scales=((16, 2, 2), (16, 2, 1)), method="Fp8MoEMethod", **config):
    """A GPU layer as vLLM's fp8 MoE leaves it (Note [fp8 experts]): fp8 weights in host
    memory, Triton experts whose quantization config holds one scale row per expert."""
    import torch
    config = {"a1_scale": None, "per_act_token_quant": False, **config}
    quant = SimpleNamespace(w1_scale=torch.rand(scales[0]), w2_scale=torch.rand(scales[1]),
                            block_shape=[128, 128] if len(scales[0]) == 3 else None, **config)
    fused = type("TritonExperts", (), {"quant_config": quant, "moe_sum": lambda *a: None})()
    kernel = SimpleNamespace(fused_experts=fused, impl=SimpleNamespace(fused_experts=fused))
    w = SimpleNamespace(is_cuda=True, host=True, shape=(16, 4, 2))
    return SimpleNamespace(activation=SimpleNamespace(name="SILU"), moe_config=SimpleNamespace(),
                           quant_method=type(method, (), {"is_monolithic": False,
                                                          "moe_kernel": kernel})(),
                           global_num_experts=16, local_num_experts=16,
                           layer_name="model.layers.2.mlp", w13_weight=w, w2_weight=w)


@pytest.mark.parametrize("method", ["Fp8MoEMethod", "Fp8PerTensorOnlineMoEMethod",
                                    "Fp8PerBlockOnlineMoEMethod"])
@pytest.mark.parametrize("scales", [((16, 2, 2), (16, 2, 1)), ((16,), (16,))])
def test_fp8_layers_on_a_gpu_are_served_with_their_scales(monkeypatch, method, scales):
    from ringflow.integrations.vllm import experts as lane
    monkeypatch.setattr(lane, "_in_host_memory", lambda t: t.host)
    layer = fp8_layer(scales, method)
    lane.check_layer(2, SimpleNamespace(), layer)  # taken
    assert lane.weight_format(layer) == ("fp8, scales per 128x128 block" if len(scales[0]) == 3
                                         else "fp8, one scale per expert and weight")
    # per tensor with dynamic activation scales: a step is never split (Note [fp8 experts])
    assert lane.scales_across_rows(layer) == (len(scales[0]) == 1)
    assert not lane.scales_across_rows(fp8_layer(scales, method, a1_scale=object()))


@pytest.mark.parametrize("scales, config, words", [
    (((1,), (1,)), {}, r"scales \(\(1,\), \(1,\)\) are not one row per expert \(16\)"),
    (((16, 2, 2), (16, 2, 1)), {"w1_zp": object()}, "zero points or biases"),
])
def test_fp8_layers_the_slots_cannot_hold_are_refused_by_name(monkeypatch, scales, config,
                                                              words):
    from ringflow.errors import UnsupportedModelError
    from ringflow.integrations.vllm import experts as lane
    monkeypatch.setattr(lane, "_in_host_memory", lambda t: t.host)
    with pytest.raises(UnsupportedModelError, match=words):
        lane.check_layer(2, SimpleNamespace(), fp8_layer(scales, **config))


def test_a_layer_s_tensors_carry_its_fp8_scales_as_rows_and_each_pass_gets_its_own():
    """The store holds a per-expert scale as [experts, 1] (a slot is a row); the kernel's
    quantization config for a pass holds that pass's scales in the layer's own shape, one
    config per scale store, vLLM's own config untouched."""
    import torch

    from ringflow.integrations.vllm import experts as lane
    from ringflow.integrations.vllm.expert_kernel import ResidentKernel
    layer = fp8_layer(((16,), (16,)))
    layer.w13_weight, layer.w2_weight = torch.zeros(16, 4, 2), torch.zeros(16, 2, 2)
    tensors = lane.expert_tensors(layer)
    assert {k: tuple(v.shape) for k, v in tensors.items() if "scale" in k} == {
        "w13_scale": (16, 1), "w2_scale": (16, 1)}
    base = layer.quant_method.moe_kernel.fused_experts.quant_config
    base._w1, base._w2 = SimpleNamespace(scale=base.w1_scale), SimpleNamespace(scale=base.w2_scale)
    kernel = ResidentKernel(layer, (torch.Size((16, 4, 2)), torch.Size((16, 2, 2))))
    kernel._impl()
    slots = {"w13_scale": torch.rand(5, 1), "w2_scale": torch.rand(5, 1)}
    config = kernel._scaled(slots)
    assert tuple(config._w1.scale.shape) == (5,) and config._w1.scale.data_ptr() == \
        slots["w13_scale"].data_ptr()
    assert config._w2.scale.data_ptr() == slots["w2_scale"].data_ptr()
    assert kernel._scaled(slots) is config and kernel._scaled(tensors) is not config
    assert base._w1.scale is base.w1_scale  # vLLM's own config untouched
    assert kernel._scaled({"w13": None}) is base  # unquantized: the layer's own


def test_reload_weights_is_refused_while_the_lane_serves_fp8_experts():
    import weakref

    from ringflow.errors import EngineError
    from ringflow.integrations.vllm import experts as lane

    class Model:
        pass
    model = Model()
    state = SimpleNamespace(expert_lanes=weakref.WeakKeyDictionary())
    runner = SimpleNamespace(get_model=lambda: model)
    lane.refuse_quantized_reload(state, runner)  # no lane: passed through
    plain = SimpleNamespace(quant_method=type("UnquantizedFusedMoEMethod", (), {})())
    state.expert_lanes[model] = SimpleNamespace(modules={1: plain})
    lane.refuse_quantized_reload(state, runner)  # unquantized: the host copies follow it
    state.expert_lanes[model] = SimpleNamespace(modules={1: plain, 3: fp8_layer()})
    with pytest.raises(EngineError, match=r"fp8 routed experts from host memory \(layers \[3\]\)"
                                          r".*restart the engine with the new checkpoint"):
        lane.refuse_quantized_reload(state, runner)


def test_vllm_s_offloader_meeting_weights_quantized_at_load_gets_one_line(caplog):
    from ringflow.integrations.vllm import experts as lane
    config = SimpleNamespace(model_config=SimpleNamespace(quantization="fp8"))
    with caplog.at_level("ERROR", logger="ringflow"):
        lane.explain_load_failure(config, NotImplementedError("some other gap"))
        assert not caplog.records
        lane.explain_load_failure(config, NotImplementedError(
            "Cannot copy out of meta tensor; no data!"))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "cannot take routed experts quantized at load (--quantization fp8" in line
    assert "serve an fp8 checkpoint" in line


def test_slots_per_layer_round_trip_and_must_name_exactly_the_chosen_layers():
    """``slots`` as a mapping (YAML's int keys or JSON's strings): each chosen layer its own
    count; a layer not chosen, a chosen one without a count, or the mapping beside
    ``decode_from_ring`` is refused by name."""
    p = load({"layers": [1, 3], "slots": {"3": 8, 1: 120}, "layer_buffers": "slots"})
    spec = p.experts
    assert spec.slots == {1: 120, 3: 8}
    assert spec.slots_for(128, 8, layer=1) == 120 and spec.slots_for(128, 8, layer=3) == 8
    assert load({"slots": {1: 500}}).experts.slots_for(128, 8, layer=1) == 128
    assert Profile.from_mapping(p.to_mapping(), vllm=True) == p
    spec.check_slot_layers([1, 3], None)
    for chosen, words in (([1, 2, 3], r"\[2\] without a count"), ([1], r"\[3\] not chosen")):
        with pytest.raises(ProfileError, match=words) as err:
            spec.check_slot_layers(chosen, None)
        assert err.value.field == "experts.slots"
    spec.check_slot_layers([0, 1, 2, 3], None, among=True)  # the front end: a pattern's
    with pytest.raises(ProfileError, match=r"\[5\] not chosen"):      # layers, MoE or not
        load({"slots": {1: 8, 5: 8}}).experts.check_slot_layers([0, 1, 2, 3], None, among=True)
    with pytest.raises(ProfileError, match="names no layer 2"):
        spec.slots_for(128, 8, layer=2)
    assert load({"slots": {1: 128, 3: 8}, "host_share": "auto"}).experts.host_share == "auto"
    for section, words in (({"decode_from_ring": True}, "the held layers have no slots"),
                           ({"layers": [1, 2]}, r"\[3\] not chosen: \[2\] without a count"),
                           ({"slots": {1: 8, "1": 9}}, "names layer 1 twice"),
                           ({"slots": {"\u00b2": 8}}, "experts.slots")):
        with pytest.raises(ProfileError, match=words) as err:
            load({"slots": {1: 8, 3: 8}, **section})
        assert err.value.field == "experts.slots"
    load({"slots": 8}).experts.check_slot_layers([0, 5], None)  # one count: any layers


def test_slots_as_layer_buffers_round_trip_and_refuse_lend_slots():
    """``layer_buffers: slots`` (Note [Large steps stream through the slots]) loads, dumps and
    loads again as itself; beside ``lend_slots`` it is refused by name."""
    from ringflow.integrations.vllm.experts import streams_through_slots
    arena = load({"layer_buffers": "slots"})
    assert arena.experts.layer_buffers == "slots"
    assert Profile.from_mapping(arena.to_mapping(), vllm=True) == arena
    assert streams_through_slots(arena.experts, None)
    assert not streams_through_slots(load({}).experts, None)
    with pytest.raises(ProfileError, match="lend_slots lends slots to a ring") as err:
        streams_through_slots(load({"layer_buffers": "slots", "lend_slots": True}).experts,
                              None)
    assert err.value.field == "experts.layer_buffers"


def test_an_experts_section_beside_streamed_weights_is_refused(monkeypatch):
    """Weight streaming takes every parameter of its layers, the routed experts' host views
    included, and would stream them too: the pair was never run, so it is refused by name
    (in the front end and the worker); with RINGFLOW_LAYER_OPS_ONLY nothing streams."""
    from ringflow.integrations.vllm.frontend import refuse_streaming_beside_experts
    both = load({"layers": "all"}).__class__.from_mapping(
        {"experts": {"layers": "all"}, "offload": {"layers": [1], "depth": 1,
                                                    "workspace_mib": 64}}, vllm=True)
    with pytest.raises(ProfileError, match="experts.*beside an offload section is not supported"):
        refuse_streaming_beside_experts(both)
    refuse_streaming_beside_experts(load({"layers": "all"}))  # experts alone: fine
    monkeypatch.setenv("RINGFLOW_LAYER_OPS_ONLY", "1")
    refuse_streaming_beside_experts(both)
