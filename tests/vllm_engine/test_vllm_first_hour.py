"""A vLLM user's first hour (#38), on vLLM's CPU build: every vLLM server command the README
shows serves a tiny model as written (the model name swapped, CPU sizes added), and a mistake in
a profile is the server's last line, one ``ringflow:`` line naming where the value came from,
with exit status 2 (Note [One line at start-up] in ``integrations/vllm/startup_errors.py``);
``LLM(...)`` raises it as one typed error."""

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.vllm_required import require_vllm

require_vllm(module_level=True)

from helpers.vllm_e2e import write_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SERVER = "vllm.entrypoints.openai.api_server"
#: what a CPU needs beside the README's command: vLLM-CPU sizes its KV cache from these
CPU_ARGS = ["--skip-tokenizer-init", "--max-model-len", "256", "--enforce-eager",
            "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(32 << 20)]
MLA_CPU_ARGS = ["--dtype", "float32", "--attention-backend", "CPU_MLA"]
#: flags of the GPU's expert lane (Note [Experts in vLLM]) that vLLM's CPU build has no use for:
#: it has no Triton MoE, and its parameters already live in host memory
GPU_ONLY = ("--moe-backend", "--cpu-offload-gb", "--cpu-offload-params")
BAD_WORKSPACE = {"offload": {"layers": "all", "depth": 1, "workspace_mib": 1}}


def readme_server_commands() -> list[str]:
    from docs.test_readme import vllm_server_commands  # the READMEs' blocks, parsed there
    return vllm_server_commands()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: write_model(root, name) for name in ("llama8", "dsv2", "qwen3_moe16")}


def argv_of(command: str, models: dict) -> tuple[dict, list[str]]:
    """The README's ``command`` as this machine runs it: its variables, and its arguments with
    the model swapped for a tiny one of the same family and the CPU's sizes added."""
    parts = shlex.split(command)
    env = {}
    while parts and "=" in parts[0] and not parts[0].startswith("-"):
        key, value = parts.pop(0).split("=", 1)
        env[key] = value
    assert parts[:3] == ["python", "-m", SERVER], command
    argv = [sys.executable, "-m", SERVER, *parts[3:]]
    at = argv.index("--model") + 1
    mla = "deepseek" in argv[at].lower()
    moe = "qwen3" in argv[at].lower() and "a3b" in argv[at].lower()
    argv[at] = models["dsv2" if mla else "qwen3_moe16" if moe else "llama8"]
    for flag in GPU_ONLY:
        if flag in argv:
            del argv[argv.index(flag):argv.index(flag) + 2]
    return env, argv + CPU_ARGS + (MLA_CPU_ARGS if mla else [])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_to_exit(env: dict, argv: list[str], timeout: int = 300,
                both: bool = False) -> tuple[int, list[str], float]:
    """A server command that must stop by itself: its status, stderr lines (``both``: stdout's
    too, interleaved, where vLLM logs its workers), seconds."""
    began = time.perf_counter()
    proc = subprocess.run(argv + ["--port", str(free_port())], env={**os.environ, **env},
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if both else subprocess.PIPE,
                          text=True, timeout=timeout)
    lines = (proc.stdout if both else proc.stderr).splitlines()
    return proc.returncode, lines, time.perf_counter() - began


