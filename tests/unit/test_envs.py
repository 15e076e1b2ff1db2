"""Every RINGFLOW_* switch goes through one strict parser (ringflow/envs.py)."""

import pytest

from ringflow import ConfigError, envs
from ringflow.graphs import nvtx_ranges

FLAGS = [name for name, s in envs.SWITCHES.items() if s.kind == "flag"]


@pytest.mark.parametrize("name", FLAGS)
def test_every_flag_takes_the_same_spellings_and_refuses_the_rest(monkeypatch, name):
    for value, want in [("1", True), ("TRUE", True), (" yes ", True), ("On", True),
                        ("0", False), ("false", False), ("No", False), ("OFF", False)]:
        monkeypatch.setenv(name, value)
        assert envs.flag(name) is want, value
    monkeypatch.delenv(name, raising=False)
    assert envs.flag(name) is bool(envs.SWITCHES[name].default)
    monkeypatch.setenv(name, "")
    assert envs.flag(name) is bool(envs.SWITCHES[name].default)
    for typo in ("2", "maybe", "enable", "y"):
        monkeypatch.setenv(name, typo)
        with pytest.raises(ConfigError, match=rf"^{name}='{typo}' is not a flag; accepted: 1, "
                                              r"true, yes, on \(on\), 0, false, no, off"):
            envs.flag(name)


def test_nvtx_turns_off_with_any_off_spelling(monkeypatch):
    """RINGFLOW_NVTX=off used to leave NVTX on (only 0 worked)."""
    for value in ("0", "off", "false", "no"):
        monkeypatch.setenv("RINGFLOW_NVTX", value)
        assert nvtx_ranges.select_backend().name == "none", value
    monkeypatch.setenv("RINGFLOW_NVTX", "of")
    with pytest.raises(ConfigError, match="RINGFLOW_NVTX='of'"):
        nvtx_ranges.select_backend()


def test_text_switches_and_unknown_names(monkeypatch):
    monkeypatch.setenv("RINGFLOW_DUMP", "/tmp/plan")
    assert envs.text("RINGFLOW_DUMP") == "/tmp/plan"
    monkeypatch.setenv("RINGFLOW_DUMP", "")
    assert envs.text("RINGFLOW_DUMP") is None
    with pytest.raises(ConfigError, match="RINGFLOW_NOPE is not a ringflow switch"):
        envs.flag("RINGFLOW_NOPE")
    with pytest.raises(ConfigError, match="is a text switch, not a flag"):
        envs.flag("RINGFLOW_DUMP")


def test_a_bad_nvtx_switch_fails_where_ringflow_is_used_not_at_import():
    """The vLLM plugin imports the executors when vLLM loads plugins; a typo there must be one
    error from ringflow's own hook, not a failed plugin import."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RINGFLOW_NVTX": "of"}
    imported = subprocess.run([sys.executable, "-c", "import ringflow.graphs.nvtx_ranges"],
                              env=env, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stderr
    used = subprocess.run([sys.executable, "-c", "from ringflow.graphs import nvtx_ranges; "
                           "nvtx_ranges.ranged('x', lambda: None)"], env=env,
                          capture_output=True, text=True)
    assert used.returncode != 0 and "ConfigError: RINGFLOW_NVTX='of' is not a flag" in used.stderr


def test_an_unknown_ringflow_variable_is_named_once_with_the_switch_it_resembles(monkeypatch,
                                                                                 caplog):
    import logging

    monkeypatch.setenv("RINGFLOW_POISN", "1")
    monkeypatch.setenv("RINGFLOW_QWERTY", "1")
    assert envs.unknown() == ["RINGFLOW_POISN (did you mean RINGFLOW_POISON?)", "RINGFLOW_QWERTY"]
    log = logging.getLogger("ringflow.test")
    with caplog.at_level(logging.WARNING, logger="ringflow.test"):
        envs.warn_unknown(log)
    [record] = caplog.records
    assert record.getMessage().startswith("ignoring RINGFLOW_POISN (did you mean "
                                          "RINGFLOW_POISON?), RINGFLOW_QWERTY: not a ringflow "
                                          "switch; switches: RINGFLOW_POISON")
    monkeypatch.delenv("RINGFLOW_POISN")
    monkeypatch.delenv("RINGFLOW_QWERTY")
    caplog.clear()
    envs.warn_unknown(log)
    assert not caplog.records


def test_torch_ranges_put_ringflows_ranges_in_a_torch_profiler_trace(monkeypatch):
    """RINGFLOW_TORCH_RANGES=1: each range opens in torch's profiler too (nested as called),
    beside the NVTX backend's own push and pop; off by default, and nothing with ranges off."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    assert not isinstance(nvtx_ranges.select_backend(), nvtx_ranges.WithTorchProfiler)
    monkeypatch.setenv("RINGFLOW_TORCH_RANGES", "1")
    monkeypatch.setenv("RINGFLOW_NVTX", "0")
    assert nvtx_ranges.select_backend().name == "none"
    monkeypatch.delenv("RINGFLOW_NVTX")
    made = nvtx_ranges.select_backend()
    pushed = []
    inner = type("Inner", (), {"name": "rec", "handle": lambda self, m: m,
                               "push": lambda self, h: pushed.append(h),
                               "pop": lambda self: pushed.append("pop")})()
    monkeypatch.setattr(nvtx_ranges, "backend", nvtx_ranges.WithTorchProfiler(inner))
    assert isinstance(made, nvtx_ranges.WithTorchProfiler)
    outer, nested = nvtx_ranges.handle("ringflow/t/outer"), nvtx_ranges.handle("ringflow/t/in")
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        nvtx_ranges.call(outer, lambda: nvtx_ranges.call(nested, torch.mm, x, x))
    spans = {e.name: e.time_range for e in prof.events()
             if e.name.startswith("ringflow/t/") or e.name == "aten::mm"}
    assert set(spans) == {"ringflow/t/outer", "ringflow/t/in", "aten::mm"}
    assert spans["ringflow/t/outer"].start <= spans["ringflow/t/in"].start \
        <= spans["aten::mm"].start <= spans["aten::mm"].end <= spans["ringflow/t/in"].end \
        <= spans["ringflow/t/outer"].end
    assert pushed == ["ringflow/t/outer", "ringflow/t/in", "pop", "pop"]
