"""Every module has one level, and imports run downward only (ARCHITECTURE.md, "Rooms").

:data:`LAYERS` names every module of the package and every ``tools/*.py`` script with its
level; :data:`MAY_IMPORT` says which levels a level may load. Each module is imported alone
in a fresh interpreter and everything its import loaded is checked against its level (torch
too: the root's own modules and the plan are pure Python), every import statement is read
(an import inside a function runs later than the fresh import sees), and no module reaches
into another's private names.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: module -> level. A new module must be added here (test_the_table_names_every_module).
LAYERS = {
    # the root's own modules: below every room (no torch)
    "ringflow": "root", "ringflow.errors": "root", "ringflow.envs": "root",
    "ringflow.units": "root", "ringflow.arguments": "root",
    # the root's device utilities: the CUDA runtime binding and CUDA event timing
    "ringflow.cudart": "device", "ringflow.timing": "device",
    # plan + prove: pure arithmetic over names, no torch
    **dict.fromkeys([f"ringflow.orchestrator{m}" for m in (
        "", ".vocab", ".budget", ".schema", ".placement", ".sections", ".profile_yaml",
        ".profile", ".dag", ".planner",
        ".hazards", ".expert_hazards", ".simulate", ".dumps", ".expert_model", ".host_split")],
        "plan"),
    # leaves: the gathers and exchanges, and the tests' CPU references
    **dict.fromkeys([f"ringflow.kernels{m}" for m in (
        "", ".row_gather", ".gathers", ".dcp_rows", ".kv_gathers", ".peer_exchange",
        ".expert_fetch", ".expert_plan", ".moe", ".host_moe")], "kernels"),
    "ringflow.kernels.reference": "reference",
    # execute: slots, streams, NVTX, executors
    **dict.fromkeys([f"ringflow.graphs{m}" for m in (
        "", ".slots", ".streams", ".nvtx_ranges", ".executor", ".sync", ".eager", ".captured",
        ".stepped", ".graph_view", ".host_node")], "execute"),
    # engine-neutral adapters over a layer stack
    **dict.fromkeys([f"ringflow.integrations{m}" for m in (
        "", ".torch", ".torch.layer_ops", ".torch.weight_stream", ".torch.kv_prefetch",
        ".torch.verification", ".torch.chunk_prefetch", ".torch.expert_cache",
        ".torch.expert_lookahead", ".torch.expert_layers", ".torch.expert_arena",
        ".torch.expert_lane",
        ".torch.host_experts")], "adapters"),
    # vLLM only; its plugin is the entry point, imported by nothing of ringflow
    **dict.fromkeys([f"ringflow.integrations.vllm{m}" for m in (
        "", ".surfaces", ".state", ".hooks", ".compat", ".config", ".cache_key", ".frontend",
        ".layers", ".memory", ".metadata", ".graph_mode", ".startup_errors", ".weights",
        ".mla_check", ".dcp", ".context_recording", ".context_ring", ".context_session",
        ".context_hooks", ".context_attach", ".attention", ".expert_kernel", ".expert_host",
        ".experts", ".expert_placement")],
        "vllm"),
    "ringflow.integrations.vllm.plugin": "plugin",
    # test helpers users can reuse, then measurement
    **dict.fromkeys([f"ringflow.testing{m}" for m in (
        "", ".tracing", ".races", ".models", ".spawn", ".dcp", ".tiny_models",
        ".busy_python")], "testing"),
    **dict.fromkeys([f"ringflow.bench{m}" for m in (
        "", ".names", ".records", ".workload", ".hand_ring", ".timeline", ".scenarios", ".tune",
        ".dcp", ".exit", ".gpu_trace")],
        "bench"),
    # the top: the command line and the scripts that run on a lent GPU
    "ringflow.cli": "cli", "ringflow.__main__": "cli",
    **{f"tools/{p.name}": "tool" for p in sorted((ROOT / "tools").glob("*.py"))},
}

_BELOW_ADAPTERS = {"root", "device", "plan", "kernels", "execute", "adapters"}
#: level -> the levels a module of it may load (its own included)
MAY_IMPORT = {
    "root": {"root"},
    "device": {"root", "device"},
    "plan": {"root", "plan"},
    "kernels": {"root", "device", "kernels"},
    "reference": {"root", "device", "kernels", "reference"},  # the kernels package loads with it
    "execute": {"root", "device", "plan", "execute"},
    "adapters": _BELOW_ADAPTERS,
    "vllm": _BELOW_ADAPTERS | {"vllm"},
    "plugin": _BELOW_ADAPTERS | {"vllm", "plugin"},
    "testing": _BELOW_ADAPTERS | {"reference", "testing"},
    "bench": _BELOW_ADAPTERS | {"reference", "testing", "bench"},
    "cli": _BELOW_ADAPTERS | {"testing", "bench", "cli"},
    # a tool that measures vLLM reads the vLLM integration's state (never the plugin module)
    "tool": _BELOW_ADAPTERS | {"reference", "testing", "bench", "cli", "vllm", "tool"},
}
PURE = {"root", "plan"}  # importing these must not load torch (nor yaml, for the root)
PACKAGES = ("ringflow", "ringflow.orchestrator", "ringflow.kernels", "ringflow.graphs",
            "ringflow.integrations", "ringflow.integrations.torch", "ringflow.integrations.vllm",
            "ringflow.testing", "ringflow.bench")
MODULES = [m for m in LAYERS if not m.startswith("tools/") and m != "ringflow.__main__"]


def level_of(name: str) -> str | None:
    """The level of ringflow module ``name`` (a submodule inherits its package's, where the
    table is silent); None for modules outside ringflow."""
    while name:
        if name in LAYERS:
            return LAYERS[name]
        name = name.rpartition(".")[0]
    return None


def breaks(module: str, name: str) -> bool:
    """Whether ``module`` loading ``name`` breaks the layering."""
    level = LAYERS[module]
    if name == "torch" or name.startswith("torch."):
        return level in PURE
    if level == "root" and (name == "yaml" or name.startswith("yaml.")):
        return True
    target = level_of(name) if name.split(".")[0] == "ringflow" else None
    return target is not None and target not in MAY_IMPORT[level]


def test_the_table_names_every_module():
    """The table is the list of modules: one added without a level fails here."""
    found = set()
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        found.add(package)
        found |= {f"{package}.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations)
                  if not m.ispkg}
    found |= {f"tools/{p.name}" for p in (ROOT / "tools").glob("*.py")}
    assert found == set(LAYERS), (f"not in LAYERS: {sorted(found - set(LAYERS))}; "
                                  f"gone: {sorted(set(LAYERS) - found)}")
    assert set(LAYERS.values()) <= set(MAY_IMPORT)


# One interpreter per group forks a child per module, and the child imports it: a fresh import
# of ringflow each time. The group whose modules may use torch imports it first, once (a third-
# party module cannot load any of ringflow; importing torch per child would take minutes).
_PROBE = """
import importlib, json, os, sys
if sys.argv[1]:
    importlib.import_module(sys.argv[1])
