"""``pin_hub_models``: every Hugging Face Hub id that names a model, replaced once by its local snapshot folder.

The driver calls it before the plan is resolved (``rlray.plan.paths.resolve_paths``), so every role of the run
reads the same local folder: the weights are fetched (or found in the Hugging Face cache) once, never on each actor.
It edits the config, so it lives beside ``resolve_plan``, the config's reader (issue 38).
"""

from __future__ import annotations

import logging

from rlray.config import Config
from rlray.models import hub_local_path

log = logging.getLogger(__name__)


def pin_hub_models(cfg: Config) -> Config:
    """Returns ``cfg`` with every Hugging Face Hub id that names a model replaced by its local snapshot folder.

    The keys: ``model.path`` and ``model.adapter_path``, ``teacher.path``, ``reward.model_path``,
    ``critic.model_path`` and each ``reward.judges[i].path``, each with its own revision key (``model.revision``,
    ``model.adapter_revision``, ``teacher.revision``, ``reward.model_revision``, ``critic.model_revision``,
    ``reward.judges[i].revision``). The driver calls it once (``rlray.plan.paths.resolve_paths``): the
    weights are fetched there, or found in the Hugging Face cache (``HF_HUB_OFFLINE=1``: only there), and
    every actor and worker then reads the same local folder (on a cluster of several machines, put the
    Hugging Face cache (``HF_HUB_CACHE``) on storage they share). Each replacement is logged; folders, .gguf
    files and aliases are left as they are, and the revision keys are kept (MLflow's params show them).

    Raises:
        rlray.models.ModelError: a Hub id cannot be had: unknown, private or gated without a token, a revision that
            does not exist, offline without the files in the cache (names the key, ``hub_snapshot``).
    """
    out = cfg.model_copy(deep=True)

    def pin(path: str | None, revision: str | None, key: str, adapter: bool = False) -> str | None:
        local = path if path is None else hub_local_path(path, revision=revision, key=key, adapter=adapter)
        if local != path:
            log.info("%s='%s'%s: the Hugging Face snapshot %s", key, path, f" (revision '{revision}')" if revision else "",
                     local)
        return local

    out.model.path = pin(cfg.model.path, cfg.model.revision, "model.path")
    out.model.adapter_path = pin(cfg.model.adapter_path, cfg.model.adapter_revision, "model.adapter_path", adapter=True)
    out.teacher.path = pin(cfg.teacher.path, cfg.teacher.revision, "teacher.path")
    out.reward.model_path = pin(cfg.reward.model_path, cfg.reward.model_revision, "reward.model_path")
    out.critic.model_path = pin(cfg.critic.model_path, cfg.critic.model_revision, "critic.model_path")
    for i, judge in enumerate(out.reward.judges):
        judge.path = pin(judge.path, judge.revision, f"reward.judges[{i}].path")
    return out
