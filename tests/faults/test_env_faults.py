"""A sweep of bad inputs for environments (issue 29), like the config sweep (tests/config/test_loading.py): each of a
new user's ordinary mistakes ends in one clear ``rlray:`` line before Ray starts (exit status 2, no traceback), or,
where it can only show while the run goes (one row's reset, a get_reward that raises at a limit, a close that
raises), in a counted, worded failure of its episode. Never exit status 0 with nothing learned and nothing said.

The preflight cases run ``rlray train`` through ``rlray.cli.main`` on the tiny model with Ray's start replaced by a
failure; the run-time cases run the episode's calls on an ``EnvironmentHost`` in this process. Whole runs that
cannot learn (every episode failing) are in tests/run/test_cannot_learn_e2e.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rlray import cli
from rlray.envs.host import EnvironmentHost, ResetRequest, StepRequest

REPO = Path(__file__).resolve().parents[2]
BROKEN = f"{REPO}/tests/fixtures/envs/broken_envs.py"
ROWS = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "What is 4 x 4?", "answer": "16"}]


@pytest.fixture
def train(tmp_path, ray_starts, capsys):
    """Returns train(*overrides) -> (exit status, stderr) of `rlray train` on a tiny config whose rows have columns
    prompt and answer; the Ray start begun beside the checks must be cancelled, never used (``ray_starts``)."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": "tiny-random", "dtype": "float32", "chat_template": "smollm2-tools"},
        "data": {"train_files": [f"{tmp_path}/rows.jsonl"], "eval_files": [f"{tmp_path}/rows.jsonl"]},
        "reward": {"functions": []}, "run": {"output_dir": f"{tmp_path}/out"},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/m.db"}, "env": {"step_timeout_s": 2.0}}))

    def run(*overrides: str) -> tuple[int, str]:
        status = cli.main(["train", str(config), *overrides])
        assert all(start.cancelled for start in ray_starts)  # none when the config itself is refused
        ray_starts.clear()
        return status, capsys.readouterr().err

    return run


def env(cls: str, *, default: bool = True) -> list[str]:
    return [f"env.environments={{e: '{cls}'}}"] + (["env.default=e"] if default else [])


CASES = {
    "a missing file": (env("no/such/dir/env.py:Env"), r"rlray: env.environments.e='.*no/such/dir/env.py:Env': file "
                                                       r".*no/such/dir/env.py does not exist"),
    "a missing module": (env("no_such_package.envs:Env"), r"rlray: env.environments.e='no_such_package.envs:Env': "
                                                          r"module 'no_such_package.envs' cannot be found"),
    "a wrong class name": (env(f"{BROKEN}:Countr"), r"rlray: env.environments.e='.*broken_envs.py:Countr': 'Countr' is "
                                                    r"not defined in '.*broken_envs.py' \(its classes: .*Counter"),
    "a class without reset": (env(f"{BROKEN}:NoReset"), r"rlray: env.environments.e='.*:NoReset': class NoReset has no "
                                                        r"reset method; an environment needs reset\(\*\*row\)"),
    "a tool without a docstring": (env(f"{BROKEN}:NoDocTool"), r"rlray: env.environments.e='.*:NoDocTool': tool "
                                                               r"'NoDocTool.shout' has no usable JSON schema"),
    "rows without the column reset reads": (env(f"{BROKEN}:NeedsColumn"), r"rlray: env.environments.e='.*:NeedsColumn': "
                                            r"no episode could be opened on the first 2 rows routed to it \(rows:0, "
                                            r"rows:1\): reset\(\*\*row\) raised KeyError: 'a'"),
    "rows without a required keyword column": (env(f"{BROKEN}:RequiredColumn"), r"rlray: env.environments.e='.*"
                                               r":RequiredColumn': reset needs the column 'word'"),
    "a constructor that raises": (env(f"{BROKEN}:BadInit"), r"BadInit\(\) raised RuntimeError: no database connection"),
    "a reset that hangs": (env(f"{BROKEN}:HangsInReset"), r"rlray: env.environments.e='.*:HangsInReset': opening an "
                                                          r"episode on 2 rows took longer than 4 s \(env.step_timeout_s "
                                                          r"for each\); its constructor or reset may hang"),
    "a reset that returns a dict": (env(f"{BROKEN}:ReturnsADict"), r"reset\(\*\*row\) raised TypeError: ReturnsADict."
                                                                   r"reset returned dict, expected rlray.envs.EnvReset"),
    "an environment no row reaches": (env(f"{BROKEN}:Counter", default=False), r"rlray: env.environments: no row "
                                      r"reaches 'e'.*set env.default=e"),
    "env.default naming no environment": ([*env(f"{BROKEN}:Counter", default=False), "env.default=calc"],
                                          r"invalid config:\n.*env.default='calc' is not in env.environments \['e'\]"),
    "a reward function needing a missing column": (
        [*env(f"{BROKEN}:Counter"), "reward.functions=[{function: exact_match, kwargs: {column: solution}}]"],
        r"rlray: reward.functions\[0\] \(function='exact_match', name='exact_match'\) reads column 'solution', which "
        r"the dataset lacks"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_environment_input_is_one_line_before_the_run_starts(train, case):
    overrides, message = CASES[case]
    status, err = train(*overrides)
    assert status == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("rlray: ") and "WARNING" not in line]
    assert len(lines) == 1, err  # one message (a config error lists its keys on the lines below it)
    assert re.search(message, err), err


def test_a_row_naming_an_unknown_environment_is_one_line(train, tmp_path):
    (tmp_path / "named.jsonl").write_text(json.dumps({**ROWS[0], "environment": "chess"}) + "\n")
    status, err = train(*env(f"{BROKEN}:Counter"), f"data.train_files=[{tmp_path}/named.jsonl]")
    assert status == 2 and "Traceback" not in err
    assert "rlray: data.train_files: row 'named:0' names environment 'chess' in its 'environment' column, which is " \
           "not in env.environments ['e']; add it there or fix the row" in err


def test_faults_that_show_only_while_the_run_goes_are_counted_failures_with_their_reason():
    """One row's reset, a get_reward that raises at a limit or at the end, a close that raises, a tool that raises:
    each is a failed episode (or, for the tool, an error observation) with a message saying where."""
    host = EnvironmentHost({"col": f"{BROKEN}:NeedsColumn", "rew": f"{BROKEN}:RewardRaises",
                            "close": f"{BROKEN}:CloseRaises"})
    resets = host.reset([ResetRequest("r0", "col", {"prompt": "p"}), ResetRequest("r1", "col", {"prompt": "p", "a": 1}),
                         ResetRequest("g", "rew", {"prompt": "p"}), ResetRequest("c", "close", {"prompt": "p", "word": "w"})])
    assert resets[0].error == "env_error" and resets[0].message.startswith("reset(**row) raised KeyError: 'a'")
    assert resets[1].error is None  # the other rows' episodes go on
    bad_call = '<tool_call>{"name": "bump", "arguments": {"by": "x"}}</tool_call>'
    steps = host.step([StepRequest("r1", bad_call, "stop", 0), StepRequest("g", "no call", "stop", 0),
                       StepRequest("c", "w", "stop", 0)])
    assert steps[0].error is None and steps[0].tool_errors == 1  # TRL's wording: an error observation, counted
    assert steps[0].step.observations[0]["content"].startswith("{'error': ")
    assert steps[1].message.startswith("step raised ZeroDivisionError")  # get_reward at the end fails the episode
    [limit] = host.rewards_at_limit(["r1"])
    assert limit.error is None and limit.reward == 1.0
    assert host.close(["r1", "c"])[1].startswith("close() raised OSError")
