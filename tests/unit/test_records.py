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
