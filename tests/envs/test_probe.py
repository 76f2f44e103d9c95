"""Opening an environment's first episode before a run (rlray.envs.probe), loading files that import their neighbours,
and the one failure rule of the host: an environment that raises fails its episode wherever it raises (issue 29)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlray.envs import load_environment
from rlray.envs.host import EnvironmentHost, LimitReply, ResetRequest, StepRequest
from rlray.envs.probe import probe_environment, probe_in_sandbox, required_columns, reset_kwargs, row_environment

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "envs"
BROKEN = f"{FIXTURES}/broken_envs.py"


def test_rows_route_by_their_column_else_the_default():
    assert row_environment({"environment": "calc"}, "environment", "guess") == "calc"
    assert row_environment({"environment": ""}, "environment", "guess") == "guess"  # empty or null: the default
    assert row_environment({"environment": None}, "environment", None) == ""  # a single-turn row
    assert row_environment({}, "env", None) == ""
    assert reset_kwargs({"a": 1}, "q?", "question") == {"a": 1, "prompt": "q?", "question": "q?"}


def test_required_columns_are_keyword_parameters_without_a_default():
    from rlray.envs.builtin.calculator import CalculatorEnv

    class Native:
        def reset(self, *, word: str, level: int = 1, **row): ...

    class Trl:
        def reset(self, **kwargs): ...

    assert required_columns(Native) == ["word"] and required_columns(Trl) == []
    assert required_columns(CalculatorEnv) == ["question", "answer"]


def test_a_probe_opens_the_first_row_that_works_and_reports_what_fails_and_where():
    report = probe_environment(f"{BROKEN}:NeedsColumn", [{"prompt": "p"}, {"prompt": "q", "a": 2}])
    assert report.trl and report.required_columns == [] and report.tool_schema_error == ""
    assert report.replies[0].error == "env_error"
    assert report.replies[0].message.startswith("reset(**row) raised KeyError: 'a' (at ")
    line = Path(BROKEN).read_text().splitlines().index('        self.count = kwargs["a"]') + 1
    assert report.replies[0].message.endswith(f"broken_envs.py:{line})")  # the line of the user's code that raised
    assert report.opened is report.replies[1]
    assert report.opened.prompt == [{"role": "user", "content": "q Start at 2."}]
    assert [t["function"]["name"] for t in report.opened.tools] == ["bump"]

    schema = probe_environment(f"{BROKEN}:NoDocTool", [{"prompt": "p"}, {"prompt": "q"}])
    assert len(schema.replies) == 1 and schema.opened is None  # not the row's fault: one row is enough
    assert schema.tool_schema_error.startswith("tool 'NoDocTool.shout' has no usable JSON schema")

    init = probe_environment(f"{BROKEN}:BadInit", [{"prompt": "p"}])
    assert init.replies[0].message.startswith("BadInit() raised RuntimeError: no database connection (at ")

    closing = probe_environment(f"{BROKEN}:CloseRaises", [{"prompt": "p", "word": "cat"}])
    assert closing.required_columns == ["word"] and closing.opened is None
    assert closing.replies[0].message.startswith("close() raised OSError: cannot release the sandbox (at ")


def test_a_probe_in_a_child_process_names_what_cannot_load(tmp_path):
    ok = probe_in_sandbox(f"{BROKEN}:Counter", [{"prompt": "p"}], trl_parity=True, untrusted=True, memory_gib=2.0,
                          timeout_s=120.0)
    assert ok.opened is not None and ok.opened.prompt == [{"role": "user", "content": "p"}]
    with pytest.raises(ValueError, match=r"'Missing' is not defined in '.*broken_envs.py' \(its classes: BadInit, "
                                         r"CloseRaises, Counter, HangsInReset, NeedsColumn, NoDocTool, NoReset, "
                                         r"RequiredColumn, ReturnsADict, RewardRaises\)"):
        probe_in_sandbox(f"{BROKEN}:Missing", [], trl_parity=True, untrusted=False, memory_gib=2.0, timeout_s=120.0)
    bad = tmp_path / "bad_import.py"
    bad.write_text("import json\n\nimport no_such_helper_module\n\n\nclass Env:\n    def reset(self, **kw): ...\n")
    with pytest.raises(ValueError, match=r"importing .*bad_import.py raised ModuleNotFoundError: No module named "
                                         r"'no_such_helper_module' \(at .*bad_import.py:3\)"):
        probe_in_sandbox(f"{bad}:Env", [], trl_parity=True, untrusted=False, memory_gib=2.0, timeout_s=120.0)
    syntax = tmp_path / "syntax.py"
    syntax.write_text("class Env:\n    def reset(self, **kw)\n        pass\n")
    with pytest.raises(ValueError, match=r"importing .*syntax.py raised SyntaxError: .* \(at .*syntax.py:2\)"):
        probe_in_sandbox(f"{syntax}:Env", [], trl_parity=True, untrusted=False, memory_gib=2.0, timeout_s=120.0)


def test_the_probe_child_imports_the_tool_schema_builder_while_loading_not_under_the_reset_limit():
    """CI (stop 49): the probe's reset paid transformers' first import (get_json_schema, 1.4 s on 2 quiet cores, over
    4 s loaded) under the rows' env.step_timeout_s, and a tool without a docstring read as a reset that hangs. The
    child's load phase (``_serve_probe``, under start_timeout_s) imports it now (rlray.envs.tools.load_schema_builder).
    Checked in a fresh process by what is imported, not by a time limit that a loaded machine could miss."""
    code = ("import sys; from rlray.envs.probe import _serve_probe; "
            f"_serve_probe({BROKEN + ':NoDocTool'!r}, True); print('transformers.utils.chat_template_utils' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.strip() == "True", out.stderr
    report = probe_in_sandbox(f"{BROKEN}:NoDocTool", [{"prompt": "p"}], trl_parity=True, untrusted=False,
                              memory_gib=2.0, timeout_s=60.0)
    assert report.tool_schema_error is not None and "tool 'NoDocTool.shout' has no usable JSON schema" in \
        report.tool_schema_error


def test_a_file_imports_the_modules_beside_it_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the file's folder
    folder = str(FIXTURES / "beside")
    assert folder not in sys.path
    env = load_environment(f"{FIXTURES}/beside/neighbour_env.py:Neighbour")()
    env.reset(prompt="p")
    assert env.final_reward() == 3.0  # START from neighbour_helper.py
    assert folder not in sys.path  # only while the file loads


def test_an_environment_that_raises_fails_its_episode_wherever_it_raises():
    host = EnvironmentHost({"reward": f"{BROKEN}:RewardRaises", "close": f"{BROKEN}:CloseRaises"})
    host.reset([ResetRequest("limit", "reward", {"prompt": "p"}), ResetRequest("end", "reward", {"prompt": "p"}),
                ResetRequest("c", "close", {"prompt": "p", "word": "cat"})])
    bump = '<tool_call>{"name": "bump", "arguments": {"by": 1}}</tool_call>'
    first = host.step([StepRequest("limit", bump, "stop", 0), StepRequest("end", "done", "stop", 0),
                       StepRequest("c", "cat", "stop", 0)])
    assert first[0].error is None and first[0].step.observations[0]["content"] == "1"
    # at a normal end get_reward raises inside step: the episode fails (env_error)
    assert first[1].error == "env_error"
    assert first[1].message.startswith("step raised ZeroDivisionError: the reward divides by the number of answers, 0")
    assert (first[2].error, first[2].step.reward, first[2].step.done) == (None, 1.0, True)
    # at a limit the same exception fails the episode too (it used to give reward 0.0)
    [limit] = host.rewards_at_limit(["limit"])
    assert limit.error == "env_error" and limit.reward is None
    assert limit.message.startswith("reward_at_limit() (a TRL class: get_reward()) raised ZeroDivisionError: ")
    assert host.rewards_at_limit(["gone"]) == [LimitReply()]  # an episode not open here: no reward, no error
    closed = host.close(["limit", "c"])
    assert closed[0] == "" and closed[1].startswith("close() raised OSError: cannot release the sandbox (at ")
    assert host.open_episodes() == 0
