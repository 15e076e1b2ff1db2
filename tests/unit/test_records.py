"""Every benchmark record says which ringflow made it (ringflow/bench/records.py)."""

import re

from ringflow import __version__
from ringflow.bench import records


def test_a_record_names_the_ringflow_version_and_commit_it_came_from(tmp_path):
    doc = records.record("python3 tools/x.py", value=1)
    assert doc["ringflow"] == __version__ and doc["value"] == 1
    commit = doc["commit"]  # this checkout's HEAD; None only outside a git checkout
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit), commit
    path = records.write(tmp_path / "r.json", doc)
    assert '"commit"' in path.read_text()


def test_a_gpu_is_named_in_file_names_by_its_model(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device, slug in [("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
                         ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb")]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, d=device: d)
        assert records.gpu_slug() == slug
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert records.gpu_slug() == "cpu"
