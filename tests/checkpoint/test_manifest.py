"""The snapshot manifest (rlray.checkpoint.manifest): today's layout byte for byte, old layouts load with their
documented defaults, unknown keys are ignored, and a missing or mistyped key is an error that names it."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rlray.checkpoint import lineage
from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.contents import restore_learner
from rlray.checkpoint.manifest import FORMAT, FORMAT1_DEFAULTS, SnapshotManifest
from rlray.checkpoint.storage import SnapshotError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from snapshot_manifests import manifest  # noqa: E402

# written by rlray at 140b219 (before this record) in a 3-step GRPO run on GSM8K; metrics cut to three keys
FORMAT2 = (FIXTURES / "manifests" / "format2_grpo_gsm8k.json").read_text()
# what the first snapshot writer (rlray/checkpoint.py up to 82905b2, save_final) wrote: json.dump(..., indent=2)
FORMAT1 = (FIXTURES / "manifests" / "format1_final.json").read_text()


def test_a_format2_manifest_loads_every_field():
    m = SnapshotManifest.from_json(FORMAT2)
    assert (m.kind, m.step, m.epoch, m.policy_version, m.rollbacks, m.world_size) == ("final", 3, 0, 3, 0, 1)
    assert m.data_cursor == {"epoch": 0, "in_flight": [], "num_rows": 7442, "position": 6, "rows_fingerprint": "d642be29a25e3f7b",
                             "seed": 0, "shuffle": True}
    assert (m.run_id, m.config_hash, m.dataset_hash) == ("39df772d06254524a9ef3d802d2b8356", "afa3bd9d4b094e1f", "d642be29a25e3f7b")
    assert m.git_commit == "6537255185c2bbfba2d66405a48457dd6191bee0" and m.parent_version is None
    assert m.metrics == {"algo/kl": 0.017180820259612394, "learner/loss": 0.05520670861005783, "reward/mean": 0.05}
    assert m.files == {"config.yaml": 5243, "model/chat_template.jinja": 368, "model/config.json": 818,
                       "model/generation_config.json": 216, "model/model.safetensors": 538090408, "model/tokenizer.json": 3522871,
                       "model/tokenizer_config.json": 297, "rng/rank_0.pt": 15581, "trainer_state.pt": 1076345315}
    assert m.written_at == 1796285852.7812405


def test_to_json_writes_the_format2_layout_byte_for_byte():
    assert FORMAT == 2
    assert SnapshotManifest.from_json(FORMAT2).to_json() == FORMAT2


def test_a_format1_manifest_loads_with_the_documented_defaults():
    m = SnapshotManifest.from_json(FORMAT1)
    assert (m.kind, m.step, m.policy_version, m.written_at) == ("final", 4, 4, 1795001234.5)
    assert (m.epoch, m.rollbacks, m.data_cursor, m.world_size) == (0, 0, None, 1)
    assert (m.run_id, m.config_hash, m.dataset_hash, m.git_commit, m.parent_version) == ("", "", "", "unknown", None)
    assert m.metrics == {} and m.files == {}
    assert set(FORMAT1_DEFAULTS) | {"kind", "step", "policy_version", "written_at"} == set(SnapshotManifest.__dataclass_fields__)


def test_a_format1_snapshot_is_a_model_folder_but_cannot_be_resumed(tmp_path):
    snap = tmp_path / "final"
    (snap / "model").mkdir(parents=True)
    (snap / "model" / "config.json").write_text("{}")
    (snap / checkpoint.MANIFEST).write_text(FORMAT1)
    assert checkpoint.local_model_dir(str(snap)) == str(snap / "model")
    with pytest.raises(SnapshotError, match="keeps no data cursor .* cannot be resumed from"):
        restore_learner(str(snap), learner=None, rank=0, options=None)  # refused before the learner is touched


def test_a_round_trip_keeps_every_field():
    m = manifest(7, kind="stop", epoch=2, rollbacks=1, world_size=2, parent_version="5", metrics={"reward/mean": 0.25},
                 files={"trainer_state.pt": 10}, written_at=12.5)
    assert SnapshotManifest.from_json(m.to_json()) == m
    assert json.loads(m.to_json())["format"] == FORMAT


def test_unknown_keys_are_ignored():
    newer = {**json.loads(FORMAT2), "format": 3, "shards": {"rank_0": 1}, "note": "written by a newer rlray"}
    assert SnapshotManifest.from_json(json.dumps(newer)) == SnapshotManifest.from_json(FORMAT2)


@pytest.mark.parametrize("key", ["rollbacks", "parent_version", "data_cursor", "files", "written_at"])
def test_a_format2_manifest_without_a_key_is_refused_naming_it(key):
    broken = {k: v for k, v in json.loads(FORMAT2).items() if k != key}
    with pytest.raises(ValueError, match=f"manifest \\(format 2\\) has no '{key}'"):
        SnapshotManifest.from_json(json.dumps(broken))


@pytest.mark.parametrize(("key", "value"), [("step", "3"), ("step", True), ("files", {"a.bin": 1.5}), ("data_cursor", [1]),
                                            ("metrics", {"reward/mean": "high"}), ("parent_version", 2)])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"manifest key '{key}' has "):
        SnapshotManifest.from_json(json.dumps({**json.loads(FORMAT2), key: value}))


def test_not_a_manifest_is_refused():
    for text in ("[1, 2]", '{"step": 3}', "{not json"):
        with pytest.raises(ValueError):
            SnapshotManifest.from_json(text)


def test_a_bad_manifest_makes_the_snapshot_incomplete(tmp_path):
    root = tmp_path / "root"
    good, bad = root / "run-a" / "step_00000002", root / "run-a" / "step_00000004"
    for snap, text in ((good, manifest(2).to_json()), (bad, json.dumps({"format": 2, "step": 4}))):
        snap.mkdir(parents=True)
        (snap / checkpoint.MANIFEST).write_text(text)
    with pytest.raises(SnapshotError, match="step_00000004/manifest.json': manifest \\(format 2\\) has no 'kind'"):
        checkpoint.read_manifest(str(bad))
    assert [(s.step, s.complete) for s in checkpoint.list_snapshots(str(root))] == [(2, True), (4, False)]
    assert checkpoint.latest_snapshot(str(root)) == str(good)


def test_write_manifest_stamps_files_and_time_and_writes_to_json(tmp_path):
    before = manifest(3, written_at=1.0)
    written = checkpoint.write_manifest(str(tmp_path), before, {"b.bin": 2, "a.bin": 1})
    assert written == replace(before, files={"a.bin": 1, "b.bin": 2}, written_at=written.written_at)
    assert written.written_at > 1e9 and list(written.files) == ["a.bin", "b.bin"]
    assert (tmp_path / checkpoint.MANIFEST).read_text() == written.to_json()


def test_version_tags_come_from_the_manifest():
    m = replace(SnapshotManifest.from_json(FORMAT2), parent_version="2")
    tags = lineage.version_tags(m, "file:///snaps/run-x/step_00000003", {"reward/mean": 0.05, "timing/step_s": 11.2})
    assert tags == {
        "rlray.parent_version": "2", "rlray.step": "3", "rlray.epoch": "0", "rlray.policy_version": "3",
        "rlray.config_hash": "afa3bd9d4b094e1f", "rlray.dataset_hash": "d642be29a25e3f7b",
        "rlray.git_commit": "6537255185c2bbfba2d66405a48457dd6191bee0", "rlray.run_id": "39df772d06254524a9ef3d802d2b8356",
        "rlray.snapshot_uri": "file:///snaps/run-x/step_00000003", "rlray.kind": "final", "metric.reward/mean": "0.05",
    }
    assert lineage.version_tags(SnapshotManifest.from_json(FORMAT1), "u", {})["rlray.parent_version"] == ""