found = {}
for name in sys.argv[2:]:
    read, write = os.pipe()
    if os.fork() == 0:
        try:
            os.close(read)
            importlib.import_module(name)
            with os.fdopen(write, "w") as pipe:
                pipe.write(json.dumps(sorted(sys.modules)))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        found[name] = json.loads(pipe.read() or "null")
    os.wait()
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str] | None]:
    """Module -> every module its import loaded (None: the import failed)."""
    found = {}
    for preload in ("", "torch"):
        group = [m for m in MODULES if (LAYERS[m] in PURE) == (preload == "")]
        proc = subprocess.run([sys.executable, "-c", _PROBE, preload, *group],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        found.update(json.loads(proc.stdout))
    return {m: None if found[m] is None else set(found[m]) for m in MODULES}


@pytest.mark.parametrize("module", MODULES)
def test_importing_a_module_loads_nothing_above_its_level(loaded, module):
    assert loaded[module] is not None, f"import {module} failed (run it to see why)"
    bad = sorted(name for name in loaded[module] if breaks(module, name))
    assert not bad, f"import {module} ({LAYERS[module]}) loaded {bad}"


def _source(module: str) -> Path:
    if module.startswith("tools/"):
        return ROOT / module
    return Path(importlib.util.find_spec(module).origin)


def _imports(tree: ast.AST):
    """``(line, module imported, names taken from it)`` of every import statement."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]


def test_no_module_imports_upward_even_inside_a_function():
    """The fresh imports above see module-level imports; an import inside a function (how the
    attention hooks once reached the plugin) runs later, so read every import statement."""
    bad = []
    for module in LAYERS:
        for line, name, names in _imports(ast.parse(_source(module).read_text())):
            targets = [name] + [f"{name}.{n}" for n in names
                                if name.split(".")[0] == "ringflow" and
                                importlib.util.find_spec(name).submodule_search_locations
                                and f"{name}.{n}" in LAYERS]
            bad += [f"{module}:{line} imports {t}" for t in targets if breaks(module, t)]
    assert not bad, "\n".join(bad)


def _private_uses(path: Path) -> list[str]:
    """``from ringflow.x import _name``, and ``m._name`` where ``m`` is a ringflow module that
    the file imported: a module's private names are its own."""
    tree = ast.parse(path.read_text())
    modules, found = set(), []
    for line, name, names in _imports(tree):
        if name.split(".")[0] != "ringflow":
            continue
        found += [f"{path.relative_to(ROOT)}:{line} imports {name}.{n}" for n in names
                  if n.startswith("_") and not n.startswith("__")]
        package = importlib.util.find_spec(name).submodule_search_locations
        modules |= {n for n in names if package and f"{name}.{n}" in LAYERS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.asname and a.name.startswith("ringflow")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


def test_no_file_reaches_into_another_modules_private_names():
    files = [_source(m) for m in LAYERS] + sorted((ROOT / "tests").rglob("*.py"))
    bad = [use for path in files for use in _private_uses(path)]
    assert not bad, "\n".join(bad)


def test_the_checks_can_fail():
    """The rules above are not vacuous: an upward import, torch in the plan and a private
    name are each caught."""
    assert breaks("ringflow.orchestrator.planner", "ringflow.graphs.eager")
    assert breaks("ringflow.orchestrator.planner", "torch")
    assert breaks("ringflow.kernels.gathers", "ringflow.orchestrator.dag")
    assert breaks("ringflow.integrations.torch.kv_prefetch", "ringflow.integrations.vllm.state")
    assert breaks("ringflow.bench.dcp", "ringflow.cli")
    assert breaks("ringflow.integrations.vllm.attention", "ringflow.integrations.vllm.plugin")
    assert not breaks("ringflow.integrations.vllm.plugin", "ringflow.integrations.vllm.attention")
