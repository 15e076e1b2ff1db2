"""The plugin asks Linux for the AMX tiles on a CPU build of torch (Note [AMX on vLLM's CPU
build]): vLLM-CPU's bf16 attention runs AMX instructions and never asks itself."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

from ringflow.integrations.vllm import plugin


@pytest.fixture
def amx(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    asked = []

    def init(granted=True):
        asked.append(True)
        return granted
    monkeypatch.setattr(torch.cpu, "_init_amx", init)
    return asked


def test_a_cpu_build_asks_for_the_tiles_where_the_cpu_has_them(amx, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    plugin.allow_amx()
    assert amx == [True]


def test_a_cuda_build_is_left_as_it_is(amx, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    plugin.allow_amx()
    assert amx == []


def test_a_refusal_says_what_will_fail_and_what_to_run(monkeypatch, caplog):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        plugin.allow_amx()
    assert "SIGILL" in caplog.text and "--dtype float32" in caplog.text
