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
