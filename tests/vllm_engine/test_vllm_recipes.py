"""The README's recipes for vLLM's CPU build (#48) run as printed: each block after a
``<!-- recipe: vllm-cpu -->`` line is run whole by bash, exactly as the README shows it (it writes
a tiny model, serves it with ringflow on, asks for four tokens, prints ringflow's lines and stops
the server); it must print a finished completion and every line of the output block that
follows it (a line ending in ``...`` is a prefix of one it printed)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers.vllm_required import require_vllm

require_vllm(module_level=True)

from docs.test_readme import recipes  # noqa: E402  (the README's blocks, parsed there)

RECIPES = recipes()
PORT = 8321  # the recipes' port


def test_the_readme_has_a_cpu_recipe_for_each_vllm_section():
    sections = {name for block, _ in RECIPES for name in ("vllm_weights", "vllm_kv_prefetch",
                                                          '"experts"') if name in block.text}
    assert sections == {"vllm_weights", "vllm_kv_prefetch", '"experts"'}, sections
    assert all(output is not None for _, output in RECIPES)


def port_free(seconds: float) -> bool:
    """Whether nothing listens on the recipes' port, waiting up to ``seconds`` for a server
    that is shutting down (an earlier recipe's) to let it go."""
    deadline = time.monotonic() + seconds
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", PORT)) != 0:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(1)


@pytest.mark.parametrize("block, output", RECIPES, ids=[b.id for b, _ in RECIPES])
def test_a_cpu_recipe_of_the_readme_serves_as_printed(block, output, tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("the recipes ask the server with curl, which this machine lacks")
    assert port_free(90), f"port {PORT}, which the recipe names, is taken"
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(["bash", "-c", block.text], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        printed, _ = proc.communicate(timeout=420)
    finally:  # the recipe's `kill %1` stops the server; what is left after a minute is killed
        port_free(60)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, printed[-3000:]
    lines = printed.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('{"id":"cmpl-')), None)
    assert start is not None, printed[-3000:]
    # curl prints no newline: grep's first line follows the reply on its line
    reply, end = json.JSONDecoder().raw_decode(lines[start])
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 4
    said = [lines[start][end:]] + lines[start + 1:]
    for want in output.text.strip().splitlines():
        if want.endswith("..."):
            assert any(line.startswith(want[:-3].rstrip()) for line in said), (want, said)
        else:
            assert want in said, (want, said)
