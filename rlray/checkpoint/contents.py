"""What a snapshot holds and how a learner rank writes and restores it.

A snapshot (layout in ``rlray.checkpoint``) holds the policy weights, optimizer and scheduler state,
every rank's RNG states (torch, numpy, python), the data cursor, the step, the epoch, the policy
version, the number of rollbacks so far and the config the state was trained with. Restoring it
and pushing the weights to the rollout engines puts a run exactly where it was: with the same
config and seed, a resumed step samples and updates as the uninterrupted run did.

A sharded learner (FSDP2) writes the same model/ folder (float32 weights gathered to rank 0 one tensor at a time: a
Hugging Face folder that vLLM, ``rlray eval`` and a new run's model.path read as before), the schedulers in
trainer_state.pt, and its optimizer state (and a critic's weights and optimizer) as shards: ``sharded/`` holds one
``torch.distributed.checkpoint`` file per rank, each written by its rank, and rank 0's ``.metadata``. Any learner
restores either kind: ``torch.distributed.checkpoint`` reshards to its own ranks (or to whole tensors), and a whole
optimizer state goes into a sharded learner by parameter name.
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file

from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.manifest import SnapshotManifest

TRAINER_STATE = "trainer_state.pt"
SHARDED_DIR = "sharded"
CONFIG_FILE = "config.yaml"
IN_FLIGHT_FILE = "rollouts/in_flight.json"  # async runs: the samples of the steps in flight (rank 0)
# Sections a run may change while it trains (rollback overrides, the OOM fallback); a restart keeps
# the values its snapshot was trained with.
TRAINED_SECTIONS = ("learner", "algo", "reward")


# --------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """Returns this process's torch, numpy and python RNG states as tensors, lists and numbers.

    Only types that ``torch.load(weights_only=True)`` reads back are used (numpy's key array and
    python's state tuple become lists).
    """
    np_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)), "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores RNG states saved by ``rng_state``."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# --------------------------------------------------------------------------------------------
# Write
# --------------------------------------------------------------------------------------------
def write_payload(out: Path, *, learner: Any, tokenizer: Any, config_yaml: str,
                  weights: dict[str, torch.Tensor] | None = None) -> None:
    """Writes rank 0's payload into the local folder ``out``: model/, trainer_state.pt, config.yaml.

    ``weights``: a sharded learner's gathered ``checkpoint_weights`` for model/, or None to save the module's own.
    """
    extra = {} if weights is None else {"state_dict": weights}
    learner.module.save_pretrained(out / "model", safe_serialization=True, **extra)
    tokenizer.save_pretrained(out / "model")
    torch.save(learner.state_dict(), out / TRAINER_STATE)
    (out / CONFIG_FILE).write_text(config_yaml)


def write_rng(uri: str, rank: int, options: dict[str, Any] | None) -> dict[str, int]:
    """Writes this rank's RNG states to ``<uri>/rng/rank_<rank>.pt``; returns {relative path: bytes}.

    Raises:
        rlray.checkpoint.storage.SnapshotError: the write failed.
    """
    with tempfile.TemporaryDirectory(prefix="rlray-rng-") as tmp:
        torch.save(rng_state(), Path(tmp) / f"rank_{rank}.pt")
        sizes = checkpoint.put_files(checkpoint.join(uri, "rng"), Path(tmp), options)
    return {f"rng/{k}": v for k, v in sizes.items()}


def write_rank0(uri: str, *, learner: Any, tokenizer: Any, config_yaml: str, options: dict[str, Any] | None,
                ) -> dict[str, int]:
    """Writes rank 0's payload and RNG states to the snapshot folder ``uri``; returns {relative path: bytes}.

    Raises:
        rlray.checkpoint.storage.SnapshotError: the write failed (the folder is left without a manifest).
    """
    return write_rank(uri, rank=0, learner=learner, tokenizer=tokenizer, config_yaml=config_yaml, options=options)


def write_rank(uri: str, *, rank: int, learner: Any, tokenizer: Any, config_yaml: str,
               options: dict[str, Any] | None) -> dict[str, int]:
    """Writes this rank's part of the snapshot folder ``uri``; returns {relative path: bytes}.

    Every rank writes its RNG states; rank 0 the payload (``write_payload``). A sharded learner's ranks first gather
    the weights to rank 0 and save their optimizer shards (collectives: every rank calls this), then each uploads its
    own ``sharded/`` file.

    Raises:
        rlray.checkpoint.storage.SnapshotError: the write failed (the folder is left without a manifest).
    """
    with tempfile.TemporaryDirectory(prefix="rlray-snap-") as tmp:
        out, sizes = Path(tmp), {}
        weights = None
        if learner.parallel.sharded:  # the strategy saves the optimizer as shards (FSDP2)
            weights = learner.checkpoint_weights()
            dcp.save(learner.sharded_state_dict(), storage_writer=dcp.FileSystemWriter(out / SHARDED_DIR))
            if rank != 0:
                sizes = checkpoint.put_files(uri, out, options)
        if rank == 0:
            write_payload(out, learner=learner, tokenizer=tokenizer, config_yaml=config_yaml, weights=weights)
            sizes = checkpoint.put_files(uri, out, options)
    return {**sizes, **write_rng(uri, rank, options)}


def write_in_flight(uri: str, rollouts: list[dict | None], options: dict[str, Any] | None) -> dict[str, int]:
    """Writes the rollouts of an async run's steps in flight (``RolloutPipeline.in_flight_rollouts``: JSON data) to
    ``<uri>/rollouts/in_flight.json``; returns {relative path: bytes}.

    Raises:
        rlray.checkpoint.storage.SnapshotError: the write failed.
    """
    with tempfile.TemporaryDirectory(prefix="rlray-inflight-") as tmp:
        local = Path(tmp) / "in_flight.json"
        local.write_text(json.dumps(rollouts))
        return {IN_FLIGHT_FILE: checkpoint.put_file(local, checkpoint.join(uri, IN_FLIGHT_FILE), options)}


def read_in_flight(uri: str, manifest: SnapshotManifest, options: dict[str, Any] | None) -> list[dict | None] | None:
    """Returns the rollouts of the steps in flight a snapshot kept (``write_in_flight``), or None when it kept none
    (a synchronous run, or a snapshot written before they were kept).

    Raises:
        rlray.checkpoint.storage.SnapshotError: the file is listed in the manifest but cannot be read.
    """
    if IN_FLIGHT_FILE not in manifest.files:
        return None
    fs, path = checkpoint.open_fs(checkpoint.join(uri, IN_FLIGHT_FILE), options)
    try:
        with fs.open(path, "r") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise checkpoint.SnapshotError(f"could not read '{checkpoint.join(uri, IN_FLIGHT_FILE)}': {err}") from err


# --------------------------------------------------------------------------------------------
# Restore
# --------------------------------------------------------------------------------------------
def snapshot_config(uri: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Returns the config tree a snapshot was trained with (its config.yaml; secrets are masked there).

    Raises:
        rlray.checkpoint.storage.SnapshotError: the snapshot is incomplete or has no config.
    """
    checkpoint.read_manifest(uri, options, verify=False)
    fs, root = checkpoint.open_fs(uri, options)
    try:
        return yaml.safe_load(fs.cat_file(f"{root}/{CONFIG_FILE}"))
    except (OSError, yaml.YAMLError) as err:
        raise checkpoint.SnapshotError(f"could not read the config of snapshot '{uri}': {err}") from err


def adopt_trained_tree(tree: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Returns a copy of the config tree ``tree`` with the sections a run changes while training taken from
    ``trained`` (plain data; the caller validates it: ``rlray.plan.plan_from_tree`` or ``validate_tree``).

    The learner, algo and reward sections and ``model.gradient_checkpointing`` come from the
    snapshot's config (a rollback or the OOM fallback may have changed them); everything else,
    secrets included, stays as in ``tree``.
    """
    tree = copy.deepcopy(tree)
    for section in TRAINED_SECTIONS:
        tree[section] = trained[section]
    tree["model"]["gradient_checkpointing"] = trained["model"]["gradient_checkpointing"]
    return tree


def load_model_weights(module: torch.nn.Module, model_dir: Path) -> None:
    """Loads every ``*.safetensors`` file of ``model_dir`` into ``module`` in place.

    A LoRA policy (``model.lora.rank`` or ``model.adapter_path``) is a peft model whose ``save_pretrained``
    wrote the adapter only (adapter_config.json, adapter_model.safetensors, names without the adapter
    name): its tensors go in through peft's ``set_peft_model_state_dict``, and every adapter tensor of the
    module must be among them (the base weights are model.path's, never trained).

    A sharded (FSDP2) module loads the same whole tensors inside its strategy's ``whole_into_shards`` context
    (``restore_learner``): each parameter copies its own shard.

    Raises:
        RuntimeError: a tensor the module has is missing (other than a tied LM head) or an unknown one.
    """
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(file)))
    if (Path(model_dir) / "adapter_config.json").is_file():
        _load_adapter_weights(module, state)
        return
    missing, unexpected = module.load_state_dict(state, strict=False)
    tied = bool(getattr(module.config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"snapshot weights do not fit the policy: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _load_adapter_weights(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Loads a peft adapter state dict (``save_pretrained``'s names) into the peft model ``module``.

    Raises:
        RuntimeError: the module is not a LoRA policy, or an adapter tensor is missing or unknown.
    """
    from peft import PeftModel, set_peft_model_state_dict

    if not isinstance(module, PeftModel):
        raise RuntimeError("the snapshot holds a LoRA adapter but the policy has none; set model.lora.rank or "
                           "model.adapter_path as the snapshot's run did")
    result = set_peft_model_state_dict(module, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"snapshot adapter does not fit the policy: missing {missing[:3]}, "
                           f"unexpected {list(result.unexpected_keys)[:3]}")


def set_optimizer_hparams(learner: Any, ln: Any) -> None:
    """Sets lr, betas, weight decay and the grad clip of a learner from ``ln``, the ``learner`` section in force
    (its ``lr``, ``betas``, ``weight_decay`` and ``max_grad_norm``).

    Loading an optimizer state brings back the hyper-parameters it was saved with; this makes the
    config in effect (a user's on resume, the rollback's after a rollback) win. The scheduler keeps
    its step count, so warm-up continues where it was.
    """
    learner.max_grad_norm = ln.max_grad_norm
    learner.scheduler.base_lrs = [ln.lr for _ in learner.optimizer.param_groups]
    factor = learner.scheduler.lr_lambdas[0](learner.scheduler.last_epoch)
    for group in learner.optimizer.param_groups:
        group.update(lr=ln.lr * factor, initial_lr=ln.lr, betas=tuple(ln.betas), weight_decay=ln.weight_decay)
    # get_last_lr() reads the scheduler's cached value, which the loaded state set to the old lr
    learner.scheduler._last_lr = [group["lr"] for group in learner.optimizer.param_groups]


def restore_learner(uri: str, *, learner: Any, rank: int, options: dict[str, Any] | None) -> SnapshotManifest:
    """Loads a snapshot's weights, optimizer, scheduler and this rank's RNG states; returns its manifest.

    A collective for a sharded learner (``learner.parallel.sharded``), or a snapshot with ``sharded/`` state: every
    rank calls it.

    Raises:
        rlray.checkpoint.storage.SnapshotError: the snapshot is incomplete or damaged, or keeps no data cursor
            (a format-1 snapshot: a model folder, not a run to resume).
    """
    manifest = checkpoint.read_manifest(uri, options)
    if manifest.data_cursor is None:
        raise checkpoint.SnapshotError(f"snapshot '{uri}' keeps no data cursor (an old format-1 snapshot) and cannot be "
                                       "resumed from; its model/ folder can be model.path of a new run")
    with tempfile.TemporaryDirectory(prefix="rlray-restore-") as tmp:
        local = checkpoint.fetch_local(uri, Path(tmp) / "snap", options)
        with torch.no_grad(), learner.parallel.whole_into_shards():  # a sharded module takes each tensor's shard
            load_model_weights(learner.module, local / "model")
        learner.load_state_dict(torch.load(local / TRAINER_STATE, weights_only=True))
        if (local / SHARDED_DIR).is_dir():
            state = learner.sharded_state_dict()  # the template: this learner's own layout, resharded into
            dcp.load(state, storage_reader=dcp.FileSystemReader(local / SHARDED_DIR))
            learner.load_sharded_state_dict(state)
        rng = local / "rng" / f"rank_{rank}.pt"
        if rng.exists():
            set_rng_state(torch.load(rng, weights_only=True))
    return manifest
