"""Step hooks from the config (rlray.run.hooks.load_step_hooks): ``run.hooks`` specs are loaded like environments,
each factory is called with the Config, and a bad spec fails with one line naming ``run.hooks[i]``, the spec and the
fix. A file's hooks travel by value (a fresh process without the file calls one). The test hold
(tests/fixtures/holds.py, named in run.hooks by tests/observe/test_held_run.py and tests/launch/test_node_loss.py)
waits after its step until the release file exists, and stops the run with a reason when the file never comes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray.cloudpickle

from rlray.config import ConfigError, config_from_dict
from rlray.plan import resolve_plan
from rlray.run.hooks import StepEnd, is_observer, load_step_hooks, run_hooks, run_observers

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
import holds  # noqa: E402

HOOKS_FILE = '''
from dataclasses import dataclass


@dataclass
class Record:
    seen: list
    max_steps: int

    def __call__(self, event):
        self.seen.append(event.step)
        return "enough" if event.step >= self.max_steps else None


class Observe:
    after_snapshot = True

    def __call__(self, event):
        return "ignored"


def record(cfg):
    return Record([], cfg.run.max_steps)


def observe(cfg):
    return Observe()


def not_a_hook(cfg):
    return 3


def broken(cfg):
    raise RuntimeError("no GPU here")


NOT_CALLABLE = 5
'''


@pytest.fixture
def hooks_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_hooks.py"
    path.write_text(HOOKS_FILE)
    return path


def _cfg(*hooks: str, steps: int = 3):
    return config_from_dict({"run": {"hooks": list(hooks), "max_steps": steps}})


def _plan(*hooks: str, steps: int = 3):
    return resolve_plan(_cfg(*hooks, steps=steps))


def test_no_hooks_by_default():
    assert config_from_dict({}).run.hooks == [] and load_step_hooks(resolve_plan(config_from_dict({}))) == []


def test_file_and_module_specs_build_hooks_in_order_with_the_config(hooks_file, monkeypatch, tmp_path):
    monkeypatch.setenv(holds.HOLD_STEP_ENV, "2")
    monkeypatch.setenv(holds.HOLD_RELEASE_ENV, str(tmp_path / "go"))
    monkeypatch.chdir(hooks_file.parent)  # a relative file spec starts at the current folder
    record, observe, hold = load_step_hooks(_plan("my_hooks.py:record", f"{hooks_file}:observe", "holds:hold_after_step"))
    assert type(record).__name__ == "Record" and record.max_steps == 3  # the factory got the Config
    assert not is_observer(record) and is_observer(observe)
    assert isinstance(hold, holds.HoldForTest) and (hold.step, hold.release) == (2, str(tmp_path / "go"))
    # control hooks run before the snapshot and may stop the run; observers after it, and cannot
    assert run_hooks([record, observe], StepEnd(2, 3)) is None and record.seen == [2]
    assert run_hooks([record, observe], StepEnd(3, 3)) == "enough" and record.seen == [2, 3]
    run_observers([record, observe], StepEnd(3, 3, snapshot="/s/step_3"))
    assert record.seen == [2, 3]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope.mod:f", "run.hooks[0]='nope.mod:f': cannot import module 'nope.mod': No module named 'nope'; "
                       "a hook spec is 'package.module:factory' or 'path/to/file.py:factory'"),
        ("missing/file.py:f", "run.hooks[0]='missing/file.py:f': file 'missing/file.py' not found (relative paths "
                              "start at {cwd}); a hook spec is 'package.module:factory' or 'path/to/file.py:factory'"),
        ("FILE:missing", "run.hooks[0]='FILE:missing': 'missing' is not defined in 'FILE' (its classes: Observe, "
                         "Record); a hook spec is 'package.module:factory' or 'path/to/file.py:factory'"),
        ("FILE:NOT_CALLABLE", "run.hooks[0]='FILE:NOT_CALLABLE': int is not callable; name a function that takes "
                              "the Config and returns a step hook"),
        ("FILE:not_a_hook", "run.hooks[0]='FILE:not_a_hook': the factory returned 3 (int), not a step hook; return "
                            "a callable taking rlray.run.hooks.StepEnd"),
        ("FILE:broken", "run.hooks[0]='FILE:broken': the factory raised RuntimeError: no GPU here"),
    ],
)
def test_a_bad_spec_fails_with_one_line_naming_the_key_the_spec_and_the_fix(hooks_file, spec, message):
    spec = spec.replace("FILE", str(hooks_file))
    with pytest.raises(ConfigError) as info:
        load_step_hooks(_plan(spec))
    assert str(info.value) == message.replace("FILE", str(hooks_file)).replace("{cwd}", str(Path.cwd()))


def test_the_index_names_the_bad_entry(hooks_file):
    with pytest.raises(ConfigError, match=r"^run\.hooks\[1\]='nope\.mod:f': cannot import"):
        load_step_hooks(_plan(f"{hooks_file}:observe", "nope.mod:f"))


def test_a_spec_without_a_factory_name_fails_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"run\.hooks\[1\]='my_hooks\.py': write 'package\.module:factory' or "
                                          r"'path/to/file\.py:factory'"):
        _cfg("holds:hold_after_step", "my_hooks.py")


def test_a_hook_from_a_file_travels_by_value_to_a_process_without_the_file(hooks_file, tmp_path):
    [record] = load_step_hooks(_plan(f"{hooks_file}:record", steps=2))
    blob = tmp_path / "hook.pkl"
    blob.write_bytes(ray.cloudpickle.dumps(record))
    hooks_file.unlink()  # the learner's node may not have it
    code = ("import sys, ray.cloudpickle as cp; from rlray.run.hooks import StepEnd; "
            "hook = cp.loads(open(sys.argv[1], 'rb').read()); print(hook(StepEnd(1, 2)), hook(StepEnd(2, 2)), hook.seen)")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, check=True)  # fmt: skip
    assert out.stdout.strip() == "None enough [1, 2]"


def test_the_hold_factory_needs_its_step_and_release_file(monkeypatch, tmp_path):
    cfg = _cfg(holds.SPEC)
    for step, release in (("2", ""), ("two", "/x"), ("0", "/x"), ("4", "/x")):  # run.max_steps is 3
        monkeypatch.setenv(holds.HOLD_STEP_ENV, step)
        monkeypatch.setenv(holds.HOLD_RELEASE_ENV, release)
        with pytest.raises(ConfigError, match=rf"^run\.hooks\[0\]='.*holds\.py:hold_after_step': the factory raised "
                                              rf"ValueError: {holds.HOLD_STEP_ENV}='{step}' {holds.HOLD_RELEASE_ENV}="
                                              rf"'{release}': the test hold needs a step in 1\.\.3 and a release file"):
            load_step_hooks(resolve_plan(cfg))
    monkeypatch.setenv(holds.HOLD_STEP_ENV, "3")
    monkeypatch.setenv(holds.HOLD_RELEASE_ENV, str(tmp_path / "go"))
    [hook] = load_step_hooks(resolve_plan(cfg))
    assert (hook.step, hook.release, type(hook).__name__) == (3, str(tmp_path / "go"), "HoldForTest")


def test_hold_waits_at_its_step_until_the_release_file_exists(tmp_path):
    release = tmp_path / "go"
    hook = holds.HoldForTest(2, str(release))
    started = time.monotonic()
    assert hook(StepEnd(1, 3)) is None and time.monotonic() - started < 0.1  # another step: no wait
    timer = threading.Timer(0.5, release.touch)
    timer.start()
    assert run_hooks([hook], StepEnd(2, 3)) is None  # a control hook: runs before the step's snapshot
    assert time.monotonic() - started >= 0.5 and release.exists()
    timer.join()


def test_a_release_that_never_comes_stops_the_run_with_the_reason(tmp_path):
    hook = holds.HoldForTest(1, str(tmp_path / "never"), timeout_s=0.3)
    assert hook(StepEnd(1, 3)) == f"test hold: {tmp_path / 'never'} not created within 0.3 s"


def test_gates_wait_at_each_of_their_steps_once_the_arrival_is_marked(monkeypatch, tmp_path):
    cfg = _cfg(holds.GATES_SPEC, steps=5)
    for steps, folder in (("", str(tmp_path)), ("2,6", str(tmp_path)), ("2,x", str(tmp_path)), ("2", str(tmp_path / "no"))):
        monkeypatch.setenv(holds.GATE_STEPS_ENV, steps)
        monkeypatch.setenv(holds.GATE_FOLDER_ENV, folder)
        with pytest.raises(ConfigError, match=rf"ValueError: {holds.GATE_STEPS_ENV}='{steps}' .*: the test gates need "
                                              r"steps in 1\.\.5, comma-separated, and an existing folder"):
            load_step_hooks(resolve_plan(cfg))
    monkeypatch.setenv(holds.GATE_STEPS_ENV, "2,4")
    monkeypatch.setenv(holds.GATE_FOLDER_ENV, str(tmp_path))
    [gates] = load_step_hooks(resolve_plan(cfg))
    assert gates(StepEnd(1, 5)) is None and not list(tmp_path.iterdir())  # not a gate's step: no file, no wait
    timer = threading.Timer(0.5, holds.release_file(tmp_path, 2).touch)
    started = time.monotonic()
    timer.start()
    assert run_hooks([gates], StepEnd(2, 5)) is None
    assert time.monotonic() - started >= 0.5 and holds.arrived_file(tmp_path, 2).exists()
    started = time.monotonic()
    assert gates(StepEnd(2, 5)) is None and time.monotonic() - started < 0.1  # a replayed step: released already
    assert not holds.arrived_file(tmp_path, 4).exists()
    short = holds.Gates([4], str(tmp_path), timeout_s=0.3)
    assert short(StepEnd(4, 5)) == f"test hold: {holds.release_file(tmp_path, 4)} not created within 0.3 s"
    assert holds.arrived_file(tmp_path, 4).exists()
