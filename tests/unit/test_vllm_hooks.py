"""Installing hooks on vLLM classes (integrations/vllm/hooks.py): each hook receives the one
plugin state it was installed with."""

import pytest

from ringflow import EngineError
from ringflow.integrations.vllm.hooks import wrap
from ringflow.integrations.vllm.state import PluginState


def test_a_class_hook_receives_its_state_once_and_serves_no_other():
    class Worker:
        def load(self, x):
            return x + 1

    first, second = PluginState(), PluginState()
    seen = []

    def hook(state, original, self, x):
        seen.append(state)
        return original(self, x) * 10

    wrap(Worker, "load", hook, first)
    wrap(Worker, "load", hook, first)            # vLLM loads plugins in every process: no-op
    assert Worker().load(1) == 20 and seen == [first]
    with pytest.raises(EngineError, match="Worker.load is already hooked for another plugin state"):
        wrap(Worker, "load", hook, second)
    assert Worker().load(2) == 30 and seen == [first, first]  # still the first state's hook


def test_an_mla_layer_with_its_own_context_method_is_named_once_and_gets_no_ring(caplog):
    """vLLM's Kimi-K3 layer computes its MLA context itself, outside the hooked MLAAttention:
    ringflow reserves nothing for it and says so once, by class."""
    import logging

    from torch import nn

    from ringflow.integrations.vllm.weights import own_context_layers

    class OwnContextMLA(nn.Module):  # what vLLM 0.32+'s Kimi-K3 attention looks like here
        kv_lora_rank = 512

        def _compute_prefill_context(self, q, attn_metadata):
            raise AssertionError("not called")

    class HookedMLA(nn.Module):  # an MLAAttention: its impl's context method is hooked
        kv_lora_rank = 512

    model = nn.Sequential(OwnContextMLA(), OwnContextMLA(), HookedMLA())
    state = PluginState()
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert own_context_layers(state, model) == ["test_an_mla_layer_with_its_own_context_"
                                                     "method_is_named_once_and_gets_no_ring."
                                                     "<locals>.OwnContextMLA"]
        own_context_layers(state, model)
    named = [r.getMessage() for r in caplog.records if "computes its MLA context" in
             r.getMessage()]
    assert len(named) == 1 and "reserved no ring" in named[0]


def test_a_layer_whose_hooked_method_changed_parameters_is_left_alone_with_one_line(caplog):
    """A per-object surface (vLLM's MLAAttention.forward_impl) is checked against the table
    on the class vLLM built, before ringflow wraps any of its layers."""
    import logging

    from ringflow.integrations.vllm import compat

    key = "vllm.model_executor.layers.attention.mla_attention.MLAAttention.forward_impl"

    class Same:
        def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output=None):
            pass

    class Renamed:  # a release that renamed the cache argument
        def forward_impl(self, q, k_c_normed, k_pe, cache, attn_metadata, output=None):
            pass

    state = PluginState()
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert compat.instance_ok(state, key, Same)
        assert not compat.instance_ok(state, key, Renamed)
        assert not compat.instance_ok(state, key, Renamed)
    lines = [r.getMessage() for r in caplog.records if "cannot be hooked" in r.getMessage()]
    assert len(lines) == 1 and "Renamed.forward_impl" in lines[0] and "cache" in lines[0]


def _refused_by_vllm():
    raise RuntimeError("vLLM refuses: less memory than asked")  # stands in for vLLM's code


def _frames(exc) -> list[str]:
    import traceback
    return [f"{frame.filename}:{frame.name}" for frame in traceback.extract_tb(exc.__traceback__)]


def _hooked_failure(monkeypatch, hook, refused=_refused_by_vllm, frames="0"):
    """A function of a module hooked by ``hook`` (a hook of ringflow's own, in ringflow's
    folders) whose original raises; the exception as the caller catches it."""
    import types

    from ringflow.integrations.vllm.hooks import wrap_function
    monkeypatch.setenv("RINGFLOW_HOOK_FRAMES", frames)
    module = types.SimpleNamespace(__name__="vllm_like", start=refused)
    wrap_function(module, "start", hook, PluginState())
    with pytest.raises(Exception) as err:
        module.start()
    return err.value


def test_an_error_vllm_raises_under_a_hook_keeps_only_vllms_frames(monkeypatch):
    """Note [vLLM's errors keep vLLM's frames]: the wrapper and the hook (startup_errors'
    pass-through on vLLM's worker wait) drop out of the traceback; the raiser and the caller
    stay, and the exception is the one vLLM raised."""
    from ringflow.integrations.vllm import hooks, startup_errors
    err = _hooked_failure(monkeypatch, startup_errors.on_workers_ready)
    frames = _frames(err)
    assert isinstance(err, RuntimeError) and "less memory" in str(err)
    assert frames[-1].endswith(":_refused_by_vllm"), frames
    assert not [f for f in frames if f.startswith(hooks.own_folders())], frames
    kept = _frames(_hooked_failure(monkeypatch, startup_errors.on_workers_ready, frames="1"))
    assert [f for f in kept if f.endswith(("hooks.py:wrapper", "startup_errors.py:"
                                           "on_workers_ready"))] and len(kept) == len(frames) + 2


def test_an_error_raised_in_ringflows_code_keeps_every_frame(monkeypatch):
    """A hook's own mistake (here ringflow's switch parser refusing a value) is ringflow's to
    explain: its frames stay."""
    from ringflow import envs
    from ringflow.errors import ConfigError
    from ringflow.integrations.vllm import startup_errors

    def refused():
        return envs.flag("RINGFLOW_POISON")

    monkeypatch.setenv("RINGFLOW_POISON", "maybe")
    err = _hooked_failure(monkeypatch, startup_errors.on_workers_ready, refused)
    frames = _frames(err)
    assert isinstance(err, ConfigError)
    assert any(f.endswith("hooks.py:wrapper") for f in frames)
    assert frames[-1].endswith("envs.py:flag"), frames


def test_the_exceptions_chained_to_vllms_error_lose_ringflows_frames_too(monkeypatch):
    """vLLM's first error passed through ringflow's code outside any wrapper (a hook called
    straight), vLLM raised a second from it, and that one passed through a wrapper: both
    lose ringflow's frames."""
    from ringflow.integrations.vllm import hooks, startup_errors

    def refused():
        try:
            startup_errors.on_workers_ready(None, _refused_by_vllm)
        except RuntimeError as inner:
            raise ValueError("vLLM gives up") from inner

    err = _hooked_failure(monkeypatch, startup_errors.on_workers_ready, refused)
    assert isinstance(err, ValueError) and isinstance(err.__cause__, RuntimeError)
    for exc in (err, err.__cause__):
        assert not [f for f in _frames(exc) if f.startswith(hooks.own_folders())]
