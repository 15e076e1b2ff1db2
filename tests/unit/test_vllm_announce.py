"""No silent choice in vLLM's front end (#38): the plugin says once which version it is and
whether it is idle, a set-but-empty RINGFLOW_PROFILE is said, and where both sources name a
profile the ignored one is named."""

import logging

from ringflow import __version__
from ringflow.integrations.vllm import frontend
from ringflow.integrations.vllm.state import PluginState
from ringflow.orchestrator.profile import Profile

SECTION = {"offload": {"layers": "all", "depth": 1, "workspace_mib": 64}}


def lines(caplog, state, extra, profile, times=2):
    with caplog.at_level(logging.INFO, logger="ringflow"):
        for _ in range(times):
            frontend.announce(state, extra, profile)
    return [r for r in caplog.records if "version " in r.getMessage()]


def test_an_idle_plugin_says_its_version_once(caplog, monkeypatch):
    monkeypatch.delenv("RINGFLOW_PROFILE", raising=False)
    [record] = lines(caplog, PluginState(), {}, None)
    assert f"version {__version__} installed and idle (no profile" in record.getMessage()


def test_an_empty_ringflow_profile_is_said(caplog, monkeypatch):
    monkeypatch.setenv("RINGFLOW_PROFILE", "")
    [record] = lines(caplog, PluginState(), {}, None)
    assert "RINGFLOW_PROFILE is set but empty" in record.getMessage()


def test_with_both_sources_the_ignored_variable_is_named(caplog, monkeypatch):
    monkeypatch.setenv("RINGFLOW_PROFILE", "vllm_weights")
    profile = Profile.from_mapping(SECTION, source="additional_config.ringflow", vllm=True)
    [record] = lines(caplog, PluginState(), {"ringflow": SECTION}, profile)
    assert record.levelno == logging.WARNING
    assert "from additional_config.ringflow; RINGFLOW_PROFILE=vllm_weights is ignored" in \
        record.getMessage()


def test_one_source_is_said_as_information(caplog, monkeypatch):
    monkeypatch.delenv("RINGFLOW_PROFILE", raising=False)
    profile = Profile.from_mapping(SECTION, source="additional_config.ringflow", vllm=True)
    [record] = lines(caplog, PluginState(), {"ringflow": SECTION}, profile)
    assert record.levelno == logging.INFO and "ignored" not in record.getMessage()


def test_a_built_ins_name_in_additional_config_is_labelled_where_it_was_given():
    """The string form ``{"ringflow": "NAME"}``: its profile and its errors name
    ``additional_config.ringflow`` (#38: they said ``<builtin ...>`` alone)."""
    from types import SimpleNamespace

    import pytest

    from ringflow import ProfileError
    from ringflow.integrations.vllm.config import profile_from
    got = profile_from(SimpleNamespace(additional_config={"ringflow": "vllm_weights_small"}))
    assert got.source == "additional_config.ringflow='vllm_weights_small' " \
                         "(<builtin vllm_weights_small>)"
    with pytest.raises(ProfileError, match=r"^additional_config.ringflow='demo' \(<builtin "
                                           r"demo>\): is not a vLLM profile"):
        profile_from(SimpleNamespace(additional_config={"ringflow": "demo"}))


def test_the_small_built_in_streams_models_the_large_one_refuses():
    small = Profile.load("vllm_weights_small", vllm=True)
    assert small.offload.resolve(2, "t") == [1] and small.offload.resolve(4, "t") == [1, 3]
    import pytest

    from ringflow import ProfileError
    with pytest.raises(ProfileError, match="selects no layer of a model with 4 decoder layers"):
        Profile.load("vllm_weights", vllm=True).offload.resolve(4, "t")


def test_the_compile_cache_key_line_is_in_plain_words(caplog):
    from ringflow.integrations.vllm import cache_key
    with caplog.at_level(logging.INFO, logger="ringflow"):
        cache_key.log_factors(PluginState(), {"profile": {"name": "vllm_weights"},
                                              "wrapped_layers_code": "ab",
                                              "RINGFLOW_NVTX": "0", "ringflow": "0.1.0"})
    [line] = [r.getMessage() for r in caplog.records]
    assert line == ("vLLM's compile-cache key includes ringflow's RINGFLOW_NVTX=0, profile "
                    "'vllm_weights' and the code that picks the wrapped layers: an engine with "
                    "another profile or switch traces and caches graphs of its own")
    assert cache_key.factor_words({"profile_error": "x", "ringflow": "0.1.0"}) == \
        "the error its profile gave"


def test_vllm_cpu_s_memory_reservation_is_said_in_one_line(caplog):
    """vLLM-CPU without --kv-cache-memory-bytes reserves --gpu-memory-utilization of its NUMA
    node and stops when less is free (a traceback whose last line says so among others);
    ringflow says the rule once before the engine starts, as a warning when it will not fit;
    nothing on a GPU, nothing once the KV cache is sized in bytes."""
    from types import SimpleNamespace

    from ringflow.integrations.vllm.frontend import numa_memory, say_cpu_memory

    def config(device, fraction, kv=None):
        return SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                               cache_config=SimpleNamespace(gpu_memory_utilization=fraction,
                                                            kv_cache_memory_bytes=kv))
    gib = 2**30
    node = [(int(10.71 * gib), int(8.55 * gib))]
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert not say_cpu_memory(config("cuda", 0.92), node)
        assert not say_cpu_memory(config("cpu", 0.92, kv=32 << 20), node)
        assert not caplog.records
        assert say_cpu_memory(config("cpu", 0.92), node)
        assert not say_cpu_memory(config("cpu", 0.5), node)
    short, fits = [r for r in caplog.records]
    assert short.levelno == logging.WARNING and short.getMessage() == (
        "vLLM-CPU reserves --gpu-memory-utilization 0.92 of its NUMA node's memory (9.85 of "
        "10.71 GiB; about 8.55 GiB is free): it will likely stop while starting; "
        "--kv-cache-memory-bytes sizes its KV cache instead and skips that reservation")
    assert fits.levelno == logging.INFO and "will likely stop" not in fits.getMessage()
    assert all(total >= free > 0 for total, free in numa_memory())
