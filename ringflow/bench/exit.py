"""Leave a benchmark at once when its results are written, and take its engines with it."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def exit_now(code: int = 0) -> None:
    """``os._exit`` after SIGKILL to every process this one started, and theirs.

    vLLM's engine shutdown can hang, so the tools leave with ``os._exit``; alone, that leaves
    vLLM's EngineCore processes running on the GPU, and as they hold the run's stdout, a
    shell pipe (``| tee``) stays open until the device call's limit (seen on an H100: seven
    idle minutes of device time)."""
    found = descendants(os.getpid())
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if found:
        print(f"[bench] killed {len(found)} engine process(es) left running", flush=True)
    os._exit(code)


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry.name))
    stack, found = [root], []
    while stack:
        for pid in children.get(stack.pop(), []):
            found.append(pid)
            stack.append(pid)
    return found
