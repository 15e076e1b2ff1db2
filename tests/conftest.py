"""CPU by default; tests marked ``cuda`` run only where a CUDA device exists (``pytest -m cuda``)."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--mutant", default=None,
                     help="patch the executors with a deliberate ordering bug (tests/helpers/mutants.py; "
                          "tools/gpu-mutants runs them all) before any test runs")


def pytest_configure(config):
    from helpers import mutants

    name = config.getoption("--mutant")
    if name:
        mutants.apply(name)
    else:
        mutants.apply_from_env()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m cuda` on one")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread():
    # The tensors here are tiny; several OpenMP threads on a small CI machine only contend.
    torch.set_num_threads(1)


class NvtxRecorder:
    """Stands in for the NVTX backend: records the range names pushed, in order."""

    def __init__(self):
        self.pushed = []
        self.events = []

    def handle(self, message):
        return message

    def push(self, handle):
        self.pushed.append(handle)
        self.events.append(("push", handle))

    def pop(self):
        self.events.append(("pop", None))


@pytest.fixture
def nvtx_recorder(monkeypatch):
    from ringflow.graphs import nvtx_ranges

    recorder = NvtxRecorder()
    monkeypatch.setattr(nvtx_ranges, "backend", recorder)
    return recorder
