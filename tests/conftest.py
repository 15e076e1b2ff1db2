"""CPU by default; tests marked ``cuda`` run only where a CUDA device exists (``pytest -m cuda``)."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m cuda` on one")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread():
    # The tensors here are tiny; several OpenMP threads on a small CI machine only contend.
    torch.set_num_threads(1)
