"""vLLM's compile-cache key carries ringflow's profile and the switches that change the traced
model (integrations/vllm/cache_key.py, Note [Compile-cache key]); the GPU proof that a cache
root then holds one graph per profile is tests/vllm_engine/test_cuda_vllm.py."""

from types import SimpleNamespace

import pytest

from ringflow.integrations.vllm.cache_key import factors, keyed_hash, on_compute_hash
from ringflow.integrations.vllm.state import PluginState

BASE = "0123456789abcdef"


def config(extra=None):
    return SimpleNamespace(additional_config=extra or {})


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RINGFLOW_PROFILE", "RINGFLOW_LAYER_OPS_ONLY", "RINGFLOW_CPU_PLAIN_GEMM",
                 "RINGFLOW_POISON", "RINGFLOW_MUTANT", "RINGFLOW_NVTX", "RINGFLOW_DUMP"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def key(cfg=None):
    return on_compute_hash(PluginState(), lambda c: BASE, cfg or config())


def test_plain_vllm_keeps_its_own_key(clean_env):
    assert factors(config()) == {} and key() == BASE


def test_each_profile_and_each_traced_switch_gets_a_key_of_its_own(clean_env):
    keys = {"plain": key()}
    clean_env.setenv("RINGFLOW_PROFILE", "vllm_weights")
    keys["weights"] = key()
    clean_env.setenv("RINGFLOW_PROFILE", "vllm_kv_prefetch")
    keys["kv"] = key()
    clean_env.delenv("RINGFLOW_PROFILE")
    clean_env.setenv("RINGFLOW_LAYER_OPS_ONLY", "1")
    keys["layer_ops"] = key()
    clean_env.delenv("RINGFLOW_LAYER_OPS_ONLY")
    clean_env.setenv("RINGFLOW_CPU_PLAIN_GEMM", "1")
    keys["plain_gemm"] = key()
    assert len(set(keys.values())) == len(keys), keys
    assert all(len(k) == len(BASE) for k in keys.values())


def test_switches_that_trace_nothing_leave_the_key_alone(clean_env):
    clean_env.setenv("RINGFLOW_NVTX", "0")
    clean_env.setenv("RINGFLOW_DUMP", "/tmp/plan")
    assert key() == BASE


def test_a_profile_named_by_path_is_keyed_by_its_content(clean_env, tmp_path):
    path = tmp_path / "p.yaml"
    cfg = config({"ringflow": {"profile": str(path)}})
    path.write_text("name: p\noffload: {layers: [1, 2], depth: 1, workspace_mib: 64}\n")
    first = key(cfg)
    path.write_text("name: p\noffload: {layers: [1, 3], depth: 1, workspace_mib: 64}\n")
    assert key(cfg) != first != BASE


def test_a_profile_that_does_not_load_is_keyed_by_its_error(clean_env):
    clean_env.setenv("RINGFLOW_PROFILE", "no_such_profile_anywhere")
    found = factors(config())
    assert "profile_error" in found and keyed_hash(BASE, found) != BASE


def test_a_weight_profile_is_keyed_by_the_code_that_decides_its_wrapped_layers(clean_env,
                                                                                monkeypatch):
    """offload {count: N} is resolved by the placement code, and every weight profile's layer
    ops go around the plan's boundary layers: neither is traced, so a change there must change
    the key (else a cached graph could carry the ops around other layers)."""
    from ringflow.integrations.vllm import cache_key
    cfg = config({"ringflow": {"name": "w", "offload": {"layers": {"count": 2},
                                                        "workspace_mib": 64}}})
    kv = config({"ringflow": {"name": "k", "kv_prefetch": {"workspace_mib": 64}}})
    first, kv_first = key(cfg), key(kv)
    assert factors(cfg)["wrapped_layers_code"] == cache_key.wrapped_layers_code()
    assert "wrapped_layers_code" not in factors(kv)
    monkeypatch.setattr(cache_key, "wrapped_layers_code", lambda: "another placement")
    assert key(cfg) != first and key(kv) == kv_first


def test_an_ignored_ringflow_profile_is_not_in_the_key(clean_env, caplog):
    """With both sources set, additional_config wins: the key is the one of that profile alone,
    and the line about the key names that profile, never the variable."""
    import logging

    from ringflow.integrations.vllm import cache_key
    cfg = config({"ringflow": "vllm_weights_small"})
    alone = key(cfg)
    clean_env.setenv("RINGFLOW_PROFILE", "vllm_weights")
    with caplog.at_level(logging.INFO, logger="ringflow"):
        assert key(cfg) == alone
        cache_key.log_factors(PluginState(), factors(cfg))
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all("profile 'vllm-weights-small'" in line and "RINGFLOW_PROFILE" not in
                         line for line in lines), lines
