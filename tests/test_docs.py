"""Every command in the documentation runs (issue 32): each fenced shell or Python block of README.md and docs/ is
executed here, or names the test that executes it, or says it needs what a test machine lacks. And the generated
config reference (docs/reference/config.md) is what the schema gives now, the metrics reference (metrics.md) what the
metric registry gives.

A block is marked by an HTML comment on the line before its fence (nothing but blank lines between):

- ``<!-- docs: run [dotted.key=value ...] -->``: run here (``test_a_run_block_runs``) in a temporary copy of
  configs/ and docs/ (data/ linked): each shell line, joined at trailing backslashes, must exit 0. In a ``console``
  block the ``$ `` lines are the commands and the lines after each are its output, which it must print (its exit
  status is not checked: a console block may show an error). An ``rlray`` command runs in this process,
  ``rlray train``/``eval`` with test sizes (``TEST_SIZES``: tiny-random, one step, 2 prompts x 2 samples, the
  transformers backend) and the marker's own overrides added after the config, so the docs' command, config and
  files are what is checked, not its sizes; any other line runs in bash. A Python block runs as a script there.
- ``<!-- docs: tested-by tests/path.py::test_name -->`` or ``<!-- docs: tested-by make TARGET -->``: that test
  (which must exist) or Makefile target runs it.
- ``<!-- docs: needs-cluster [why] -->``, ``<!-- docs: needs-gpu [why] -->``: needs a Ray cluster of several nodes
  or a CUDA GPU.
- ``<!-- docs: shows PATH -->``: the block is a verbatim excerpt of the file PATH (which a test runs).

Pages under docs/ also give every fence a language (``text`` for a diagram or output).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlray import cli
from rlray.config import Config
from rlray.config.describe import reference_markdown
from rlray.observe.metrics import METRICS
from rlray.observe.metrics_reference import metrics_markdown

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").rglob("*.md"))
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}
KINDS = ("run", "tested-by", "needs-cluster", "needs-gpu", "shows")
RAY_COMMANDS = {"train", "eval", "sweep", "serve-reward"}
TEST_SIZES = ["model.path=tiny-random", "model.dtype=float32", "rollout.backend=hf", "run.max_steps=1",
              "learner.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
              "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2", "learner.torch_threads=1",
              "eval.num_problems=0", "monitor.port=0", "guard.kl_threshold=null"]


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file: its language, text (dedented), first line number and marker."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: str  # the marker's text after "docs:" ("run", "needs-gpu why", ...); "" when unmarked

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def checked(self) -> bool:
        """True for the languages whose blocks must run or be marked (shell and Python)."""
        return self.lang in SHELL | PYTHON


_FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*docs:\s*(.*?)\s*-->\s*$")


def fenced_blocks(path: Path) -> list[Block]:
    """Returns every fenced code block of the Markdown file ``path``, with the marker comment before it, if any."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        pad, end = len(opening[1]), i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        before = next((x for x in reversed(lines[:i]) if x.strip()), "")
        mark = _MARK.match(before)
        text = "\n".join(x[pad:] if not x[:pad].strip() else x.lstrip() for x in lines[i + 1 : end])  # a list's indent
        blocks.append(Block(path, i + 1, opening[2].lower(), text, mark[1] if mark else ""))
        i = end + 1
    return blocks


def marker_problem(block: Block) -> str | None:
    """Returns what is wrong with a block's marker ("unmarked", an unknown kind, a missing test or file), else None."""
    if not block.mark:
        return "unmarked: add <!-- docs: run --> (or tested-by, needs-cluster, needs-gpu, shows) before its fence"
    kind, _, arg = block.mark.partition(" ")
    if kind not in KINDS:
        return f"unknown marker {kind!r}; use one of {', '.join(KINDS)}"
    if kind == "tested-by":
        return _missing_test(arg.strip())
    if kind == "shows":
        shown = REPO / arg.strip()
        if not shown.is_file():
            return f"shows {arg.strip()!r}: no such file"
        return None if block.text.strip() in shown.read_text() else f"the block is not a verbatim excerpt of {arg.strip()}"
    return None


