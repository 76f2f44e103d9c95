"""Checks at start (rlray.launch.preflight, through the CLI): a missing model path, and an s3:// snapshot URI with a
missing bucket or bad credentials, fail with exit status 2 and a message naming the key before Ray starts
(not at the first snapshot, minutes into the run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlray import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def train(tmp_path, gsm8k_dir, ray_starts, capsys):
    """Returns train(*overrides) -> (exit status, stderr) of `rlray train` on the tiny config; the Ray start begun
    beside the checks must be cancelled, never used (``ray_starts``)."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(yaml.safe_load((REPO / "configs/grpo_gsm8k_tiny.yaml").read_text())))

    def run(*overrides: str) -> tuple[int, str]:
        status = cli.main(["train", str(config), f"run.output_dir={tmp_path}/out", f"data.train_files=[{gsm8k_dir}/train.jsonl]",
                           f"data.eval_files=[{gsm8k_dir}/test.jsonl]", f"tracking.mlflow_uri=sqlite:///{tmp_path}/m.db", *overrides])  # fmt: skip
        assert [(start.kwargs, start.cancelled) for start in ray_starts] == [({"log_to_driver": False}, True)]
        ray_starts.clear()
        return status, capsys.readouterr().err

    return run


def test_a_missing_model_path_fails_at_start(train, tmp_path):
    status, err = train(f"model.path={tmp_path}/nowhere")
    assert status == 2
    assert f"rlray: model.path='{tmp_path}/nowhere' is not an existing folder, a .gguf file, a Hugging Face Hub id (org/name) or an alias" in err


def test_a_missing_bucket_fails_at_start(train, moto_s3):
    s3 = [f"checkpoint.s3.endpoint_url={moto_s3['endpoint_url']}", f"checkpoint.s3.region={moto_s3['region']}",
          "checkpoint.s3.access_key_id=testing", "checkpoint.s3.secret_access_key=testing"]  # fmt: skip
    status, err = train("checkpoint.uri=s3://no-such-bucket/snapshots", *s3)
    assert status == 2
    assert ("rlray: checkpoint.uri='s3://no-such-bucket/snapshots': snapshots cannot be written there "
            "(FileNotFoundError") in err and "check the bucket name and the checkpoint.s3.* credentials" in err


def test_bad_credentials_fail_at_start_and_are_not_printed(train, moto_s3_checking_keys):
    s3 = moto_s3_checking_keys  # checks keys like AWS: this one does not exist
    keys = [f"checkpoint.s3.endpoint_url={s3['endpoint_url']}", f"checkpoint.s3.region={s3['region']}",
            "checkpoint.s3.access_key_id=AKIAWRONGKEY", "checkpoint.s3.secret_access_key=wrong-secret-value"]  # fmt: skip
    status, err = train("checkpoint.uri=s3://rlray-test/snapshots", *keys)
    assert status == 2
    assert "rlray: checkpoint.uri='s3://rlray-test/snapshots': snapshots cannot be written there (PermissionError" in err
    assert "check the bucket name and the checkpoint.s3.* credentials" in err
    assert "wrong-secret-value" not in err


def test_a_bad_step_hook_fails_at_start_naming_the_key(train):
    status, err = train("run.hooks=['holds_nowhere:factory']")
    assert status == 2
    assert err.strip().splitlines()[-1] == (
        "rlray: run.hooks[0]='holds_nowhere:factory': cannot import module 'holds_nowhere': No module named "
        "'holds_nowhere'; a hook spec is 'package.module:factory' or 'path/to/file.py:factory'")
