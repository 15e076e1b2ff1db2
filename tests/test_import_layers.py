"""Imports run one way (README, "Layout"): integrations -> graphs -> orchestrator; kernels are
leaves; ``ringflow.errors`` (and the lazy package root) sit below them all.

Every module of every layer is imported alone in a fresh interpreter, and the test lists what
that import must NOT have loaded: a layer above it, a sibling it has no business with, torch
(the orchestrator is arithmetic, except the pool that allocates), the tests' CPU references
(``kernels/reference.py``) or the vLLM plugin (its entry point: nothing imports it).
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

import ringflow.graphs
import ringflow.integrations.vllm
import ringflow.kernels
import ringflow.orchestrator

ORCHESTRATOR, GRAPHS = "ringflow.orchestrator", "ringflow.graphs"
KERNELS, INTEGRATIONS = "ringflow.kernels", "ringflow.integrations"
PLUGIN = "ringflow.integrations.vllm.plugin"
NEEDS_TORCH = {"ringflow.orchestrator.slots"}  # SlotPool allocates the ring


def _modules(package) -> list[str]:
    return [package.__name__] + [f"{package.__name__}.{m.name}"
                                 for m in pkgutil.iter_modules(package.__path__)]


def forbidden(module: str) -> set[str]:
    """What importing ``module`` must not load (a name stands for its submodules too)."""
    if module in ("ringflow", "ringflow.errors"):
        return {"torch", "yaml", ORCHESTRATOR, GRAPHS, KERNELS, INTEGRATIONS}
    never = {"ringflow.kernels.reference"}  # the runtime does not run the tests' references
    if module.startswith(ORCHESTRATOR):
        return never | {GRAPHS, KERNELS, INTEGRATIONS} | (
            set() if module in NEEDS_TORCH else {"torch"})
    if module.startswith(KERNELS):
        return ({ORCHESTRATOR, GRAPHS, INTEGRATIONS} |
                (set() if module == "ringflow.kernels.reference" else never))
    if module.startswith(GRAPHS):  # kernels reach a plan as callables, never as imports
        return never | {KERNELS, INTEGRATIONS}
    return never | ({PLUGIN} if module != PLUGIN else set())


def _breaks(module: str, name: str) -> bool:
    """Whether ``module`` loading ``name`` breaks the layering."""
    return any(name == f or name.startswith(f + ".") for f in forbidden(module))


MODULES = ["ringflow", "ringflow.errors", *(m for p in (ringflow.orchestrator, ringflow.kernels,
                                                       ringflow.graphs, ringflow.integrations.vllm)
                                            for m in _modules(p))]

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
        group = [m for m in MODULES if ("torch" in forbidden(m)) == (preload == "")]
        proc = subprocess.run([sys.executable, "-c", _PROBE, preload, *group],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        found.update(json.loads(proc.stdout))
    return {m: None if found[m] is None else set(found[m]) for m in MODULES}


@pytest.mark.parametrize("module", MODULES)
def test_importing_a_layer_loads_nothing_above_it(loaded, module):
    assert loaded[module] is not None, f"import {module} failed (run it to see why)"
    bad = sorted(name for name in loaded[module] if _breaks(module, name))
    assert not bad, f"import {module} loaded {bad}"


def test_no_layer_imports_upward_even_inside_a_function():
    """The fresh imports above see module-level imports; an import inside a function (how the
    attention hooks once reached the plugin) runs later, so read every import statement."""
    bad = []
    for module in MODULES:
        path = importlib.util.find_spec(module).origin
        for node in ast.walk(ast.parse(Path(path).read_text(), path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            bad += [f"{module}:{node.lineno} imports {name}" for name in names
                    if _breaks(module, name)]
    assert not bad, "\n".join(bad)


def test_every_layer_is_probed():
    """The module list comes from the packages: an empty one would pass everything above."""
    assert {"ringflow.orchestrator.budget", "ringflow.orchestrator.planner",
            "ringflow.orchestrator.profile", "ringflow.graphs.eager", "ringflow.kernels",
            "ringflow.integrations.vllm.attention", "ringflow.integrations.vllm.verification",
            PLUGIN} <= set(MODULES)
