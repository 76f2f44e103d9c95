"""``rlray export``: a run's trained policy as a plain Hugging Face folder that transformers and vLLM load.

A snapshot's ``model/`` folder (``rlray.checkpoint.contents.write_payload``) is already a Hugging Face folder for a
policy that trains every weight: safetensors weights, config.json, generation_config.json when the model has one,
and the tokenizer files with the chat template the run used (``model.chat_template`` replaces the tokenizer's own
before the run saves it). The export copies it. A LoRA policy's ``model/`` holds the adapter only (peft's
adapter_config.json and adapter_model.safetensors, beside the tokenizer files): the export loads the run's base model
(the snapshot's ``model.path`` and ``model.revision``) in float32, puts the adapter on it and merges every delta in
with the learner's own ``merged_lora_state_dict`` (the weights the rollout engines receive), so the folder holds the
architecture's plain weights; with ``adapter=True`` it keeps the adapter folder as it is, for peft.

What to export is a snapshot folder or URI (or a run folder: its newest complete snapshot), ``latest`` (the newest
complete snapshot under ``checkpoint.uri``), or an MLflow run id (its newest complete snapshot, found through the run's
``rlray.snapshot_dir`` tag).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.contents import snapshot_config
from rlray.plan import RunPlan

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
SKIPPED_FILES = ("README.md",)  # peft's model card of the adapter: not the merged model's


class ExportError(ValueError):
    """What to export or where to write it is wrong; the message names the argument and the fix."""


def find_snapshot(ref: str, plan: RunPlan) -> str:
    """Returns the URI of the complete snapshot ``ref`` names.

    Args:
        ref: a snapshot folder or URI, a run folder or storage root (its newest complete snapshot), ``latest`` (the
            newest complete snapshot under ``plan.snapshots.uri``) or an MLflow run id (its newest complete
            snapshot, under the run's ``rlray.snapshot_dir`` tag, in ``plan.tracking.mlflow_uri``).
        plan: the run's plan: gives the storage root, the MLflow store and the S3 options.

    Raises:
        ExportError: nothing complete matches, or the run is unknown or has no snapshot folder.
    """
    opts, root = plan.settings.checkpoint.s3.storage_options(), plan.snapshots.uri
    if ref == "latest":
        found = checkpoint.latest_snapshot(root, opts)
        if found is None:
            raise ExportError(f"RUN_OR_SNAPSHOT=latest: no complete snapshot under '{root}' "
                              "(checkpoint.uri); give --config with the run's config, or a snapshot folder")
        return found
    where = ref
    if "/" not in ref and "://" not in ref and not Path(ref).exists():
        where = _run_snapshot_dir(ref, plan)
    try:
        return checkpoint.resolve_snapshot(where, root, opts)
    except checkpoint.SnapshotError as err:
        raise ExportError(f"RUN_OR_SNAPSHOT={ref}: {err}; give a complete snapshot (rlray snapshots list shows "
                          "which are complete)") from err


def _run_snapshot_dir(run_id: str, plan: RunPlan) -> str:
    """Returns the snapshot folder of the MLflow run ``run_id`` (its ``rlray.snapshot_dir`` tag).

    Raises:
        ExportError: no such run in the store, or the run has no snapshot folder tag.
    """
    from mlflow.exceptions import MlflowException

    from rlray.observe import tracking

    uri = plan.tracking.mlflow_uri
    try:
        run = tracking.get_run(uri, run_id)
    except MlflowException as err:
        raise ExportError(f"RUN_OR_SNAPSHOT={run_id}: neither a snapshot folder nor a run in the MLflow store '{uri}'; "
                          "give a snapshot folder, or --config with the run's tracking.mlflow_uri") from err
    found = run.data.tags.get("rlray.snapshot_dir")
    if not found:
        raise ExportError(f"RUN_OR_SNAPSHOT={run_id}: the run has no rlray.snapshot_dir tag (was it started by rlray "
                          "train?); give a snapshot folder")
    return found


def export_snapshot(ref: str, dest: str | Path, plan: RunPlan, *, adapter: bool = False) -> dict[str, Any]:
    """Writes the policy of the snapshot ``ref`` names to the folder ``dest`` as a plain Hugging Face folder.

    The folder is written beside ``dest`` and renamed into place at the end: a failed export leaves nothing.

    Args:
        ref: what to export (see ``find_snapshot``).
        dest: a folder that does not exist yet or is empty.
        plan: the run's plan (``rlray.plan.resolve_plan``): gives the storage root, the MLflow store and the S3
            options.
        adapter: keep a LoRA policy as a peft adapter folder instead of merging it into the base weights.

    Returns:
        {snapshot, step, to, format}: format is "full" (a policy that trained every weight), "merged" (LoRA merged
        into the base model, float32 weights) or "adapter"; "base" (the base model's folder) for a LoRA policy.

    Raises:
        ExportError: ``ref`` names no complete snapshot, ``dest`` is not empty, ``adapter`` on a policy without
            LoRA, or the snapshot's model folder is not a Hugging Face folder.
        rlray.models.ModelError: the base model of a LoRA snapshot cannot be found or loaded.
    """
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ExportError(f"--to {dest}: exists and is not an empty folder; give a new folder (the export never "
                          "overwrites)")
    uri = find_snapshot(ref, plan)
    opts = plan.settings.checkpoint.s3.storage_options()
    manifest = checkpoint.read_manifest(uri, opts)
    out = {"snapshot": uri, "step": manifest.step, "to": str(dest)}
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlray-export-") as tmp:
        model = Path(checkpoint.local_model_dir(uri, str(Path(tmp) / "snap"), opts))
        staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            out.update(_write(model, staged, snapshot_config(uri, opts), adapter=adapter, ref=ref))
            if dest.exists():
                dest.rmdir()  # empty (checked above)
            os.replace(staged, dest)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    return out


def _write(model: Path, out: Path, trained: dict[str, Any], *, adapter: bool, ref: str) -> dict[str, Any]:
    """Writes the export of the snapshot model folder ``model`` into ``out``; returns {format[, base]}.

    Raises:
        ExportError: ``adapter`` without a LoRA adapter, or no weights or config in ``model``.
    """
    is_lora = (model / "adapter_config.json").is_file()
    if adapter and not is_lora:
        raise ExportError(f"--adapter: the snapshot of {ref} trained every weight (no LoRA adapter in its model/); "
                          "export it without --adapter")
    if not is_lora and not ((model / "config.json").is_file() and any(model.glob("*.safetensors"))):
        raise ExportError(f"RUN_OR_SNAPSHOT={ref}: the snapshot's model/ folder holds no config.json and safetensors "
                          "weights; it is not a policy snapshot")
    if not is_lora or adapter:
        _copy_files(model, out, skip=())
        return {"format": "adapter" if adapter else "full"}
    base = _merge_lora(model, out, trained["model"])
    _copy_files(model, out, skip=(*ADAPTER_FILES, *SKIPPED_FILES, "config.json", "generation_config.json"))
    return {"format": "merged", "base": base}


def _copy_files(src: Path, out: Path, *, skip: tuple[str, ...]) -> None:
    """Copies every file of the folder ``src`` (sub-folders included) into ``out``, except names in ``skip``."""
    for file in sorted(src.rglob("*")):
        if file.is_file() and file.name not in skip:
            target = out / file.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)


def _merge_lora(model: Path, out: Path, trained_model: dict[str, Any]) -> str:
    """Writes the base model with the adapter in ``model`` merged in (float32 safetensors, config.json,
    generation_config.json) into ``out``; returns the base model's folder.

    Raises:
        rlray.models.ModelError: the base model (``model.path`` of the snapshot's config) cannot be found or loaded.
    """
    import torch

    from rlray.learner.lora import merged_lora_state_dict
    from rlray.models import load_causal_lm, resolve_model_path
    from rlray.models.adapters import load_adapter

    base = resolve_model_path(trained_model["path"], revision=trained_model.get("revision"))
    # through rlray's adapter loader: the folder's adapter_model.safetensors is checked first (never a pickled .bin)
    peft_model = load_adapter(load_causal_lm(base, dtype=torch.float32), str(model), base)
    merged = merged_lora_state_dict(peft_model)
    plain = peft_model.unload()  # the base architecture again, adapters removed (not merged: the merge is ``merged``)
    plain.load_state_dict(merged, strict=True)
    plain.save_pretrained(out, safe_serialization=True)
    return base
