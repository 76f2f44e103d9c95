"""The preflight's checks of environments and of the columns rewards read: found in seconds, before the run starts.

Without them each of these ends a run that cannot learn only once it runs, with every episode failed or every row a
single-turn prompt, and the reason in a Ray worker's log file:

- a row whose ``env.column`` names an environment that ``env.environments`` lacks (nor ``env.agents``: its rows
  run as agent episodes, not checked here);
- an environment no row reaches (neither a row's ``env.column`` names it nor ``env.default``): a TRL user with one
  ``environment_factory`` expects it to apply to every row, which is ``env.default``;
- a file or module that cannot be imported (the file's folder is on the import path while it loads), a class that
  is missing or has no ``reset``;
- a ``reset`` keyword parameter without a default that some rows lack as a column (``rlray.envs.probe``);
- a first episode that cannot be opened: the class raises when built, ``reset`` raises on every one of the first
  ``PROBE_ROWS`` rows routed to it (a row's missing column it reads, ``KeyError``), or a tool has no usable JSON
  schema. ``reset`` runs in a child process (``rlray.envs.probe.probe_in_sandbox``; with ``env.sandbox`` under the
  untrusted limits), never in the driver. When only some of those rows fail, that is a warning: their episodes
  will fail and be counted (``env/failed``);
- a reward function's parameter that no column of the data provides (``check_reward_columns``: the scorer is built
  as rank 0 builds it, user functions in their sandboxes).

Each raises ``ValueError`` naming the key, the file or row and the fix; ``rlray.launch.preflight`` makes it one
``rlray:`` line (exit status 2).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rlray.data import PromptRow
from rlray.envs.host import ResetReply
from rlray.envs.probe import probe_in_sandbox, reset_kwargs, row_environment
from rlray.plan import RunPlan
from rlray.reward.scorer import RewardScorer

log = logging.getLogger(__name__)

PROBE_ROWS = 3  # rows routed to an environment that the preflight tries to open an episode on, at most


@dataclass
class EnvOpening:
    """An environment's first episode, opened by the preflight.

    Attributes:
        name: the ``env.environments`` key; spec: its class.
        trl: the class is written for TRL's ``environment_factory``.
        row_id: the prompt row it was opened on; rows: the data rows (train and eval) routed to it.
        reply: what ``reset`` gave: the opening messages and the tools' JSON schemas.
    """

    name: str
    spec: str
    trl: bool
    row_id: str
    rows: int
    reply: ResetReply


def route_rows(plan: RunPlan, train_rows: list[PromptRow], eval_rows: list[PromptRow]) -> dict[str, list[PromptRow]]:
    """Returns {environment name: the rows routed to it, train rows first} for every configured environment (rows
    that name an agent of ``env.agents`` run as agent episodes and are in none).

    Raises:
        ValueError: a row names an environment that is not configured (nor an agent), or an environment no row
            reaches (the message names the row or key and the fix).
    """
    env = plan.episodes
    agents = dict(env.agents)
    routed: dict[str, list[PromptRow]] = {name: [] for name in env.episode_environments}
    for key, rows in (("data.train_files", train_rows), ("data.eval_files", eval_rows)):
        for row in rows:
            name = row_environment(row.columns, env.column, env.default)
            if name and name not in routed and name not in agents:
                known = f" nor in env.agents {sorted(agents)}" if agents else ""
                raise ValueError(f"{key}: row '{row.prompt_id}' names environment '{name}' in its '{env.column}' "
                                 f"column, which is not in env.environments {sorted(routed)}{known}; add it there "
                                 "or fix the row")
            if name in routed:
                routed[name].append(row)
    unreached = [name for name, rows in routed.items() if not rows]
    if unreached:
        example = unreached[0]
        raise ValueError(
            f"env.environments: no row reaches {', '.join(repr(n) for n in unreached)}: no row of data.train_files or "
            f"data.eval_files has '{env.column}' = {example!r}"
            + ("" if env.default is None else f" and env.default is {env.default!r}")
            + f" (so every row would be a single-turn prompt). To run every row in it (TRL's single "
            f"environment_factory), set env.default={example}; otherwise add an '{env.column}' column naming it "
            "(env.column) to the rows that should run in it, or remove it"
        )
    return routed


def check_environments(plan: RunPlan, train_rows: list[PromptRow], eval_rows: list[PromptRow]) -> list[EnvOpening]:
    """Returns the first episode of every configured environment after the checks in the module docstring.

    Args:
        plan: the run's plan (of the config with local paths resolved).
        train_rows, eval_rows: the prompt rows of ``data.train_files``, and the first ``eval.num_problems`` of
            ``data.eval_files`` (the rows evaluation runs).

    Raises:
        ValueError: a check failed (the message names the key, the file or row, and the fix).
    """
    cfg, specs, openings = plan.settings, dict(plan.episodes.environments), []
    env = cfg.env  # the probe's sandbox settings
    servers = {s.spec.name for s in plan.episodes.servers}
    for name, rows in route_rows(plan, train_rows, eval_rows).items():
        if name in servers:  # a server starts in the hosts (its start errors name it there)
            continue
        spec, key = specs[name], f"env.environments.{name}"
        probed = list({r.prompt_id: r for r in rows}.values())[:PROBE_ROWS]  # distinct rows (eval may repeat train)
        kwargs = [reset_kwargs(r.columns, r.prompt, cfg.data.prompt_column) for r in probed]
        try:
            report = probe_in_sandbox(spec, kwargs, trl_parity=env.trl_parity, untrusted=env.sandbox,
                                      memory_gib=env.memory_gib, timeout_s=env.step_timeout_s * len(kwargs))
        except ValueError as err:
            raise ValueError(f"{key}='{spec}': {str(err).removeprefix(f'environment {spec!r}: ')}") from None
        _check_columns(key, spec, report.required_columns, rows, cfg.data.prompt_column)
        if report.tool_schema_error:
            raise ValueError(f"{key}='{spec}': {report.tool_schema_error}")
        opened = report.opened
        tried = [r.prompt_id for r in probed[: len(report.replies)]]
        if opened is None:
            raise ValueError(f"{key}='{spec}': no episode could be opened on the first {len(tried)} rows routed to it "
                             f"({', '.join(tried)}): {report.replies[0].message}; reset gets the keyword arguments "
                             f"{sorted(kwargs[0])}: add the columns it reads to the data, or fix the environment")
        for row_id, reply in zip(tried, report.replies, strict=False):
            if reply.error:
                log.warning("%s='%s': row '%s' cannot open an episode (%s); its episodes will fail (env/failed)",
                            key, spec, row_id, reply.message)
        openings.append(EnvOpening(name, spec, report.trl, tried[-1], len(rows), opened))
    return openings


def _check_columns(key: str, spec: str, required: list[str], rows: list[PromptRow], prompt_column: str) -> None:
    """Checks that every row routed to an environment has the columns its ``reset`` cannot do without.

    Raises:
        ValueError: names the column, how many rows lack it and the first of them.
    """
    for column in required:
        lacking = [r.prompt_id for r in rows if column not in reset_kwargs(r.columns, r.prompt, prompt_column)]
        if lacking:
            raise ValueError(f"{key}='{spec}': reset needs the column '{column}' (a keyword parameter without a "
                             f"default), which {len(lacking)} of the {len(rows)} rows routed to it lack (first: "
                             f"'{lacking[0]}'); add the column to the data or give the parameter a default")


def check_reward_columns(plan: RunPlan, columns: list[str]) -> None:
    """Checks the reward functions against the data's columns by building the scorer as rank 0 does (every entry's
    name and kwargs; a built-in's column; a user function loaded in its own sandbox, its parameters checked), then
    stops it. A reward model is not loaded here.

    Raises:
        rlray.reward.RewardFunctionError: names the entry, the parameter or column, and the data's columns.
    """
    cfg = plan.settings
    if not cfg.reward.functions:
        return
    RewardScorer(functions=[f.model_dump() for f in cfg.reward.functions], columns=columns).close()
