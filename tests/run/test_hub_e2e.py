"""End to end: a run whose model.path is a Hugging Face Hub id, offline, from a Hugging Face cache laid out as
huggingface_hub lays it (tests/models/test_hub.py's ``lay_out_hub_cache``: blobs, snapshots/<commit>, refs/main).

The driver pins the id to its snapshot folder once (``rlray.plan.hub.pin_hub_models``); the cache is
known to the driver's process only (the session's Ray workers were started without it), so the run finishes only
if every actor and learner worker read the snapshot folder it was handed instead of resolving the id again.

The run also samples with ``rollout.backend=exact`` (the learner's own forward; no vLLM start): with one mini-batch
per step every update is on-policy, and the rollout/learner gap the learner logs is exactly 0 at both steps, the
second one after a weight sync (float32 masters)."""

import pytest

from rlray.observe.tracking import get_run
from tests.models.test_hub import COMMIT, lay_out_hub_cache


@pytest.mark.ray
def test_two_steps_from_a_hub_id_offline_read_the_drivers_snapshot(ray_session, tiny_grpo_run, tiny_model_path,
                                                                    tmp_path, monkeypatch):
    import huggingface_hub

    home = tmp_path / "hf-home"
    snapshot = lay_out_hub_cache(home / "hub", tiny_model_path, repo_id="rlray-test/tiny-random")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))  # read once, at import

    def no_download(*args, **kwargs):  # only the cache may answer: local_files_only, as HF_HUB_OFFLINE=1 asks
        assert kwargs["local_files_only"] is True, kwargs
        return calls.append(args) or original(*args, **kwargs)

    calls, original = [], huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    uri, result, metrics = tiny_grpo_run([], "run.max_steps=2", "model.path=rlray-test/tiny-random",
                                         f"model.revision={COMMIT}", "eval.num_problems=0", "rollout.backend=exact")
    assert calls == [("rlray-test/tiny-random",)]  # resolved once, on the driver
    assert [v for _, v in metrics["rollout/policy_version"]] == [0.0, 1.0]  # the rollout actors served both steps
    # exact on-policy: 8 sequences per step in one mini-batch; every token's ratio pi_old / pi_rollout is exactly 1
    for key, exact in (("algo/rollout_kl", 0.0), ("rollout/logprob_abs_diff", 0.0), ("algo/rollout_ratio_max", 1.0),
                       ("algo/rollout_is_weight_mean", 1.0)):
        assert [v for _, v in metrics[key]] == [exact, exact], key
    run = get_run(uri, result.run_id)
    assert run.data.tags["rlray.model_dir"] == str(snapshot)  # the folder the actors and workers were handed
    assert run.data.params["model.path"] == str(snapshot) and run.data.params["model.revision"] == COMMIT