def serve(env: dict, argv: list[str], log: Path) -> dict:
    """Start the server, complete three prompt tokens once, stop it; the reply and the log."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv + ["--port", str(port)], env={**os.environ, **env},
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        model = argv[argv.index("--model") + 1]
        body = json.dumps({"model": model, "prompt": [1, 17, 42], "max_tokens": 4,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"answer": answer, "log": log.read_text()}


def test_the_readme_shows_vllm_server_commands():
    assert len(readme_server_commands()) >= 3


@pytest.mark.parametrize("command", readme_server_commands())
def test_each_vllm_server_command_of_the_readme_serves(command, models, tmp_path):
    env, argv = argv_of(command, models)
    got = serve(env, argv, tmp_path / "server.log")
    [choice] = got["answer"]["choices"]
    assert choice["finish_reason"] in ("length", "stop"), got["answer"]
    profile = env.get("RINGFLOW_PROFILE") or "additional-config" in command
    said = [line for line in got["log"].splitlines() if "ringflow: version " in line]
    assert len(said) == 1 and (("profile '" in said[0]) == bool(profile)), said


FRONT_END = [  # found before any engine process starts: (variables, extra arguments, expected)
    ({"RINGFLOW_PROFILE": "vllm_weightz"}, [], "ringflow: RINGFLOW_PROFILE=vllm_weightz: no such"),
    ({}, ["--additional-config", '{"ringflow": {}}'],
     "ringflow: additional_config.ringflow: is empty; vLLM needs an offload, a kv_prefetch "
     "or an experts"),
    ({"RINGFLOW_PROFILE": "demo"}, [], "ringflow: RINGFLOW_PROFILE=demo (<builtin demo>): is not "
                                       "a vLLM profile"),
]


@pytest.mark.parametrize("env,extra,expected", FRONT_END, ids=["name", "empty", "planner"])
def test_a_front_end_mistake_is_the_servers_last_line_with_no_traceback(models, env, extra,
                                                                      expected):
    code, err, seconds = run_to_exit(env, [sys.executable, "-m", SERVER, "--model",
                                           models["llama8"], *CPU_ARGS, *extra])
    assert code == 2 and err[-1].startswith(expected), err[-5:]
    assert not any("Traceback" in line for line in err), "\n".join(err)
    print(f"[first-hour] {expected[:60]!r}: {len(err)} stderr lines, {seconds:.1f} s")


def test_a_mistake_found_while_the_model_loads_is_the_servers_last_line(models, tmp_path):
    profile = tmp_path / "small-ring.yaml"
    profile.write_text(json.dumps(BAD_WORKSPACE))
    code, err, seconds = run_to_exit({"RINGFLOW_PROFILE": str(profile)},
                                     [sys.executable, "-m", SERVER, "--model", models["llama8"],
                                      *CPU_ARGS])
    assert code == 2, err[-5:]
    assert err[-1].startswith(f"ringflow: RINGFLOW_PROFILE={profile}: field "
                              f"'offload.workspace_mib'"), err[-5:]
    assert not any("Traceback" in line for line in err), "\n".join(err)
    print(f"[first-hour] after load: {len(err)} stderr lines, {seconds:.1f} s")


def test_a_start_vllm_refuses_shows_vllms_traceback_alone_and_ringflows_one_line(models):
    """vLLM-CPU asked for more of its node's memory than is free stops while starting (its own
    ValueError, in its engine and front-end tracebacks): no frame of ringflow's hooks in them
    (Note [vLLM's errors keep vLLM's frames]), and the one line ringflow adds said it before."""
    argv = [sys.executable, "-m", SERVER, "--model", models["llama8"], "--skip-tokenizer-init",
            "--max-model-len", "256", "--enforce-eager", "--gpu-memory-utilization", "0.99"]
    code, err, seconds = run_to_exit({"RINGFLOW_PROFILE": "vllm_weights"}, argv, both=True)
    assert code != 0 and "Traceback (most recent call last):" in "\n".join(err), err[-5:]
    assert any("desired CPU memory utilization" in line for line in err), "\n".join(err[-40:])
    ours = [line for line in err if 'File "' in line and ("/integrations/vllm/" in line
                                                          or "/ringflow/" in line)]
    assert not ours, "\n".join(ours)
    said = [line for line in err if "ringflow: vLLM-CPU reserves --gpu-memory-utilization 0.99"
            in line]
    assert len(said) == 1 and "it will likely stop while starting" in said[0], said
    print(f"[first-hour] vLLM's memory refusal: {len(err)} lines, {seconds:.1f} s")


LLM_SCRIPT = """
import json, sys
from vllm import LLM
try:
    LLM(model=sys.argv[1], skip_tokenizer_init=True, max_model_len=256, enforce_eager=True,
        gpu_memory_utilization=0.1, kv_cache_memory_bytes=32 << 20,
        additional_config={"ringflow": json.loads(sys.argv[2])})
except Exception as exc:
    print("RESULT " + json.dumps({"type": type(exc).__name__, "message": str(exc)}))
"""


@pytest.mark.parametrize("section,kind,start", [
    ({}, "ProfileError", "additional_config.ringflow: is empty; vLLM needs"),
    (BAD_WORKSPACE, "EngineError", "additional_config.ringflow: field 'offload.workspace_mib'"),
], ids=["front-end", "after-load"])
def test_llm_raises_one_typed_error_whose_message_is_the_line(models, section, kind, start):
    proc = subprocess.run([sys.executable, "-c", LLM_SCRIPT, models["llama8"], json.dumps(section)],
                          capture_output=True, text=True, timeout=300)
    [line] = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    got = json.loads(line[len("RESULT "):])
    assert got["type"] == kind and got["message"].startswith(start), got
    assert "\n" not in got["message"]
