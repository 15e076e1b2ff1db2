"""The `ringflow` command: plan formats, run on the CPU, and one-line errors with exit 2."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringflow import from_json
from ringflow.cli import main

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's one executor")
def test_run_says_its_size_first_reports_slow_forwards_and_the_spread(capsys, caplog,
                                                                      monkeypatch):
    """A run that would take minutes (the built-in mla_ckv_dcp on a CPU) says what each
    forward moves before it starts and logs each slow forward as it ends; the table gives the
    spread next to the median and says what the reference is."""
    import logging

    from ringflow import cli

    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)  # every forward of demo counts as slow
    caplog.set_level(logging.INFO, logger="ringflow")
    assert main(["run", "demo", "--forwards", "3"]) == 0
    out, log = capsys.readouterr().out, caplog.text
    first = next(r.getMessage() for r in caplog.records if "each forward gathers" in
                 r.getMessage())
    assert re.search(r"each forward gathers [\d.]+ MiB \(\d+ layer\(s\) x 1 lane\(s\) of "
                     r"[\d.]+ MiB\); 1 executor\(s\) x 4 forwards", first), first
    # #38: the time ahead is the reference forward's, measured here, not one layer's guess
    assert "one layer of one lane" not in log
    assert re.search(r"the reference forward took [\d.]+ s here; 4 more forwards follow "
                     r"\(about [\d.]+ s at that pace\)", log), log
    assert "sync: the first forward took" in log
    assert [f"sync: forward {i} of 3 took" in log for i in (1, 2, 3)] == [True] * 3
    row = next(l for l in out.splitlines() if l.startswith("sync "))
    low, high = map(float, row.split()[3].split(".."))
    assert low <= float(row.split()[2]) <= high
    assert "reference: the same workload run straight" in out


@pytest.mark.parametrize("argv,needle", [
    (["plan", "nope.yaml"], "no such file"),
    (["plan", "demo", "--depth", "-1"], "expected an integer >= 0"),
    (["plan", "demo", "--layers", "2"], "field 'ineligible'"),
    (["plan", "demo", "--format", "svg"], "invalid choice"),
    (["plan", "demo", "--full"], "--full applies to --format dot only"),
    (["run"], "required: profile"),
    (["place", "--layers", "4", "--count", "1", "--compute-ms", "1", "--copy-ms", "nan"],
     "times must be finite"),
    (["place", "--layers", "100000", "--count", "50000", "--compute-ms", "1", "--copy-ms", "1"],
     "placement models up to 256 layers"),
    (["trace", str(ROOT / "profiles/results/bench-h200.json"), "--out", str(ROOT / "README.md")],
     "cannot make the trace folder"),
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
    assert proc.stdout == ""  # checked before the plan is printed


def _ringflow(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "ringflow", *argv], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("name,section", [("vllm_weights", "'offload'"),
                                          ("vllm_kv_prefetch", "'kv_prefetch'")])
@pytest.mark.parametrize("extra", [[], ["--layers", "4"]], ids=["as-is", "overridden"])
def test_run_of_a_vllm_only_profile_says_which_command_uses_it(name, section, extra, capsys):
    assert main(["run", name, *extra]) == 2
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert out == "" and line.startswith("ringflow: error: ")
    assert f"has only vLLM sections ({section})" in line
    assert (f"RINGFLOW_PROFILE={name} python -m vllm.entrypoints.openai.api_server --model "
            f"MODEL` (`vllm serve MODEL` on vLLM's CUDA build" in line)
    assert f"ringflow plan {name}" in line
    assert "such as demo, mla_ckv_dcp" in line


def test_a_slot_pool_for_a_vllm_only_profile_is_a_profile_error():
    from ringflow import ProfileError, SlotPool, load_profile

    profile = load_profile("vllm_weights")
    with pytest.raises(ProfileError, match="field 'layers': is missing: this profile has only"):
        SlotPool.for_profile(profile, "kv")


def test_version_prints_the_package_version():
    import ringflow

    proc = _ringflow("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"ringflow {ringflow.__version__}"


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_describes_every_command_and_lists_the_built_in_profiles(capsys):
    from ringflow.orchestrator.profile import builtin_profiles

    names = ", ".join(builtin_profiles())
    text = _help(capsys)
    assert "``" not in text and names in text
    for command in ("plan", "run", "bench", "tune"):
        assert re.search(rf"\b{command} (print|run|measure)", text), command
    for command in ("plan", "run", "tune"):
        assert names in _help(capsys, command), command


def _options(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif not isinstance(action, argparse._HelpAction):
            yield parser.prog, action


@pytest.mark.parametrize("module", ["ringflow.cli", "ringflow.bench.dcp"])
def test_every_option_has_help_text(module):
    import importlib

    parser = importlib.import_module(module)._parser()
    missing = [f"{prog} {'/'.join(a.option_strings) or a.dest}" for prog, a in _options(parser)
               if not a.help]
    assert not missing


def test_dot_of_a_large_plan_is_condensed_unless_full_is_asked(tmp_path, capsys):
    assert main(["plan", "mla_ckv_dcp", "--format", "dot", "--out", str(tmp_path / "c.dot")]) == 0
    assert "(854 nodes, condensed: --full draws every node)" in capsys.readouterr().out
    assert main(["plan", "mla_ckv_dcp", "--format", "dot", "--full",
                 "--out", str(tmp_path / "f.dot")]) == 0
    condensed, full = (len(re.findall(r"\[label=", (tmp_path / f).read_text()))
                       for f in ("c.dot", "f.dot"))
    assert condensed < 150 and full == 854


def test_bench_plot_without_matplotlib_is_one_line_before_any_measurement(monkeypatch, tmp_path,
                                                                          capsys):
    from ringflow.bench import scenarios as bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails

    def measured(*a, **k):
        raise AssertionError("a measurement started")

    monkeypatch.setattr(bench, "run_scenario", measured)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    assert main(["bench", "small-layers", "--plot", str(tmp_path)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "matplotlib" in line and "`pip install matplotlib`" in line


@pytest.mark.parametrize("value,poison", [("1", True), ("yes", True), ("TRUE", True),
                                          ("on", True), ("0", False), ("no", False),
                                          ("false", False), ("", False), (None, False)])
def test_ringflow_poison_accepts_switches(monkeypatch, value, poison):
    from ringflow.graphs.executor import poison_default

    if value is None:
        monkeypatch.delenv("RINGFLOW_POISON", raising=False)
    else:
        monkeypatch.setenv("RINGFLOW_POISON", value)
    assert poison_default() is poison


def test_ringflow_poison_refuses_anything_else_in_one_line():
    import os

    from ringflow import ConfigError
    from ringflow.graphs.executor import poison_default

    proc = _ringflow("run", "demo", "--forwards", "1", env={**os.environ, "RINGFLOW_POISON": "2"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ringflow: error: RINGFLOW_POISON='2'")
    assert "accepted: 1, true, yes, on" in last and "0, false, no, off" in last
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGFLOW_POISON", "maybe")
        with pytest.raises(ConfigError, match="RINGFLOW_POISON='maybe'"):
            poison_default()


@pytest.mark.parametrize("argv,needle", [
    (["--world", "0"], "argument --world: expected an integer >= 1, got 0"),
    (["--depths", "0"], "argument --depths: expected an integer >= 1, got 0"),
    (["--contexts", "-5"], "argument --contexts: expected an integer >= 1, got -5"),
])
def test_dcp_bench_rejects_bad_arguments_in_one_line(argv, needle, capsys):
    from ringflow.bench import dcp as dcp_bench

    with pytest.raises(SystemExit) as exit_:
        dcp_bench.main(argv)
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert exit_.value.code == 2 and out == "" and needle in line


def test_dcp_bench_without_a_gpu_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "ringflow.bench.dcp", "--world", "1"],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert "no CUDA device was found" in line


def test_place_prints_the_planners_choice_next_to_the_patterns_a_user_would_pick(capsys):
    assert main(["place", "--layers", "32", "--count", "8", "--slots", "1", "--compute-ms", "1",
                 "--copy-ms", "3"]) == 0
    out = capsys.readouterr().out
    assert "layers [3, 7, 11, 15, 19, 23, 27, 31]" in out
    assert "predicted forward 32.000 ms; all resident 32.000 ms (1.000x)" in out
    assert "{every: 8, last: 2}: 44.000 ms (1.375x)" in out


def test_place_charges_the_slowdown_it_is_given_without_changing_the_choice(capsys):
    args = ["place", "--layers", "32", "--count", "8", "--slots", "1", "--compute-ms", "1",
            "--copy-ms", "3"]
    assert main(args + ["--slowdown", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "layers [3, 7, 11, 15, 19, 23, 27, 31]" in out  # chosen as without it
    # every 3 ms copy hides behind the three layers before it: 8 x 3 x 0.1 ms more
    assert "predicted forward 34.400 ms; all resident 32.000 ms (1.075x), charging 0.1 ms" in out
    assert main(args + ["--slowdown", "2"]) == 2
    assert "slowdown" in capsys.readouterr().err
    # 2 ms copies, each waiting 0.5 ms for its reader's end and its layer 0.5 ms for the copy's:
    # 3 ms, hidden behind the three 1 ms layers between two offloaded ones; 0.6 ms shows 0.2
    args[-1] = "2"
    assert main(args + ["--handoff-ms", "0.5"]) == 0
    assert "predicted forward 32.000 ms; all resident 32.000 ms (1.000x), 0.5 ms per" in \
        capsys.readouterr().out
    assert main(args + ["--handoff-ms", "0.6"]) == 0  # 8 x 0.2 ms
    assert "predicted forward 33.600 ms" in capsys.readouterr().out
    assert main(args + ["--handoff-ms", "-1"]) == 2
    assert "handoff_ms" in capsys.readouterr().err


def test_place_refuses_times_that_do_not_match_the_layers(capsys):
    assert main(["place", "--layers", "4", "--count", "2", "--compute-ms", "1,2",
                 "--copy-ms", "3"]) == 2
    assert "--compute-ms has 2 values for 4 layers" in capsys.readouterr().err


def test_help_answers_without_importing_torch():
    code = ("import sys\nfrom ringflow.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("False"), proc.stdout[-500:]


def test_a_timeline_becomes_a_chrome_trace_perfetto_opens():
    from ringflow.bench.timeline import chrome_trace

    spans = [{"lane": "kv", "kind": "gather", "layer": 1, "start_ms": 0.5, "end_ms": 1.25},
             {"lane": "kv", "kind": "compute", "layer": 0, "start_ms": 0.0, "end_ms": 2.0}]
    doc = chrome_trace(spans, "demo")
    named = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert named == {1: "gather lane", 2: "compute lane"}
    [gather, compute] = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert (gather["name"], gather["tid"], gather["ts"], gather["dur"]) == ("gather L1", 1, 500.0,
                                                                            750.0)
    assert (compute["name"], compute["tid"], compute["ts"], compute["dur"]) == ("compute L0", 2,
                                                                                0.0, 2000.0)
    json.dumps(doc)  # plain JSON


def test_ringflow_trace_writes_one_trace_per_timed_scenario_of_a_results_file(tmp_path, capsys):
    """The H200 bench results in the repository carry timelines: each becomes a trace."""
    from importlib import resources

    results = resources.files("ringflow.profiles").joinpath("results/bench-h200.json")
    assert main(["trace", str(results), "--out", str(tmp_path)]) == 0
    rows = json.loads(results.read_text())["results"]
    timed = [r for r in rows if r.get("timeline")]
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(f"{r['scenario'].replace('/', '-')}.trace.json" for r in timed)
    for row in timed:
        doc = json.loads((tmp_path / f"{row['scenario'].replace('/', '-')}.trace.json").read_text())
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        assert len(spans) == len(row["timeline"])
        assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(
            1e3 * max(s["end_ms"] for s in row["timeline"]), abs=1e-3)
    assert capsys.readouterr().out.count("ui.perfetto.dev") == len(timed)


@pytest.mark.parametrize("content,needle", [
    ("{}", "is not a `ringflow bench --json` file"),
    ('{"results": [{"scenario": "s"}]}', "no row of"),
    ("not json", "cannot read bench results"),
])
def test_ringflow_trace_refuses_a_file_without_timelines_in_one_line(tmp_path, capsys, content,
                                                                     needle):
    path = tmp_path / "r.json"
    path.write_text(content)
    assert main(["trace", str(path), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_output_cut_short_by_a_pipe_ends_without_a_traceback():
    """``ringflow place ... | head``: a reader that closed the pipe (``true`` here, gone before
    ringflow has imported) makes the first write fail; ringflow stops without a word."""
    command = (f"{sys.executable} -m ringflow place --layers 128 --count 32 --compute-ms 1 "
               f"--copy-ms 3 | true")
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True,
                          text=True, timeout=120)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 1  # the pipeline's status is ringflow's: stopped early
