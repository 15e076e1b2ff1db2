"""The card's folders install as ringflow.* and nothing else lands at the top of site-packages."""

import subprocess
import sys
from importlib import metadata
from pathlib import Path


def test_subpackages_import_under_ringflow_and_not_at_top_level(tmp_path):
    code = (
        "import importlib.util as u, ringflow, ringflow.orchestrator, ringflow.graphs, "
        "ringflow.kernels, ringflow.integrations.vllm, ringflow.profiles\n"
        "print([n for n in ('graphs', 'kernels', 'orchestrator', 'integrations', 'profiles') "
        "if u.find_spec(n)])"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_public_api_is_small_and_importable():
    import ringflow

    for name in ringflow.__all__:
        assert hasattr(ringflow, name), name
    assert len(ringflow.__all__) < 40


def test_the_public_api_loads_lazily_and_each_name_is_its_modules_own():
    """``import ringflow`` loads none of it (Note [Lazy public API]); ``from ringflow import X``
    gives the object its module defines, for every X."""
    code = (
        "import importlib, sys, ringflow\n"
        "assert not [m for m in sys.modules if m.startswith('ringflow.')], sorted(sys.modules)\n"
        "for name in ringflow.__all__:\n"
        "    exec(f'from ringflow import {name} as got')\n"
        "    module = importlib.import_module(ringflow._EXPORTS[name])\n"
        "    assert got is getattr(module, name) and got.__module__ == module.__name__, name\n"
        "try:\n"
        "    ringflow.NoSuchName\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "module 'ringflow' has no attribute 'NoSuchName'"


def test_the_distribution_declares_its_dependencies():
    requires = " ".join(metadata.requires("ringflow") or [])
    for dep in ("torch", "cuda-python", "nvtx", "pyyaml", "pytest", "hypothesis"):
        assert dep in requires.lower(), dep


def test_python_started_next_to_a_checkout_named_ringflow_imports_the_real_package(tmp_path):
    """The checkout first on sys.path (Python run in its parent folder) is the package itself
    (the root __init__.py), not a namespace package shadowing it without its API."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "ringflow").symlink_to(root, target_is_directory=True)  # as a clone names it
    code = ("import ringflow, importlib.resources as r; "
            "print(ringflow.load_profile('demo').name, ringflow.__file__); "
            "import ringflow.integrations.vllm.plugin as p; print(p.__file__); "
            "print(r.files('ringflow.profiles').joinpath('demo.yaml').is_file())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, plugin, data = proc.stdout.split("\n")[:3]
    assert first == f"demo {root / 'ringflow' / '__init__.py'}"
    assert plugin == str(root / "integrations" / "vllm" / "plugin.py")
    assert data == "True"