def _missing_test(ref: str) -> str | None:
    """Returns why ``ref`` ('tests/x.py::test_y' or 'make TARGET') names no test or target, else None."""
    if ref.startswith("make "):
        target = ref.split()[1]
        makefile = (REPO / "Makefile").read_text()
        return None if re.search(rf"^{re.escape(target)}:", makefile, re.M) else f"no Makefile target {target!r}"
    file, _, name = ref.partition("::")
    path = REPO / file
    if not (file.startswith("tests/") and path.is_file() and name):
        return f"tested-by {ref!r}: give tests/path.py::test_name of an existing file"
    tree = ast.parse(path.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return None if name.split("[")[0] in names else f"tested-by {ref!r}: {file} has no test {name!r}"


def checked_blocks() -> list[Block]:
    """Returns the shell and Python blocks of README.md and every page under docs/."""
    return [b for path in [REPO / "README.md", *PAGES] for b in fenced_blocks(path) if b.checked]


# --------------------------------------------------------------------------------------------
# The markers
# --------------------------------------------------------------------------------------------
def test_every_shell_and_python_block_runs_or_is_marked():
    problems = [f"{b.where}: {p}" for b in checked_blocks() if (p := marker_problem(b))]
    assert problems == [], "\n".join(problems)


def test_every_fence_on_a_page_names_its_language():
    bare = [b.where for path in PAGES for b in fenced_blocks(path) if not b.lang]
    assert bare == [], f"give these fences a language (text for output or a diagram): {bare}"


def test_the_marker_checks_catch_what_they_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nrlray x\n```\n\n<!-- docs: needs-gpu one H100 -->\n\n```sh\nrlray y\n```\n"
                    "<!-- docs: tested-by tests/test_docs.py::no_such_test -->\n```bash\nz\n```\n"
                    "<!-- docs: tested-by make nothere -->\n```bash\nz\n```\n"
                    "<!-- docs: shows docs/examples/my_reward.py -->\n```python\ndef mentions_capital(\n```\n"
                    "<!-- docs: shows docs/examples/my_reward.py -->\n```python\ndef other(\n```\n"
                    "<!-- docs: runs -->\n```text\nout\n```\n")
    blocks = fenced_blocks(page)
    assert [(b.line, b.lang, b.mark) for b in blocks] == [
        (1, "bash", ""), (7, "sh", "needs-gpu one H100"), (11, "bash", "tested-by tests/test_docs.py::no_such_test"),
        (15, "bash", "tested-by make nothere"), (19, "python", "shows docs/examples/my_reward.py"),
        (23, "python", "shows docs/examples/my_reward.py"), (27, "text", "runs")]
    problems = [marker_problem(b) for b in blocks]
    assert problems[0].startswith("unmarked") and problems[1] is None and problems[4] is None
    assert "has no test 'no_such_test'" in problems[2] and "no Makefile target 'nothere'" in problems[3]
    assert "not a verbatim excerpt" in problems[5] and "unknown marker 'runs'" in problems[6]
    assert not blocks[6].checked
    assert _missing_test("tests/test_docs.py::test_the_marker_checks_catch_what_they_should") is None


def test_a_block_inside_a_list_keeps_its_own_indent(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("- a step:\n\n  <!-- docs: run -->\n  ```python\n  if True:\n      x = 1\n  ```\n")
    (block,) = fenced_blocks(page)
    assert (block.line, block.mark, block.text) == (4, "run", "if True:\n    x = 1")


# --------------------------------------------------------------------------------------------
# Running the marked blocks
# --------------------------------------------------------------------------------------------
def commands(block: Block) -> list[tuple[str, list[str] | None]]:
    """Returns (command, the output lines shown after it) per shell command of a block: lines joined at trailing
    backslashes, blank and comment lines dropped. In a console block the commands are the ``$ `` lines and the other
    lines their output (which the command must print; its exit status is not checked); elsewhere the output is
    None (the command must exit 0)."""
    lines = [x.strip() for x in re.sub(r"\s*\\\n\s*", " ", block.text).splitlines()]
    if block.lang != "console":
        return [(x, None) for x in lines if x and not x.startswith("#")]
    out: list[tuple[str, list[str] | None]] = []
    for x in lines:
        if x.startswith("$ "):
            out.append((x[2:], []))
        elif x and out:
            out[-1][1].append(x)
    return out


def _check_output(block: Block, command: str, code: int, printed: str, shown: list[str] | None) -> None:
    """Fails unless ``command`` exited 0 (``shown`` None) or printed every line ``shown`` (a console block)."""
    if shown is None:
        assert code == 0, f"{block.where}: {command} exited {code}\n{printed[-3000:]}"
        return
    got = {x.strip() for x in printed.splitlines()}
    missing = [x for x in shown if x not in got]
    assert missing == [], f"{block.where}: {command} did not print {missing}; it printed:\n{printed[-3000:]}"


def with_test_sizes(argv: list[str], extra: list[str], folder: Path) -> list[str]:
    """Returns ``rlray`` argv (without 'rlray') with ``TEST_SIZES``, the run's folders under ``folder`` and ``extra``
    after the docs' own overrides (later overrides win), ahead of the first --option, for train and eval."""
    if argv[0] not in ("train", "eval"):
        return argv
    cut = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    sizes = [*TEST_SIZES, f"run.output_dir={folder}/outputs", f"tracking.mlflow_uri=sqlite:///{folder}/mlruns/mlflow.db"]
    return argv[:cut] + sizes + extra + argv[cut:]


def _run_blocks() -> list:
    out = []
    for b in checked_blocks():
        if b.mark.split(" ")[0] == "run":
            heavy = b.lang in SHELL and any(shlex.split(c, comments=True)[:2][-1] in RAY_COMMANDS
                                            for c, _ in commands(b) if c.startswith("rlray "))
            out.append(pytest.param(b, id=b.where, marks=[pytest.mark.ray] if heavy else []))
    return out


@pytest.fixture
def docs_copy(tmp_path, monkeypatch, gsm8k_dir):
    """Returns a temporary folder holding copies of configs/ and docs/ (pictures left out) and a link to data/; it is
    the working folder of the test."""
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(REPO / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    (tmp_path / "data").symlink_to(gsm8k_dir.parent)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("block", _run_blocks())
def test_a_run_block_runs(block, docs_copy, request, capsys):
    extra = block.mark.split()[1:]
    if block.lang in PYTHON:
        (docs_copy / "block.py").write_text(block.text)
        done = subprocess.run([sys.executable, "block.py"], cwd=docs_copy, capture_output=True, text=True, timeout=600,
                              env={"PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
        assert done.returncode == 0, f"{block.where}: {done.stderr[-3000:]}"
        return
    for command, shown in commands(block):
        argv = shlex.split(command, comments=True)
        if argv[0] == "rlray":
            if argv[1] in RAY_COMMANDS:
                request.getfixturevalue("ray_session")
            code = cli.main(with_test_sizes(argv[1:], extra, docs_copy))
            out = capsys.readouterr()
            _check_output(block, command, code, out.out + out.err, shown)
            if argv[1] == "train" and code == 0:  # the JSON summary `rlray train` prints last
                assert json.loads(out.out[out.out.rindex("{\n"):])["status"] == "FINISHED", command
        else:
            done = subprocess.run(command, shell=True, cwd=docs_copy, capture_output=True, text=True, timeout=600,
                                  env={"PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
            _check_output(block, command, done.returncode, done.stdout + done.stderr, shown)


def test_test_sizes_go_after_the_docs_overrides_and_before_options(tmp_path):
    argv = with_test_sizes(["train", "c.yaml", "run.max_steps=40", "--resume", "latest"], ["x.y=1"], tmp_path)
    assert argv[:3] == ["train", "c.yaml", "run.max_steps=40"] and argv[-3:] == ["x.y=1", "--resume", "latest"]
    assert "run.max_steps=1" in argv and argv.index("run.max_steps=1") > argv.index("run.max_steps=40")
    assert with_test_sizes(["config", "c.yaml", "--describe"], [], tmp_path) == ["config", "c.yaml", "--describe"]
    console = Block(REPO / "x.md", 1, "console", "$ rlray config c.yaml \\\n  --describe\nrun:\n  seed: 0\n$ ls", "run")
    assert commands(console) == [("rlray config c.yaml --describe", ["run:", "seed: 0"]), ("ls", [])]
    bash = Block(REPO / "x.md", 1, "bash", "# a comment\nrlray config c.yaml  # why\n", "run")
    assert commands(bash) == [("rlray config c.yaml  # why", None)]


# --------------------------------------------------------------------------------------------
# The generated config reference
# --------------------------------------------------------------------------------------------
def test_the_config_reference_page_is_what_the_schema_gives_now():
    committed = (REPO / "docs" / "reference" / "config.md").read_text()
    assert committed == reference_markdown(Config), "docs/reference/config.md is out of date: run `make docs`"


def test_the_metrics_reference_page_is_what_the_registry_gives_now(capsys):
    committed = (REPO / "docs" / "reference" / "metrics.md").read_text()
    assert committed == metrics_markdown(), "docs/reference/metrics.md is out of date: run `make docs`"
    assert cli.main(["config", "--metrics-reference"]) == 0
    page = capsys.readouterr().out
    assert page == committed
    keys = re.findall(r"^\| `([^`]+)` \|", page, re.M)
    assert {m.key for m in METRICS} <= set(keys) and len(keys) == len(set(keys))
    assert "| `algo/advantage_abs_mean` | advantage | token mean of \\|advantage\\| over the response tokens |  |" in page
    assert "| `reward/mean` | reward | mean reward" in page and "gauge `rlray_reward_mean`, progress line |" in page
    assert "| `eval/pass@{k}` | fraction |" in page


def test_the_reference_has_every_key_once_with_its_default(capsys):
    assert cli.main(["config", "--reference"]) == 0
    page = capsys.readouterr().out
    assert page == reference_markdown(Config)
    keys = re.findall(r"^\| `([\w.\[\]]+)` \|", page, re.M)
    flat = [k for k in Config().flat() if not k.startswith(("reward.functions", "monitor.bands"))]
    assert set(flat) <= set(keys) and len(keys) == len(set(keys))
    assert "| `rollout.max_new_tokens` | int | `160` | tokens |" in page
    assert "| `learner.prompts_per_step` | int |" in page and "| prompts per step |" in page
    assert "| `reward.functions[].function` | str | required |" in page
    assert "| `checkpoint.s3.secret_access_key` | secret str or null | `null` |" in page
    assert "'key\\*=factor' multiplies" in page and "`[\"learner.lr*=0.5\"]`" in page  # text escaped, code kept


def test_config_without_a_file_says_what_to_give(capsys):
    assert cli.main(["config"]) == 2
    assert "give a CONFIG file (or --reference" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The MLflow UI as the docs start it
# --------------------------------------------------------------------------------------------
def mlflow_ui_commands() -> list[str]:
    """Returns every ``mlflow ui`` command line of the shell blocks of README.md and docs/, lines joined."""
    return [c for b in checked_blocks() if b.lang in SHELL for c, _ in commands(b) if c.startswith("mlflow ui ")]


@pytest.mark.slow  # MLflow creates its tables and starts its server: 30-90 s on 2 busy cores
def test_the_mlflow_ui_command_serves_the_store(tmp_path):
    shown = mlflow_ui_commands()
    assert len(shown) >= 2 and len(set(shown)) == 1, shown  # README and docs/watching.md show the one command
    argv = shlex.split(shown[0])
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv[argv.index("--port") + 1] = str(port)
    (tmp_path / "mlruns").mkdir()  # a run's store folder, as `rlray train` leaves it in the working folder
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    try:
        url, deadline, body = f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=10", time.time() + 180, None
        while body is None and time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    body = json.loads(reply.read())
            except OSError:
                time.sleep(1)
        assert body is not None, f"mlflow ui did not answer on port {port}: {proc.poll()=}"
        assert [e["name"] for e in body["experiments"]] == ["Default"]  # the new store in this folder, and only it
        assert (tmp_path / "mlruns" / "mlflow.db").is_file()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
