"""Config section env: multi-turn environments (episodes of turns with observations and tools)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlray.config.base import _Section


class EnvConfig(_Section):
    """Environments: each prompt row whose ``env.column`` names one runs as a multi-turn episode in it.

    Example (configs/envs/mixed_tiny.yaml): ``environments: {calculator: rlray.envs.builtin.calculator:CalculatorEnv,
    guess: rlray.envs.builtin.guess:GuessNumberEnv}``; rows with ``"environment": "guess"`` play the game, rows
    without the column are single-turn prompts scored by reward.functions.
    """

    environments: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Environment name -> class: 'package.module:Class' or 'path/to/file.py:Class' (relative to the working "
            "folder). A class in rlray's contract (reset(**row) -> EnvReset, step(turn) -> EnvStep) or a TRL "
            "environment_factory class (reset returning None or a string, public methods as tools, optional "
            "get_reward). Empty: no environments (single-turn rollouts)."
        ),
    )
    column: str = Field(
        "environment", min_length=1, description="Row column naming the row's environment (TRL's dict of factories)."
    )
    default: str | None = Field(
        None, description="Environment of rows without that column; None makes such rows single-turn prompts."
    )
    max_turns: int = Field(8, ge=1, description="Assistant turns per episode; then it ends (stop reason max_turns).")
    max_episode_tokens: int | None = Field(
        None,
        ge=16,
        description=(
            "Prompt + turns + observations, in tokens; a turn starts only while rollout.max_new_tokens more fit "
            "(else stop reason max_episode_tokens). None: data.max_prompt_tokens + max_turns * "
            "rollout.max_new_tokens + (max_turns - 1) * max_observation_tokens, capped by the engine's max_model_len."
        ),
    )
    max_observation_tokens: int = Field(
        256, ge=1, description="Cap per observation message's content, in tokens; longer ones are cut (counted)."
    )
    step_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description=(
            "Seconds one reset or step call may take; past it the episode fails (stop reason timeout). Soft without "
            "env.sandbox (the thread is abandoned, not killed), hard with it (the episode's process is killed)."
        ),
    )
    sandbox: bool = Field(
        False,
        description=(
            "Run each episode's environment (and so its tools) in its own child process with the sandbox's untrusted "
            "limits (memory cap, emptied environment variables, private temp folder): for untrusted environment or "
            "tool code; a timeout then kills that episode only. Costs a process start (seconds) per episode."
        ),
    )
    memory_gib: float = Field(2.0, gt=0.0, description="Address-space cap of a sandboxed episode's process, in GiB.")
    episode_timeout_s: float = Field(
        600.0, gt=0.0, description="Seconds one episode may run, checked between turns (stop reason episode_timeout)."
    )
    tool_parser: Literal["hermes"] = Field(
        "hermes", description="How tool calls are read from the model's text: hermes (<tool_call>{json}</tool_call>)."
    )
    trl_parity: bool = Field(
        True,
        description=(
            "Classes written for TRL's environment_factory see what TRL 1.16 shows them: a tool's result as str(result) "
            "(a list as content parts), a failing or unknown call as {'error': '<message>'}, a turn with a call that "
            "cannot be parsed as plain text (the episode ends, get_reward scores it), and the tool calls of turn "
            "env.max_turns (TRL's max_tool_calling_iterations + 1) are not run. False: rlray's wording (dicts and "
            "lists as JSON, \"Error: tool 'x' raised ...\", unparsable calls answered with an error) and the last "
            "turn's calls run. rlray's own environment classes are not affected."
        ),
    )
    reward_weight: float = Field(
        1.0, description="Weight of the environment's reward (the sum of its turn rewards) in the sample's reward."
    )

    @field_validator("environments")
    @classmethod
    def _specs(cls, value: dict[str, str]) -> dict[str, str]:
        for name, spec in value.items():
            if ":" not in spec:
                raise ValueError(f"env.environments.{name}={spec!r}: write 'package.module:Class' or 'file.py:Class'")
        return value

    @property
    def enabled(self) -> bool:
        """Returns True when environments are configured."""
        return bool(self.environments)
