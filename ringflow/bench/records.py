"""The record every benchmark writes: what ran, where, with which software, and its results.

One shape for every JSON file under ``profiles/results/`` (``gpu``, ``gpus``, ``torch``, ``cuda``,
``command``, then the benchmark's own fields), so a reader never has to guess which machine or
command a number came from.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ringflow.orchestrator.dumps import write_json


def command_line(program: str) -> str:
    """``program`` and this process's arguments, as a user would retype them."""
    return " ".join([program, *sys.argv[1:]])


def source_commit() -> str | None:
    """The git commit ringflow runs from (``+dirty`` with local changes); None outside a
    checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def environment(program: str) -> dict[str, Any]:
    """Where a benchmark ran: the GPU (name and count), torch, CUDA, ringflow (version and
    commit), and the command."""
    from ringflow import __version__
    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name() if cuda else None,
            "gpus": torch.cuda.device_count() if cuda else 0,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "ringflow": __version__, "commit": source_commit(),
            "command": command_line(program)}


def gpu_slug() -> str:
    """The GPU as a file name says it (``NVIDIA H200`` -> ``h200``; ``cpu`` without one): plots
    and results are named by what they measure and where."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower().removeprefix("nvidia").strip()
    return "-".join("".join(c if c.isalnum() else " " for c in name).split()) or "gpu"


def record(program: str, **fields: Any) -> dict[str, Any]:
    """:func:`environment` followed by the benchmark's ``fields``."""
    return {**environment(program), **fields}


def write(path: Path | str, doc: dict[str, Any]) -> Path:
    """Write ``doc`` as indented JSON.

    Raises:
        OutputError: the file cannot be written (the OS error is the cause).
    """
    return write_json(path, doc, "give a writable path")
