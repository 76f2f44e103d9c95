"""Checks before a run starts: everything a run reads is found and valid before Ray, actors or MLflow start.

Inside the run the same problems would surface only in the learner's setup (rank 0), minutes later and
after Ray Train's restarts (``monitor.max_failures``, each after ``monitor.restart_delay_s``). Here they fail
at once with the error of the module that owns the input, which names the config key, file, row or line:

- ``model.path`` (and PPO's ``critic.model_path``) resolve to a model folder (``ModelError``), and the
  tokenizer loads with a chat template, or ``model.chat_template`` is given (``ModelError``);
- ``model.adapter_path`` is a LoRA adapter folder whose tensors fit the base model (``ModelError``);
- ``teacher.path`` resolves to a model folder whose vocabulary is the student's: the same vocabulary size and
  the same token-to-id map (``ModelError`` naming both models and both sizes);
- the data files load and every row validates (``DataError``): ``data.train_files`` and, with eval on,
  ``data.eval_files`` for online algorithms (with ``data.long_prompts=error`` also no prompt is too
  long), ``offline.pairs_files`` for offline ones;
- each ``reward.functions[i].function`` is a built-in verifier, a file that exists or a module that can be found
  (``RewardFunctionError``), and its parameters fit the data's columns (the function itself is loaded in its
  sandbox, never in the driver; ``rlray.launch.envcheck.check_reward_columns``);
- every row reaches a configured environment or none, every environment is reached, loads, and opens its first
  episode with usable tool schemas (``rlray.launch.envcheck.check_environments``; ``reset`` runs in a child
  process);
- each ``reward.judges[i]`` has a model, templates that read only the rows' columns and render on the first row,
  and labels its tokenizer tells apart (``rlray.launch.judges.check_judges``: ``JudgeError``, ``ModelError``);
- snapshots can be written under ``checkpoint.uri`` (``SnapshotError``): a missing bucket or bad
  ``checkpoint.s3.*`` credentials fail here, not at the first snapshot;
- the learner's and the rollout's predicted memory fits (``rlray.launch.plan.check_fit``, config.json only): with
  GPU resources against this machine's GPU size (nvidia-smi), on the CPU against ``guard.memory_cap_gib`` when
  set; over the budget it warns, beyond the planner's tolerance it fails (``PlacementError``).

Every other ``ValueError`` the checks raise becomes a ``PreflightError``, which ``rlray`` prints as one ``rlray:``
line (exit status 2), as it prints the errors above. Resources larger than the cluster are checked by
``rlray.launch.placement.check_cluster`` once Ray is up.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from rlray.cache import prompt_cache_dir
from rlray.checkpoint import storage as checkpoint
from rlray.data import DataError, load_preference_pairs, load_prompt_rows, prepare_prompts
from rlray.launch.envcheck import check_environments, check_reward_columns
from rlray.launch.judges import check_judges
from rlray.launch.plan import check_fit
from rlray.models import ModelError, cpu_supports_bf16, load_tokenizer, resolve_model_path, vocabulary
from rlray.models.adapters import check_adapter
from rlray.plan import ConfigError, RunPlan
from rlray.reward.scorer import RewardFunctionError
from rlray.reward.verifiers import BUILTIN_VERIFIERS

log = logging.getLogger(__name__)


class PreflightError(ValueError):
    """An input of the run that cannot work, found before the run starts (Ray comes up beside the checks and is
    stopped again); the message names the key, file or row and the fix (an environment, a row's environment, a
    column)."""


def preflight(plan: RunPlan) -> str:
    """Returns the resolved local model folder of ``model.path`` after checking every input of the run.

    Args:
        plan: the run's plan (``rlray.plan.resolve_plan``) of the config with local paths already resolved
            (``rlray.plan.paths.resolve_paths``): its roles decide what is checked, its settings name the files.

    Raises:
        rlray.models.ModelError: the model path, tokenizer or chat template cannot be used, or the teacher's
            cannot, or its vocabulary differs from the student's.
        rlray.data.DataError: a data file is missing, empty or has a bad row, line or column.
        rlray.reward.RewardFunctionError: a reward function's file or module does not exist, or its parameters do
            not fit the data's columns.
        PreflightError: an environment cannot be used or reached, an agent's file or module does not exist, a row
            names an unknown environment or agent, or any other check raised a ``ValueError``.
        rlray.checkpoint.storage.SnapshotError: snapshots cannot be written under ``checkpoint.uri``.
        rlray.launch.placement.PlacementError: a role's predicted memory exceeds its budget beyond the planner's
            tolerance (``check_fit``).
    """
    try:
        return check_inputs(plan)
    except (ModelError, DataError, RewardFunctionError, ConfigError, PreflightError):
        raise
    except ValueError as err:
        raise PreflightError(str(err)) from err


def check_inputs(plan: RunPlan) -> str:
    """Returns the resolved local model folder of ``model.path`` after the checks of ``preflight`` (which words its
    other ``ValueError`` s as ``PreflightError``; the roles checked are the run plan's, ``rlray.plan``)."""
    cfg, roles = plan.settings, plan.roles
    model_dir = resolve_model_path(cfg.model.path, revision=cfg.model.revision)
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    if cfg.model.adapter_path is not None:
        check_adapter(cfg.model.adapter_path, model_dir)
    if roles.teacher != "off":
        check_teacher(cfg.teacher.path, cfg.model.path, model_dir, teacher_revision=cfg.teacher.revision)
    if cfg.model.dtype == "bfloat16" and not plan.uses_gpus and not cpu_supports_bf16():
        log.warning("model.dtype=bfloat16 on a CPU without native bf16 (no AVX-512 BF16 or AMX): torch emulates it, "
                    "~40x slower than float32 for matmuls; set model.dtype=auto or float32")
    if roles.online:
        rows = load_prompt_rows(cfg.data.train_files, prompt_column=cfg.data.prompt_column)
        if cfg.data.long_prompts == "error":
            prepare_prompts(rows, tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens, long_prompts="error",
                            instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt,
                            cache=prompt_cache_dir())  # learner rank 0 then reads the ids from the cache
        eval_rows = []
        if cfg.eval.num_problems:
            eval_rows = load_prompt_rows(cfg.data.eval_files, prompt_column=cfg.data.prompt_column)[: cfg.eval.num_problems]
        if (not plan.reward.functions and plan.reward.model_path is None and not roles.judges
                and roles.teacher == "off" and not roles.env_hosts):
            raise RewardFunctionError(
                "this online run has no reward: set reward.functions (built-in verifiers such as "
                "[{function: math_equal}], or your own 'file.py:function'), reward.judges, reward.model_path, a "
                "distillation teacher (teacher.path), or environments that reward their episodes (env.environments)"
            )
        for fn in cfg.reward.functions:
            check_function_spec(fn.function)
        check_judges(plan, rows)
        for name, spec in cfg.env.environments.items():
            check_environment_spec(name, spec)
        for name, spec in cfg.env.agents.items():
            if (missing := missing_target(spec)) is not None:
                raise ValueError(f"env.agents.{name}='{spec}': {missing}")
        check_reward_columns(plan, sorted({c for row in rows + eval_rows for c in row.columns}))
        check_environments(plan, rows, eval_rows)
        if roles.critic and cfg.critic.model_path:
            resolve_model_path(cfg.critic.model_path, revision=cfg.critic.model_revision, key="critic.model_path")
    else:
        load_preference_pairs(cfg.offline.pairs_files, method=cfg.algo.name, max_pairs=cfg.offline.max_pairs)
    for warning in check_fit(plan):
        log.warning("predicted memory: %s; `rlray plan` shows every term and what to change", warning)
    checkpoint.check_storage(cfg.checkpoint_uri, cfg.checkpoint.s3.storage_options())
    return model_dir


def check_teacher(teacher_path: str, student_path: str, student_dir: str, *, teacher_revision: str | None = None) -> str:
    """Returns the teacher's resolved local folder after checking that its vocabulary is the student's.

    Both the logits' size (config ``vocab_size``, which the JSD compares position by position) and the
    tokenizers' token-to-id maps (the teacher scores the student's token ids) must match.

    Args:
        teacher_path: ``teacher.path`` as configured (a folder, Hub id, .gguf file or alias).
        student_path: ``model.path`` as configured (for the message).
        student_dir: the student's resolved folder.
        teacher_revision: ``teacher.revision``, the Hub revision of a Hub id.

    Raises:
        rlray.models.ModelError: the teacher cannot be resolved, or its vocabulary differs (names both models and
            both vocabulary sizes).
    """
    try:
        teacher_dir = resolve_model_path(teacher_path, revision=teacher_revision, key="teacher.path")
    except ModelError as err:
        raise ModelError(str(err).replace("model.path=", "teacher.path=", 1)) from err  # the alias rules are model.path's
    (teacher_size, teacher_tokens), (student_size, student_tokens) = vocabulary(teacher_dir), vocabulary(student_dir)
    if teacher_size != student_size or teacher_tokens != student_tokens:
        what = "vocabulary sizes differ" if teacher_size != student_size else "tokenizers map tokens to different ids"
        raise ModelError(
            f"teacher.path='{teacher_path}' (vocabulary {teacher_size} tokens) and model.path='{student_path}' "
            f"(vocabulary {student_size} tokens): the {what}; on-policy distillation needs a teacher with the "
            "student's tokenizer (the same model family)"
        )
    return teacher_dir


def check_function_spec(spec: str) -> None:
    """Checks that a reward function spec is a built-in verifier, an existing file or a findable module, without running it.

    Raises:
        RewardFunctionError: a malformed spec, a missing file or a module that cannot be found (names it).
    """
    if ":" not in spec:
        if spec in BUILTIN_VERIFIERS:
            return
        raise RewardFunctionError(
            f"reward function '{spec}' is neither a built-in verifier ({', '.join(sorted(BUILTIN_VERIFIERS))}) nor "
            "'module.path:function' / 'file.py:function'"
        )
    if (missing := missing_target(spec)) is not None:
        raise RewardFunctionError(f"reward function '{spec}': {missing}")


def check_environment_spec(name: str, spec: str) -> None:
    """Checks that ``env.environments.<name>`` names an existing file or a findable module, without importing it
    (an untrusted environment only ever runs in its hosts' sandboxes).

    Raises:
        ValueError: a missing file or a module that cannot be found (names the key and the spec).
    """
    if (missing := missing_target(spec)) is not None:
        raise ValueError(f"env.environments.{name}='{spec}': {missing}")


def missing_target(spec: str) -> str | None:
    """Returns why the file or module of a 'file.py:name' / 'module.path:name' spec cannot be used (its file does not
    exist, or the module cannot be found), or None when it can; nothing is imported."""
    target = spec.rsplit(":", 1)[0]
    if target.endswith(".py"):
        return None if Path(target).is_file() else f"file {Path(target).resolve()} does not exist"
    try:
        found = importlib.util.find_spec(target) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"module '{target}' cannot be found"
