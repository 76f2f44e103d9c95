"""The judges' Serve applications from the driver's side: checked before a run, deployed for it, removed after.

- ``judge_specs``: each judge's definition from the run plan (``plan.reward.judges``), its model path resolved.
- ``check_judges`` (the preflight): each ``reward.judges[i]`` resolves to a model, its templates read only names the
  data's rows have and render on the first row, its prompt leaves room for the verdict, and with ``logprobs`` its
  labels start with different tokens of the judge's tokenizer. Each problem is an error naming the key.
- ``deploy_judges``: one application per judge (``rlray-judge-<name>``, ``resources.judge``), versioned by
  ``reward.version``; on a running application this is the hot swap (``rlray serve-reward``).
- ``judge_apps``: deploys the judges for a block (a run, ``rlray eval``, a sweep) and removes the ones it created
  (an application started before, by ``rlray serve-reward`` or a sweep, stays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from rlray.data import PromptRow
from rlray.models import ModelError, load_tokenizer, resolve_model_path
from rlray.plan import RunPlan
from rlray.reward.judges import (
    RESERVED_VARIABLES,
    JudgeError,
    JudgeItem,
    JudgeSpec,
    spec_mode,
    template_variables,
)
from rlray.reward.judges.service import JudgeService

log = logging.getLogger(__name__)


class _TokenizerOnly:
    """A ``JudgeService`` engine stand-in for the preflight: the check renders and counts, it never generates."""

    def generate(self, prompt_token_ids: list, sampling: object) -> list:
        raise RuntimeError("the preflight's judge does not generate")

    def shutdown(self) -> None:
        """Nothing to stop."""


def judge_specs(plan: RunPlan) -> list[JudgeSpec]:
    """Returns the ``JudgeSpec`` of each ``reward.judges`` entry (``plan.reward.judges``' specs) with its model path
    resolved: an alias or a GGUF file is converted once (``rlray.models.resolve_model_path``).

    Raises:
        rlray.models.ModelError: a judge's path cannot be resolved.
    """
    return [dataclasses.replace(j.spec, model_path=resolve_model_path(j.path, revision=j.revision))
            for j in plan.reward.judges]


def check_judges(plan: RunPlan, rows: list[PromptRow]) -> None:
    """Checks every ``reward.judges`` entry of ``plan`` against the run's data rows before anything starts.

    Raises:
        rlray.models.ModelError: a judge's path cannot be resolved (names ``reward.judges[i].path``).
        rlray.reward.judges.JudgeError: a template reads a name the rows lack or raises on the first row, the first
            row's judge prompt leaves no room for the verdict, or logprob labels share a first token.
    """
    columns = sorted({name for row in rows for name in row.columns})
    for i, judge in enumerate(plan.reward.judges):
        key = f"reward.judges[{i}]"
        try:
            resolve_model_path(judge.path, revision=judge.revision, key=f"{key}.path")
        except ModelError as err:
            raise ModelError(str(err).replace("model.path=", f"{key}.path=", 1)) from err
        for field, text in (("template", judge.spec.template), ("system_prompt", judge.spec.system_prompt),
                            ("prefill", judge.spec.prefill)):  # fmt: skip
            missing = sorted(template_variables(text or "") - set(RESERVED_VARIABLES) - set(columns))
            if missing:
                raise JudgeError(
                    f"{key}.{field} reads {missing}, which the data's rows lack (columns: {columns}; always there: "
                    f"{list(RESERVED_VARIABLES)}); fix the template or use data with those columns"
                )
    for i, spec in enumerate(judge_specs(plan)):
        if rows:
            _check_first_row(f"reward.judges[{i}]", spec, rows[0])


def _check_first_row(key: str, spec: JudgeSpec, row: PromptRow) -> None:
    """Renders a judge's prompt on ``row`` (with a one-word response) and checks its labels and its length."""
    tokenizer = load_tokenizer(spec.model_path)
    mode = spec_mode(spec)
    mode.prepare(spec, tokenizer, key)  # logprob labels that share a first token fail here, naming the key
    service = JudgeService(spec, 0, engine=_TokenizerOnly(), tokenizer=tokenizer)
    responses = ("answer",) * (2 if mode.together else 1)
    try:
        ids, _ = service.prompt_ids(JudgeItem(row.prompt, responses, dict(row.columns)))
    except Exception as err:  # noqa: BLE001 - whatever a template's expressions raise on the row
        raise JudgeError(f"{key}: its templates raise on the first row ({row.prompt_id}): {type(err).__name__}: {err}") from None
    room = spec.max_model_len - service.sampling.max_new_tokens
    if len(ids) > room:
        raise JudgeError(
            f"{key}: the judge prompt of the first row ({row.prompt_id}) has {len(ids)} tokens before any response; "
            f"{room} fit (max_model_len {spec.max_model_len} - max_new_tokens); raise {key}.max_model_len"
        )


def deploy_judges(plan: RunPlan) -> list[str]:
    """Deploys (or updates: the hot swap) the Serve application of every judge and waits until each serves;
    returns the names of the applications this call created.

    An application that already serves the same judge (its version and definition, ``JudgeSpec.definition``) on
    ``resources.judge.replicas`` running replicas is left as it is: a sweep's trials, ``rlray eval`` beside a run,
    a run after ``rlray serve-reward`` find it up (deploying again would replace its replicas). Serve's HTTP proxy
    binds ``reward.server.host:port`` if Serve is not running yet (the judges have no route).
    """
    # deferred: Ray Serve's import takes seconds and only runs with judges need it
    from ray import serve

    from rlray.reward.judges.deployment import build_judge_app, deploy_judge_app

    res, srv, version = plan.roles.judge, plan.settings.reward.server, plan.reward.version
    running = serve.status().applications
    created = []
    for judge, spec in zip(plan.reward.judges, judge_specs(plan), strict=True):
        if _serving(running.get(judge.app_name), judge.app_name, (version, spec.definition), res.count):
            log.info("judge '%s' (version %d) already serves as %s", judge.name, version, judge.app_name)
            continue
        app = build_judge_app(spec, version, replicas=res.count, cpus=res.cpus, gpus=res.gpus,
                              custom_resources=dict(res.custom))  # fmt: skip
        deploy_judge_app(app, judge.app_name, host=srv.host, port=srv.port)
        log.info("judge '%s' (%s, version %d) serves as Serve application %s", judge.name, spec.model_path,
                 version, judge.app_name)
        if judge.app_name not in running:
            created.append(judge.app_name)
    return created


def _serving(status: Any, app_name: str, identity: tuple[int, str], replicas: int) -> bool:
    """Returns True when Serve application ``app_name`` (its ``serve.status()`` entry, None when absent) runs
    ``replicas`` replicas that answer with ``identity`` (version, definition)."""
    from rlray.reward.judges.deployment import DEPLOYMENT, ServeJudgeCaller

    deployment = status.deployments.get(DEPLOYMENT) if status is not None else None
    if deployment is None or deployment.replica_states.get("RUNNING", 0) != replicas:
        return False
    try:
        return tuple(ServeJudgeCaller(app_name).identity(30.0)) == identity
    except Exception:  # noqa: BLE001 - an application that does not answer is deployed again
        return False


@contextlib.contextmanager
def judge_apps(plan: RunPlan) -> Iterator[list[str]]:
    """Deploys the judges of ``plan`` (none without ``reward.judges``) for the block and, on exit, deletes the
    applications it created; yields their names."""
    created = deploy_judges(plan) if plan.reward.judges else []
    try:
        yield created
    finally:
        if created:
            from ray import serve  # deferred: as in deploy_judges

            for name in created:
                serve.delete(name)
