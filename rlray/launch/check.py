"""``rlray check CONFIG``: the preflight, then what the model will see first, printed before anything is launched.

``check_run`` runs every check of ``rlray.launch.preflight`` (model, data, rewards, environments, snapshot storage;
no Ray, no MLflow run), opens the first episode of each environment on a row routed to it (in a child process, as
the preflight does) and renders its opening prompt with the chat template and the tools' JSON schemas, exactly as
the episode's first turn is tokenized (``rlray.envs.episode.open_trajectory``). A run with single-turn rows shows the
first of them too, as ``rlray.data.prepare_prompts`` renders it.
"""

from __future__ import annotations

from typing import Any

from rlray.data import load_prompt_rows, prepare_prompts
from rlray.data.prompts import prompt_messages
from rlray.envs.episode import open_trajectory
from rlray.envs.probe import row_environment
from rlray.launch.envcheck import EnvOpening, check_environments
from rlray.launch.preflight import preflight
from rlray.models import load_tokenizer
from rlray.plan import RunPlan

RULE = "-" * 100


def check_run(plan: RunPlan) -> str:
    """Returns the text ``rlray check`` prints: the checks passed, then each environment's first prompt (and the first
    single-turn row's), each with its token count.

    Args:
        plan: the run's plan (``rlray.plan.resolve_plan``) of the config with local paths resolved
            (``rlray.plan.paths.resolve_paths``).

    Raises:
        as ``rlray.launch.preflight.preflight``.
    """
    model_dir, cfg = preflight(plan), plan.settings
    lines = [f"rlray check: every input of the run is usable (model {model_dir})"]
    if not plan.roles.online:
        return "\n".join(lines + ["rlray check: an offline run: no prompts are rendered"])
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    rows = load_prompt_rows(cfg.data.train_files, prompt_column=cfg.data.prompt_column)
    eval_rows = []
    if cfg.eval.num_problems:
        eval_rows = load_prompt_rows(cfg.data.eval_files, prompt_column=cfg.data.prompt_column)[: cfg.eval.num_problems]
    env = plan.episodes
    for opening in check_environments(plan, rows, eval_rows) if plan.roles.env_hosts else []:
        lines += _episode_lines(plan, tokenizer, opening)
    single = [r for r in rows if not row_environment(r.columns, env.column, env.default)] if plan.roles.env_hosts else rows
    if single:
        _, ids, _ = prepare_prompts(single[:1], tokenizer, max_prompt_tokens=10**9, instruction=cfg.data.instruction,
                                    system_prompt=cfg.data.system_prompt)
        lines += [RULE, f"single-turn rows: {len(single)} of {len(rows)} training rows; the first, '{single[0].prompt_id}', "
                  f"as the model sees it ({len(ids[0])} tokens):", RULE, tokenizer.decode(ids[0])]
    return "\n".join([*lines, RULE])


def _episode_lines(plan: RunPlan, tokenizer: Any, opening: EnvOpening) -> list[str]:
    """Returns the lines of one environment: its class, rows and tools, then its first prompt as tokenized."""
    reply, cfg = opening.reply, plan.settings
    messages = prompt_messages(reply.prompt, instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt)
    traj = open_trajectory(tokenizer, messages, tools=reply.tools, chat_template_kwargs=cfg.rollout.chat_template_kwargs)
    tools = [t["function"]["name"] for t in reply.tools or []]
    kind = "a TRL environment_factory class" if opening.trl else "an rlray environment"
    return [
        RULE,
        f"environment '{opening.name}' ({opening.spec}, {kind}): {opening.rows} rows (train and eval); tools: "
        f"{', '.join(tools) or 'none'}" + (f"; extra stop strings {reply.stop}" if reply.stop else ""),
        f"first prompt, row '{opening.row_id}', as the model sees it ({len(traj.prompt_ids)} tokens, at most "
        f"{plan.episodes.limits.max_turns} turns):",
        RULE,
        tokenizer.decode(traj.prompt_ids),
    ]
