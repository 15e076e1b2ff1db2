"""ARCHITECTURE.md's "The vLLM lifecycle on one page" names every vLLM surface ringflow hooks.

The page's table is the reader's map of which vLLM call reaches which hook. The hooks
themselves are installed from one table in code (``integrations/vllm/surfaces.py``), so the
page goes stale silently when a surface is added, renamed or dropped there. This test holds the
two together: every hooked surface is in the page's table by its key, and every ``vllm.`` name
in the table's first column is a surface's key.
"""

from __future__ import annotations

import re
from pathlib import Path

from ringflow.integrations.vllm.surfaces import SURFACES

ROOT = Path(__file__).resolve().parents[2]
TITLE = "## The vLLM lifecycle on one page"


def section() -> str:
    """The section's text, up to the next ``## `` heading."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert TITLE in text, f"ARCHITECTURE.md has no section '{TITLE}'"
    body = text.split(TITLE, 1)[1]
    return body.split("\n## ", 1)[0]


def first_column_names() -> set[str]:
    """Every backticked name in the first cell of the section's first table (rows only)."""
    rows = []
    for line in section().splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break  # the table ended
    cells = [row.split("|")[1] for row in rows[2:]]  # past the header and its rule
    assert cells, "the lifecycle section has no table"
    return {name for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


def test_every_hooked_surface_is_in_the_lifecycle_table():
    names = first_column_names()
    missing = sorted(s.key for s in SURFACES if s.hook is not None and s.key not in names)
    assert not missing, f"hooked in surfaces.py but not in ARCHITECTURE.md's lifecycle table: {missing}"


def test_every_vllm_name_in_the_lifecycle_table_is_a_surface():
    keys = {s.key for s in SURFACES}
    stale = sorted(n for n in first_column_names() if n.startswith("vllm.") and n not in keys)
    assert not stale, f"ARCHITECTURE.md's lifecycle table names what surfaces.py does not: {stale}"
