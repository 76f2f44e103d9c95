"""``rlray.plan.paths.resolve_paths``: the driver's copy of a config with its local paths made absolute against one
folder, its dtype resolved, and URIs and missing files left as written."""

from __future__ import annotations

from rlray.config import config_from_dict
from rlray.plan import compute_dtype
from rlray.plan.paths import resolve_paths


def test_local_paths_become_absolute_against_the_base_and_uris_stay(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    (tmp_path / "rewards.py").write_text("def fn(**kw):\n    return 1.0\n")
    cfg = config_from_dict({}, [
        "data.train_files=[data/train.jsonl, s3://bucket/train.jsonl, data/missing.jsonl]", "run.output_dir=out",
        "tracking.mlflow_uri=sqlite:///store/m.db", "checkpoint.uri=snaps", "checkpoint.resume_from=latest",
        "reward.functions=[{function: 'rewards.py:fn'}]", "model.path=tiny-random", "model.dtype=auto"])  # fmt: skip
    out = resolve_paths(cfg, tmp_path)
    assert out.data.train_files == [str(tmp_path / "data/train.jsonl"), "s3://bucket/train.jsonl", "data/missing.jsonl"]
    assert (out.run.output_dir, out.checkpoint.uri) == (str(tmp_path / "out"), str(tmp_path / "snaps"))
    assert out.tracking.mlflow_uri == f"sqlite:///{tmp_path}/store/m.db" and (tmp_path / "store").is_dir()
    assert out.checkpoint.resume_from == "latest" and out.reward.functions[0].function == f"{tmp_path}/rewards.py:fn"
    assert out.model.path == "tiny-random" and out.model.dtype == compute_dtype(cfg) != "auto"
    assert cfg.run.output_dir == "out" and cfg.model.dtype == "auto"  # a copy: the given config is left as it is
