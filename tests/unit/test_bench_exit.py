"""The benchmarks leave with their engines: nothing they started keeps running or holds their pipe."""

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

CHILD = textwrap.dedent("""
    import subprocess, sys, time
    from ringflow.bench.exit import exit_now
    # an engine that started a worker of its own, both holding this process's stdout
    subprocess.Popen(["bash", "-c", "sleep 120 & sleep 120"])
    subprocess.Popen(["sleep", "120"])
    time.sleep(0.5)
    print("written", flush=True)
    exit_now()
""")


def test_exit_now_kills_the_processes_it_started_and_frees_the_pipe():
    # a session of its own, so that a failure here leaves no sleep running
    run = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        # without the kill, the sleeps hold the pipe open for two minutes
        out, _ = run.communicate(timeout=30)
    finally:
        try:
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        run.wait()
    assert "written" in out
    # bash, its two sleeps (bash may exec the last one itself) and the lone sleep
    assert int(re.search(r"killed (\d+) engine process", out).group(1)) >= 3
    assert run.returncode == 0


def test_the_resource_tracker_is_spared_to_clean_up():
    """Python's multiprocessing resource tracker outlives the kill: it unlinks what vLLM
    registered with it once the processes holding its pipe are gone."""
    from ringflow.bench.exit import descendants

    child = subprocess.Popen([sys.executable, "-c", (
        "from multiprocessing import resource_tracker as r; r.ensure_running(); "
        "import subprocess; subprocess.Popen(['sleep', '60']); import time; time.sleep(60)")],
        start_new_session=True)
    try:
        found = []
        for _ in range(100):
            found = descendants(child.pid)
            if found:
                break
            subprocess.run(["sleep", "0.05"])
        subprocess.run(["sleep", "0.5"])  # the tracker starts before the sleep
        names = [open(f"/proc/{pid}/cmdline", "rb").read() for pid in descendants(child.pid)]
        assert names and all(b"resource_tracker" not in n for n in names), names
        assert any(n.startswith(b"sleep") for n in names), names
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def test_descendants_finds_grandchildren_and_not_the_root():
    from ringflow.bench.exit import descendants

    outer = subprocess.Popen(["bash", "-c", "sleep 60 & wait"])
    try:
        for _ in range(100):
            found = descendants(outer.pid)
            if found:
                break
            subprocess.run(["sleep", "0.05"])
        assert len(found) == 1 and outer.pid not in found
        assert outer.pid in descendants(os.getpid())
    finally:
        for pid in descendants(outer.pid):
            os.kill(pid, signal.SIGKILL)
        outer.kill()
        outer.wait()
