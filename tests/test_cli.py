"""The command line's quick answers: ``rlray --version``, ``rlray config`` (the resolved config, and with
--describe each field's description and default as YAML comments) and ``rlray ledger`` (which prompts a run trained
on and how often, and with --check the exact check against its seeded stream) on a hand-made MLflow store."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import rlray
from rlray import cli
from rlray.config import config_from_dict, load_config
from rlray.config.describe import described_yaml
from rlray.observe.tracking import Tracker

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "grpo_gsm8k_tiny.yaml")


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlray {rlray.__version__}"


def test_config_prints_the_resolved_config_with_overrides(capsys):
    assert cli.main(["config", CONFIG, "guard.kl_threshold=0.05", "tracking.samples_per_step=2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = load_config(CONFIG, ["guard.kl_threshold=0.05", "tracking.samples_per_step=2"]).model_dump(mode="json")
    assert printed == expected
    assert printed["guard"]["kl_threshold"] == 0.05 and printed["tracking"]["samples_per_step"] == 2
    assert printed["tracking"]["tensorboard_dir"] is None  # defaults are filled in: the whole config


def test_config_describe_comments_every_field_and_still_loads(capsys):
    assert cli.main(["config", CONFIG, "tracking.samples_per_step=0", "--describe"]) == 0
    text = capsys.readouterr().out
    cfg = load_config(CONFIG, ["tracking.samples_per_step=0"])
    assert yaml.safe_load(text) == cfg.model_dump(mode="json")  # the comments change nothing
    assert text == described_yaml(cfg)
    lines = text.splitlines()

    def comment_above(field_line: str) -> str:
        i, out = lines.index(field_line), []
        while lines[i - 1].lstrip().startswith("#"):
            i -= 1
            out.insert(0, lines[i].strip().lstrip("#").strip())
        return " ".join(out)

    got = comment_above("  samples_per_step: 0")
    assert got.startswith("Rollouts kept per online step") and got.endswith("Default: 4.")
    assert comment_above("  tensorboard_dir: null").endswith("None: off. Default: null.")
    assert comment_above("tracking:") == "MLflow tracking, the samples kept per step, and TensorBoard."
    assert all(len(line) <= 120 for line in lines if line.lstrip().startswith("#"))


def test_config_names_a_bad_key(capsys):
    assert cli.main(["config", CONFIG, "tracking.sample_per_step=3"]) == 2
    assert "tracking.sample_per_step" in capsys.readouterr().err


@pytest.mark.parametrize("describe", [[], ["--describe"]])
def test_config_never_prints_a_secret(tmp_path, capsys, describe):
    secret = "https://hooks.example/T0k3nS3cr3t"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"monitor": {"alerts": ["log", "webhook"], "webhook_url": secret},
                                    "checkpoint": {"s3": {"access_key_id": "AKIAid", "secret_access_key": "AKIAverysecret"}}}))
    assert cli.main(["config", str(path), *describe]) == 0
    out = capsys.readouterr().out
    assert "T0k3nS3cr3t" not in out and "AKIAverysecret" not in out
    assert yaml.safe_load(out)["monitor"]["webhook_url"] == "**********"


# The stream of 6 rows q0..q5 under run.seed 7, shuffled: np.random.default_rng([7, epoch]).permutation(6)
# (tests/run/test_ledger.py checks the formula against PromptStream): epoch 0 q5 q2 q0 q4 q1 q3, epoch 1 q3 q0 q2 q1 q4 q5.


@pytest.fixture
def logged_run(tmp_path):
    """Returns logged_run(ledger, final_step, with_config=True) -> (tracking uri, run id) of a hand-made MLflow run:
    its resolved config (tiny-random's tokenizer, 6 rows, seed 7, 2 prompts per step), ledger and final step."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    (tmp_path / "train.jsonl").write_text("".join(f'{{"id": "q{i}", "prompt": "question {i}"}}\n' for i in range(6)))
    cfg = config_from_dict({}, ["model.path=tiny-random", f"data.train_files=[{tmp_path}/train.jsonl]", "run.seed=7",
                                "data.shuffle=true", "learner.prompts_per_step=2", "learner.sequences_per_minibatch=8"])  # fmt: skip

    def make(steps: dict[int, list[str]], final_step: int, with_config: bool = True) -> tuple[str, str]:
        tracker = Tracker(uri, "ledger")
        if with_config:
            tracker.log_config(cfg)
        for step, ids in steps.items():
            tracker.log_ledger(ids, step=step)
        tracker.set_tags({"rlray.final_step": str(final_step)})
        tracker.close()
        return uri, tracker.run_id

    return make


def test_ledger_prints_which_prompts_a_run_took_and_checks_it_exact(logged_run, capsys):
    # 4 steps of 2 prompts, step 2 with a DAPO refill: 9 ids, one and a half epochs
    uri, rid = logged_run({1: ["q5", "q2"], 2: ["q0", "q4", "q1"], 3: ["q3", "q3"], 4: ["q0", "q2"]}, final_step=4)
    assert cli.main(["ledger", rid, "--tracking-uri", uri, "--check", "--prompts"]) == 0
    out, err = capsys.readouterr()
    assert "Downloading artifacts" not in err  # MLflow's progress bars are off in rlray's commands
    assert out.splitlines() == [
        f"run {rid} ({uri}): the prompt ledger of steps 1-4",
        "steps with a ledger: 4 of 4",
        "prompts taken: 9 (6 distinct)",
        "times taken: 1x: 3 prompts, 2x: 3 prompts",
        "epochs covered: 1.50 (9 taken / 6 rows of the data)",
        "  q5  1x  steps 1",
        "  q2  2x  steps 1, 4",
        "  q0  2x  steps 2, 4",
        "  q4  1x  steps 2",
        "  q1  1x  steps 2",
        "  q3  2x  steps 3, 3",
        "ledger exact: 4 steps took 9 prompts; the stream hands out 9 over that span, each once, in order",
    ]


def test_ledger_check_fails_with_exit_1_naming_a_lost_step(logged_run, capsys):
    # step 2 (q0 q4) has no ledger file; step 4's file is past the final step 3 (an abandoned timeline)
    uri, rid = logged_run({1: ["q5", "q2"], 3: ["q1", "q3"], 4: ["q5", "q5"]}, final_step=3)
    assert cli.main(["ledger", f"runs:/{rid}", "--tracking-uri", uri]) == 0  # no check: an audit only
    assert capsys.readouterr().out.splitlines()[1:] == [
        "steps with a ledger: 2 of 3; without: 2",
        "ledger files after step 3, not counted: 4",
        "prompts taken: 4 (4 distinct)",
        "times taken: 1x: 4 prompts",
        "epochs covered: 1.00 (4 taken / 4 distinct prompts)",
    ]
    assert cli.main(["ledger", rid, "--tracking-uri", uri, "--check"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[5:] == [
        "epochs covered: 0.67 (4 taken / 6 rows of the data)",
        "ledger wrong: 3 steps took 4 prompts; the stream hands out 6 over that span; steps without a ledger: 2; "
        "2 missing: q0, q4; first departure at ledger position 2",
    ]


def test_ledger_names_a_missing_run_a_run_without_a_ledger_and_a_run_without_its_config(logged_run, capsys):
    def last_error() -> str:
        return capsys.readouterr().err.splitlines()[-1]  # after MLflow's own log lines

    uri, rid = logged_run({}, final_step=0)
    assert cli.main(["ledger", "nope", "--tracking-uri", uri]) == 2
    assert last_error() == f"rlray ledger: cannot read run 'nope' from {uri}: Run with id=nope not found"
    assert cli.main(["ledger", rid, "--tracking-uri", uri]) == 2
    assert last_error() == f"rlray ledger: run {rid} has no prompt ledger (ledger/step_<n>.json; offline runs keep none)"
    uri, rid = logged_run({1: ["q5", "q2"]}, final_step=1, with_config=False)
    assert cli.main(["ledger", rid, "--tracking-uri", uri]) == 0  # the audit needs no config
    assert cli.main(["ledger", rid, "--tracking-uri", uri, "--check"]) == 2
    assert last_error().startswith(f"rlray: run {rid}: its config/resolved.yaml cannot be read from {uri} (")
