"""The README's recipes (#48) run as printed on the build they name: each block after a
``<!-- recipe: vllm-cpu -->`` line (CI, vLLM's CPU build) or a ``<!-- recipe: vllm-cuda -->``
line (marked cuda: vLLM's CUDA build on a GPU) is run whole by bash, exactly as the README shows
it (it writes a tiny model, serves it with ringflow on, asks for four tokens, prints ringflow's
lines and stops the server); it must print a finished completion and every line of the output
block that follows it (a line ending in ``...`` is a prefix of one it printed). With
``RECIPES_PRINTED_DIR`` set, each run's printed text is also written there (the device run
keeps it)."""

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
CUDA_RECIPES = recipes("vllm-cuda")
PORT = 8321  # the recipes' port


def test_the_readme_has_a_recipe_for_each_vllm_section_on_each_build():
    for found, want in ((RECIPES, {"vllm_weights", "vllm_kv_prefetch", '"experts"'}),
                        (CUDA_RECIPES, {"vllm_weights", '"experts"'})):
        sections = {name for block, _ in found for name in ("vllm_weights", "vllm_kv_prefetch",
                                                            '"experts"') if name in block.text}
        assert sections == want, sections
        assert all(output is not None for _, output in found)


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
    serves_as_printed(block, output, tmp_path, {"CUDA_VISIBLE_DEVICES": ""}, 420)


@pytest.mark.cuda
@pytest.mark.parametrize("block, output", CUDA_RECIPES, ids=[b.id for b, _ in CUDA_RECIPES])
def test_a_cuda_recipe_of_the_readme_serves_as_printed(block, output, tmp_path):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and vLLM's CUDA build; run `pytest -m cuda` on one")
    serves_as_printed(block, output, tmp_path, {}, 600)


def serves_as_printed(block, output, tmp_path, env: dict, timeout: int) -> None:
    if shutil.which("curl") is None:
        pytest.skip("the recipes ask the server with curl, which this machine lacks")
    assert port_free(90), f"port {PORT}, which the recipe names, is taken"
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           **env}
    proc = subprocess.Popen(["bash", "-c", block.text], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        printed, _ = proc.communicate(timeout=timeout)
    finally:  # the recipe's `kill %1` stops the server; what is left after a minute is killed
        port_free(60)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    keep = os.environ.get("RECIPES_PRINTED_DIR")
    if keep:
        name = block.id.replace("/", "_").replace(":", "-")
        os.makedirs(keep, exist_ok=True)
        with open(os.path.join(keep, f"{name}.txt"), "w") as f:
            f.write(printed)
            if os.path.exists("/tmp/ringflow-vllm.log"):  # the server's log the recipe wrote
                with open("/tmp/ringflow-vllm.log") as log:
                    f.write("\n--- /tmp/ringflow-vllm.log ---\n" + log.read()[-20000:])
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
