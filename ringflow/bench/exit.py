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
    idle minutes of device time). Python's multiprocessing resource tracker is spared: it
    unlinks the shared memory vLLM registered with it and exits once every process holding
    its pipe is gone. Scans until none is left (a process may start one while it is killed),
    at most a few times."""
    killed = 0
    for _ in range(4):
        found = descendants(os.getpid())
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    if killed:
        print(f"[bench] killed {killed} engine process(es) left running", flush=True)
    os._exit(code)


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` but zombies and Python's resource tracker (Linux
    ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    spared: set[int] = set()
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            tracker = b"resource_tracker" in (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(int(ppid), []).append(int(entry.name))
        if state == "Z" or tracker:
            spared.add(int(entry.name))
    stack, found = [root], []
    while stack:
        for pid in children.get(stack.pop(), []):
            if pid not in spared:
                found.append(pid)
            stack.append(pid)
    return found
