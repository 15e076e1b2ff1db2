"""The `ringflow` command: plan formats, run on the CPU, and one-line errors with exit 2."""

import json
import subprocess
import sys

import pytest
import torch

from ringflow import from_json
from ringflow.cli import main


def test_plan_prints_the_text_table_with_the_budget(capsys):
    assert main(["plan", "demo"]) == 0
    out = capsys.readouterr().out
    assert "lane 'kv': slot 524,288 B; depth 1 wants 2 slot(s)" in out
    assert "sync_gather" in out and "record.ready" in out


def test_plan_overrides_layers_and_depth_and_writes_json(tmp_path, capsys):
    path = tmp_path / "dag.json"
    assert main(["plan", "demo", "--layers", "13", "--depth", "2", "--format", "json",
                 "--out", str(path)]) == 0
    dag = from_json(path.read_text())
    assert dag.layers == 13 and dag.pools[0].depth == 2
    assert "wrote json plan" in capsys.readouterr().out


def test_plan_writes_dot(capsys):
    assert main(["plan", "mla_ckv_dcp", "--format", "dot"]) == 0
    out = capsys.readouterr().out
    assert out.startswith('digraph "mla-ckv-dcp"') and "cluster_gather_ubatch1" in out


def test_plan_reports_the_kv_tokens_the_pools_cost(capsys):
    assert main(["plan", "mla_ckv_dcp"]) == 0
    out = capsys.readouterr().out
    assert "KV cost:" in out and "x 61 layers)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback message")
def test_run_on_a_cpu_machine_says_it_used_the_synchronous_path(capsys, caplog):
    assert main(["run", "demo", "--forwards", "2"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device found; running the synchronous path" in caplog.text
    rows = [l for l in out.splitlines() if l.startswith("sync ")]
    assert len(rows) == 1 and rows[0].split()[-1] == "True"


@pytest.mark.parametrize("argv,needle", [
    (["plan", "nope.yaml"], "no such file"),
    (["plan", "demo", "--depth", "-1"], "expected an integer >= 0"),
    (["plan", "demo", "--layers", "2"], "field 'ineligible'"),
    (["plan", "demo", "--format", "svg"], "invalid choice"),
    (["run"], "required: profile"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "ringflow", *argv], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_a_broken_profile_file_is_one_line(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("layers: 3\ndepth: 1\nworkspace_mib: 1\nslot: {shape: [4], dtype: int4}\n")
    proc = subprocess.run([sys.executable, "-m", "ringflow", "plan", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"ringflow: error: {path}: field 'slot.dtype': got 'int4' (str); "
                                   "accepted: float32 | float16 | bfloat16 | float64 | uint8")


def test_the_console_script_is_installed():
    import shutil

    exe = shutil.which("ringflow") or str(__import__("pathlib").Path(sys.executable).parent
                                           / "ringflow")
    proc = subprocess.run([exe, "plan", "demo", "--format", "json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and json.loads(proc.stdout)["schema"] == "ringflow.dag"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_graph_dot_without_a_gpu_is_one_clear_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ringflow", "plan", "demo", "--cuda-graph-dot",
                           str(tmp_path / "g.dot")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device was found" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
