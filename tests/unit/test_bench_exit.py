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
    run = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    # without the kill, the sleeps hold the pipe open for two minutes
    out, _ = run.communicate(timeout=30)
    assert "written" in out
    # bash, its two sleeps (bash may exec the last one itself) and the lone sleep
    assert int(re.search(r"killed (\d+) engine process", out).group(1)) >= 3
    assert run.returncode == 0


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
