"""Snapshot storage: manifest last, incomplete snapshots ignored and cleaned up, retention, S3 (moto),
a full disk mid-write, and SIGKILL mid-write."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.storage import SnapshotError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
import faultyfs  # noqa: E402
from snapshot_manifests import manifest  # noqa: E402

faultyfs.register()


def _payload(tmp: Path, sizes: dict[str, int]) -> Path:
    out = tmp / "payload"
    for rel, n in sizes.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(bytes(range(256)) * (n // 256) + b"x" * (n % 256))
    return out


def _snap(root: str, run: str, step: int, payload: Path, options=None, written_at: float | None = None) -> str:
    uri = checkpoint.join(root, run, checkpoint.snapshot_name(step))
    written = checkpoint.write_snapshot(uri, payload, manifest(step), options)
    if written_at is not None:  # age it: the manifest as if written then (write_manifest stamps the present)
        Path(uri, checkpoint.MANIFEST).write_text(replace(written, written_at=written_at).to_json())
    return uri


class RecordingFS(faultyfs.FaultyFileSystem):
    """Records the order of writes (put_file, pipe_file, mv)."""

    protocol = ("recording",)
    order: list[str] = []

    def put_file(self, lpath, rpath, callback=None, **kwargs):
        RecordingFS.order.append(rpath.rsplit("/", 1)[-1])
        return super().put_file(lpath, rpath, callback=callback, **kwargs)

    def mv(self, path1, path2, **kwargs):
        RecordingFS.order.append("mv:" + path2.rsplit("/", 1)[-1])
        return super().mv(path1, path2, **kwargs)


def test_manifest_is_written_last_and_lists_sizes(tmp_path):
    import fsspec

    fsspec.register_implementation("recording", RecordingFS, clobber=True)
    payload = _payload(tmp_path, {"model/model.safetensors": 3000, "trainer_state.pt": 700, "rng/rank_0.pt": 10})
    RecordingFS.order = []
    uri = f"recording://{tmp_path}/root/run-a/step_00000002"
    written = checkpoint.write_snapshot(uri, payload, manifest(2))
    assert RecordingFS.order == ["model.safetensors", "rank_0.pt", "trainer_state.pt", "mv:manifest.json"]
    assert written.files == {"model/model.safetensors": 3000, "rng/rank_0.pt": 10, "trainer_state.pt": 700}
    assert checkpoint.read_manifest(uri) == written and written.step == 2
    # a payload file that later loses bytes makes the snapshot unusable, with a message naming it
    (tmp_path / "root/run-a/step_00000002/trainer_state.pt").write_bytes(b"short")
    with pytest.raises(SnapshotError, match="'trainer_state.pt' has 5 bytes, manifest says 700"):
        checkpoint.read_manifest(uri)


def test_incomplete_snapshot_is_ignored_and_pruned(tmp_path):
    root = str(tmp_path / "root")
    payload = _payload(tmp_path, {"a.bin": 100})
    first = _snap(root, "run-a", 2, payload)
    # a later snapshot whose writer died before the manifest
    broken = Path(root, "run-a", "step_00000004")
    broken.mkdir(parents=True)
    (broken / "a.bin").write_bytes(b"half")
    snaps = checkpoint.list_snapshots(root)
    assert [(s.step, s.complete) for s in snaps] == [(2, True), (4, False)]
    assert checkpoint.latest_snapshot(root) == first
    assert checkpoint.resolve_snapshot("latest", root) == first
    with pytest.raises(SnapshotError, match="manifest.json is missing"):
        checkpoint.resolve_snapshot(str(broken), root)
    removed = checkpoint.prune(root, "run-a", max_age_s=1e9, log_max_age_s=1e9)
    assert removed == [str(broken)]
    assert not broken.exists() and Path(first, "manifest.json").exists()


def test_a_snapshot_deleted_by_another_pruner_meanwhile_is_skipped(tmp_path, monkeypatch):
    """Ray Train removes checkpoints beyond num_to_keep concurrently: one that vanishes between the listing and
    the delete (here: deleted inside rm, then rm raises as fsspec's local rm does) is not an error."""
    import shutil

    import fsspec.implementations.local as local

    root = str(tmp_path / "root")
    payload = _payload(tmp_path, {"a.bin": 100})
    first = _snap(root, "run-a", 2, payload)
    gone, kept = Path(root, "run-a", "step_00000004"), Path(root, "run-a", "step_00000006")
    for broken in (gone, kept):
        broken.mkdir(parents=True)
        (broken / "a.bin").write_bytes(b"half")
    real_rm = local.LocalFileSystem.rm

    def racing_rm(self, path, recursive=False, maxdepth=None):
        if str(path).endswith("step_00000004"):
            shutil.rmtree(path)  # the other pruner wins
            raise FileNotFoundError(path)
        return real_rm(self, path, recursive=recursive, maxdepth=maxdepth)

    monkeypatch.setattr(local.LocalFileSystem, "rm", racing_rm)
    removed = checkpoint.prune(root, "run-a", max_age_s=1e9, log_max_age_s=1e9)
    assert removed == [str(kept)]  # what this call deleted; the other is gone too
    assert not gone.exists() and not kept.exists() and Path(first, "manifest.json").exists()


def test_retention_by_count_and_age_keeps_the_newest(tmp_path):
    root = str(tmp_path / "root")
    payload = _payload(tmp_path, {"a.bin": 10})
    now = time.time()
    day = 86400.0
    old_run = [_snap(root, "run-old", s, payload, written_at=now - (40 - s) * day) for s in (1, 2)]  # 39 and 38 days old
    cur = [_snap(root, "run-cur", s, payload, written_at=now - (5 - s) * 60) for s in (1, 2, 3, 4)]
    logs = Path(root, "logs")
    logs.mkdir()
    for name, age_days in (("run-old.log", 8), ("run-x.log", 6), ("run-cur.log", 30)):
        (logs / name).write_text("x")
        os.utime(logs / name, (now - age_days * day, now - age_days * day))
    removed = checkpoint.prune(root, "run-cur", max_age_s=30 * day, log_max_age_s=7 * day, keep_last=2, now=now)
    # both old-run snapshots are past 30 days; the current run keeps its newest 2; only run-old.log is past
    # 7 days (the current run's own log is never removed)
    assert sorted(removed) == sorted([*old_run, cur[0], cur[1], str(logs / "run-old.log")])
    assert [s.uri for s in checkpoint.list_snapshots(root)] == cur[2:]
    # the newest complete snapshot survives any age limit
    assert checkpoint.prune(root, "run-other", max_age_s=1.0, log_max_age_s=1e9, now=now + 100 * day) == [cur[2]]
    assert checkpoint.latest_snapshot(root) == cur[3]


def test_s3_snapshots_through_s3fs_and_lifecycle_rules(tmp_path, moto_s3):
    opts = {"endpoint_url": moto_s3["endpoint_url"], "key": moto_s3["key"], "secret": moto_s3["secret"],
            "client_kwargs": {"region_name": moto_s3["region"]}}
    root = f"s3://{moto_s3['bucket']}/ckpt-unit"
    payload = _payload(tmp_path, {"model/model.safetensors": 5000, "trainer_state.pt": 300})
    first = _snap(root, "run-a", 2, payload, opts)
    second = _snap(root, "run-a", 4, payload, opts)
    fs, _ = checkpoint.open_fs(root, opts)
    fs.pipe_file(f"{moto_s3['bucket']}/ckpt-unit/run-a/step_00000006/trainer_state.pt", b"partial")
    assert [(s.step, s.complete) for s in checkpoint.list_snapshots(root, opts)] == [(2, True), (4, True), (6, False)]
    assert checkpoint.latest_snapshot(root, opts) == second
    local = checkpoint.fetch_local(first, tmp_path / "got", opts)
    assert (local / "model/model.safetensors").read_bytes() == (payload / "model/model.safetensors").read_bytes()
    removed = checkpoint.prune(root, "run-a", max_age_s=1e9, log_max_age_s=1e9, keep_last=1, options=opts)
    assert sorted(removed) == sorted([first, f"{root}/run-a/step_00000006"])
    assert [s.uri for s in checkpoint.list_snapshots(root, opts)] == [second]
    from rlray.cli import main

    sets = [f"checkpoint.uri={root}", f"checkpoint.s3.endpoint_url={moto_s3['endpoint_url']}", "checkpoint.s3.access_key_id=testing",
            "checkpoint.s3.secret_access_key=testing", "checkpoint.s3.region=us-east-1"]
    assert main(["snapshots", "lifecycle", "--apply", *[x for kv in sets for x in ("--set", kv)]]) == 0
    got = fs.call_s3("get_bucket_lifecycle_configuration", Bucket=moto_s3["bucket"])["Rules"]
    assert {(r["Filter"]["Prefix"], r["Expiration"]["Days"]) for r in got} == {("ckpt-unit/logs/", 7), ("ckpt-unit/", 30)}
    # Ray Train gets the same filesystem, as pyarrow, and a path without the scheme
    path, pa_fs = checkpoint.ray_storage(root, opts)
    assert path == f"{moto_s3['bucket']}/ckpt-unit" and pa_fs.get_file_info(f"{path}/run-a/step_00000004/manifest.json").size > 0
    # and a Ray checkpoint on it maps back to rlray's URI (how a restarted or PBT-exploiting trial finds it)
    from ray.train import Checkpoint

    from rlray.run.session import _uri_of

    assert _uri_of(Checkpoint(path=f"{path}/run-a/step_00000004", filesystem=pa_fs)) == second
    assert _uri_of(Checkpoint(path=str(tmp_path))) == str(tmp_path)


def test_full_disk_mid_write_keeps_the_previous_snapshot(tmp_path):
    root = f"faulty://{tmp_path}/root"
    payload = _payload(tmp_path, {"model/model.safetensors": 4096, "trainer_state.pt": 512})
    first = _snap(root, "run-a", 2, payload)
    faultyfs.FaultyFileSystem.fail_under = "step_00000004"
    try:
        with pytest.raises(SnapshotError, match=r"step_00000004/model/model.safetensors'.*No space left on device"):
            _snap(root, "run-a", 4, payload)
    finally:
        faultyfs.FaultyFileSystem.fail_under = None
    # the failed one holds half a file and no manifest; the previous one is whole and still the latest
    assert Path(tmp_path, "root/run-a/step_00000004/model/model.safetensors").stat().st_size == 2048
    assert checkpoint.latest_snapshot(root) == first
    assert checkpoint.read_manifest(first).files == {"model/model.safetensors": 4096, "trainer_state.pt": 512}


SIGKILL_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import faultyfs
    from snapshot_manifests import manifest
    faultyfs.register()
    faultyfs.SlowFileSystem.delay_s = 2.0
    from rlray.checkpoint import storage as checkpoint
    checkpoint.write_snapshot(sys.argv[2], Path(sys.argv[3]), manifest(4))
    """
)


def test_sigkill_mid_write_leaves_the_previous_snapshot_usable(tmp_path, tiny_model_path, tiny_tokenizer):
    from rlray.checkpoint.contents import restore_learner, write_payload
    from rlray.config import Config
    from rlray.learner import OptimizerSpec, PolicyLearner

    def learner():
        return PolicyLearner(tiny_model_path, dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1.0),
                             temperature=1.0, use_reference=False)

    trained = learner()
    with torch.no_grad():
        for p in trained.module.parameters():
            p.add_(0.01)
    payload = tmp_path / "payload"
    write_payload(payload, learner=trained, tokenizer=tiny_tokenizer, config_yaml=Config().to_yaml())
    root = str(tmp_path / "root")
    first = _snap(root, "run-a", 2, payload)
    target = tmp_path / "root/run-a/step_00000004"
    proc = subprocess.Popen([sys.executable, "-c", SIGKILL_WRITER, str(FIXTURES), f"slow://{target}", str(payload)],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    deadline = time.time() + 120
    while not (target.exists() and any(p.is_file() for p in target.rglob("*"))):
        assert proc.poll() is None and time.time() < deadline, "the writer ended before writing anything"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (target / "manifest.json").exists()
    assert checkpoint.latest_snapshot(root) == first
    # the previous snapshot restores the trained weights into a fresh learner
    fresh = learner()
    restored = restore_learner(first, learner=fresh, rank=0, options=None)
    assert restored.step == 2
    for (name, a), b in zip(trained.module.state_dict().items(), fresh.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert checkpoint.prune(root, "run-a", max_age_s=1e9, log_max_age_s=1e9) == [str(target)]
    assert json.loads(Path(first, "manifest.json").read_text())["step"] == 2
