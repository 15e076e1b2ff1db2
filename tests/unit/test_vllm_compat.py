"""The table of vLLM surfaces and its installer without vLLM (integrations/vllm/compat.py):
what counts as a changed signature, which versions must have a surface, what uninstall puts
back, and the hooks that run in every vLLM process doing nothing harmful without a profile."""

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from ringflow import ProfileError
from ringflow.integrations.vllm import compat, frontend, metadata, surfaces, weights
from ringflow.integrations.vllm.state import PluginState


def _surface(params, anywhere=False, versions=((0, 26), None)):
    return surfaces.Surface("m", "C.f", "method", "weights", "test", versions=versions,
                            params=params, anywhere=anywhere)


def test_a_changed_signature_is_one_whose_leading_or_named_parameters_moved():
    prefix = _surface(("self", "modules_generator"))
    assert compat.params_match(prefix, ["self", "modules_generator", "prefix"])
    assert compat.params_match(prefix, ["self", "*args"])          # *args takes the rest
    assert not compat.params_match(prefix, ["self", "modules"])    # renamed
    assert not compat.params_match(prefix, ["self"])               # dropped
    # keyword-only: the hook passes it by position, which would fail at every call
    assert not compat.params_match(prefix, ["self", ":modules_generator"])
    named = _surface(("src_cache", "dst"), anywhere=True)
    assert compat.params_match(named, [":dst", ":block_table", ":src_cache"])  # bound by name
    assert not compat.params_match(named, ["src", "dst"])

    def changed(self, *, modules_generator):
        pass

    with pytest.raises(compat.SurfaceMissing, match="takes \\(self, :modules_generator\\)"):
        compat.check_params(prefix, changed)


def test_a_vllm_outside_the_supported_range_is_expected_to_have_what_the_newest_has():
    current = _surface((), versions=((0, 26), None))
    gone = _surface((), versions=((0, 26), (0, 33)))
    for version in ((0, 1), (0, 25), (0, 99), None):  # a source build, an old one, a new one
        assert current.in_range(version) and not gone.in_range(version), version
    assert gone.in_range((0, 32)) and not gone.in_range((0, 34))


def test_uninstall_puts_back_exactly_what_the_hooks_replaced():
    class Base:
        def build(self, common_prefix_len, common_attn_metadata):
            return "base"

    class Child(Base):  # inherits the method: hooking the base already covers it
        pass

    state = PluginState()
    state.surfaces = compat.Installed("test")
    key = "vllm.v1.attention.backend.AttentionMetadataBuilder.build"
    original = Base.__dict__["build"]
    assert compat.hook_class(state, key, Base) and compat.hook_class(state, key, Child)
    assert "build" not in vars(Child) and Base.__dict__["build"] is not original
    assert [(owner, name) for owner, name, _ in state.surfaces.installed] == [(Base, "build")]
    compat.uninstall(state)
    assert Base.__dict__["build"] is original and "build" not in vars(Child)
    assert state.surfaces is None


def test_the_hooks_of_every_process_pass_through_without_a_profile(monkeypatch):
    monkeypatch.delenv("RINGFLOW_PROFILE", raising=False)
    state = PluginState()
    sleep = weights.refusal(surfaces.by_key()["vllm.v1.worker.gpu_worker.Worker.discard"])
    calls = []
    # a worker without a model runner yet, and one with
    sleep(state, lambda worker, tags: calls.append(tags), SimpleNamespace(), ("kv_cache",))
    assert calls == [("kv_cache",)]

    @dataclasses.dataclass
    class DataclassBuilder:  # vLLM 0.34's sparse MLA builders: unhashable
        layer_names_: list

    class Lanes:
        pass

    builder = DataclassBuilder([])
    metadata.remember_layer_names(state, lambda b, spec, names: None, builder, None, ["a"])
    result = SimpleNamespace()
    lanes = Lanes()
    state.models[1] = lanes  # full-KV lanes exist: the builder hook tags what it built
    common = SimpleNamespace(block_table_tensor=None)
    out = metadata.keep_common_metadata(state, lambda b, *a, **k: result, builder, 0, common)
    assert out is result and result._ringflow_common == (common, frozenset(["a"]))


def test_a_profile_section_json_cannot_key_is_still_a_profile_error():
    config = SimpleNamespace(additional_config={"ringflow": {"name": "x", 1: "y"}})
    with pytest.raises(ProfileError):
        PluginState().profile(config)


def test_a_profile_keeps_vllms_extensible_kv_cache_off_unless_asked(monkeypatch, caplog):
    monkeypatch.delenv("RINGFLOW_PROFILE", raising=False)
    profile = {"ringflow": {"name": "w", "offload": {"layers": [1], "workspace_mib": 64}}}
    seen = []

    def create(args):
        seen.append(args.enable_extensible_kv_cache)
        return SimpleNamespace(additional_config=args.additional_config,
                               cache_config=SimpleNamespace(
                                   enable_extensible_kv_cache=args.enable_extensible_kv_cache))

    with caplog.at_level(logging.INFO, logger="ringflow"):
        frontend.on_create_engine_config(PluginState(), create, SimpleNamespace(
            additional_config=profile, enable_extensible_kv_cache=None))
        frontend.on_create_engine_config(PluginState(), create, SimpleNamespace(
            additional_config={}, enable_extensible_kv_cache=None))   # no profile: vLLM's say
    assert seen == [False, None]
    with pytest.raises(Exception, match="--no-enable-extensible-kv-cache"):
        frontend.on_create_engine_config(PluginState(), create, SimpleNamespace(
            additional_config=profile, enable_extensible_kv_cache=True))
