"""The card's folders install as ringflow.* and nothing else lands at the top of site-packages."""

import subprocess
import sys
from importlib import metadata


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


def test_the_distribution_declares_its_dependencies():
    requires = " ".join(metadata.requires("ringflow") or [])
    for dep in ("torch", "cuda-python", "nvtx", "pyyaml", "pytest", "hypothesis"):
        assert dep in requires.lower(), dep
