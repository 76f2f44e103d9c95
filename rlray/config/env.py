"""Config section env: multi-turn environments (episodes of turns with observations and tools), environment servers
(OpenEnv), agents behind the gateway, and MCP servers."""

from __future__ import annotations

import shlex
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlray.config.base import _Section


class McpServerConfig(_Section):
    """One MCP server whose tools the environment hosts offer (``rlray.envs.agents.mcp``): a stdio command or a URL."""

    name: str = Field(..., min_length=1, description="The server's name, in messages and logs.")
    command: list[str] | None = Field(
        None,
        description=(
            "A stdio server: the command that starts it (a list, or one string split like a shell line), run by "
            "each environment host as its child process and stopped with it; 'python' runs the host's own "
            "interpreter, and arguments naming files are made absolute at start."
        ),
    )
    url: str | None = Field(None, description="A streamable-HTTP server already running: its endpoint URL.")
    timeout_s: float = Field(
        30.0, gt=0.0, description="Seconds one tool call may take; past it the call is answered with an error."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of a stdio server.")

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return shlex.split(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if bool(self.command) == bool(self.url):
            raise ValueError(f"env.mcp_servers[{self.name!r}]: give either command (a stdio server) or url (streamable "
                             "HTTP), not both and not neither")
        return self


class OpenEnvConfig(_Section):
    """How an OpenEnv server's typed actions and observations meet the model's text (``rlray.envs.servers.openenv``)."""

    action_field: str | None = Field(
        None,
        description=(
            "The action's string field the turn's text fills (the openenv init template's 'message'); None: the turn "
            "writes the action as a JSON object of its fields (the last {...} in its text)."
        ),
    )
    observation_field: str | None = Field(
        None, description="The observation field shown to the model; None: every field but metadata, as JSON."
    )
    reset_columns: list[str] = Field(
        default_factory=list, description="Row columns sent as reset's keyword arguments (seed, a task id, ...)."
    )
    show_reset: bool = Field(True, description="Show the reset observation (a user message) after the row's prompt.")


class ServerConfig(_Section):
    """One environment server (``rlray.envs.servers``): started by each environment host (``command``, in its own
    Python environment) or reached at ``url``; rows whose env.column names it run as its episodes."""

    protocol: Literal["openenv"] = Field(..., description="The server's protocol: openenv (OpenEnv's WebSocket /ws).")
    command: list[str] | None = Field(
        None,
        description=(
            "The command that starts it (a list, or one string split like a shell line), run by each environment host "
            "and stopped with it; {host} and {port} are replaced by env.servers.*.host and a free port; a first word "
            "'python' runs the interpreter of python."
        ),
    )
    url: str | None = Field(None, description="A server already running: its base URL (http://host:port).")
    python: str | None = Field(
        None,
        description=(
            "The Python environment of command: a virtual environment's folder (e.g. .venvs/openenv, built by make "
            "install) or an interpreter, relative to the working folder; its pins never meet rlray's (PYTHONPATH is "
            "not passed). None: rlray's own interpreter."
        ),
    )
    cwd: str | None = Field(None, description="The command's working folder (relative to the working folder).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of the command.")
    host: str = Field("127.0.0.1", description="The address a started server binds ({host} in command).")
    max_sessions: int = Field(
        8, ge=1,
        description=(
            "Episodes open on the server at once, per environment host (OpenEnv: the app's max_concurrent_envs must "
            "be at least this); an episode waits env.step_timeout_s for a free one, then fails (counted)."
        ),
    )
    start_timeout_s: float = Field(120.0, gt=0.0, description="Seconds a start may take until /health answers.")
    max_restarts: int = Field(
        3, ge=0,
        description="Restarts of a started server that dies, over the run (its open episodes fail, counted); then it "
                    "stays down and its episodes fail.",
    )
    openenv: OpenEnvConfig = Field(default_factory=OpenEnvConfig, description="Options of protocol openenv.")

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return shlex.split(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_way(self) -> ServerConfig:
        if bool(self.command) == bool(self.url):
            raise ValueError("give either command (the hosts start the server) or url (one already running), not both "
                             "and not neither")
        if self.command and not any("{port}" in word for word in self.command):
            raise ValueError(f"command {self.command} has no {{port}}: rlray picks the port; pass it, e.g. "
                             "'python -m uvicorn server.app:app --host {host} --port {port}'")
        return self


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
    agents: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Agent name -> function: 'package.module:fn' or 'path/to/file.py:fn', an `async def fn(client, row)` "
            "written against the openai SDK (rlray.envs.agents); each episode gets a client whose base_url is its own "
            "OpenAI-compatible endpoint on the gateway. It returns the reward (a number, AgentResult or None). Names "
            "share env.column with env.environments and must differ from them."
        ),
    )
    mcp_servers: list[McpServerConfig] = Field(
        default_factory=list,
        description=(
            "MCP servers started per environment host: their tools go to agents (episode_tools()) and to "
            "ToolEnvironment environments; failures and time-outs are error observations, counted."
        ),
    )
    servers: dict[str, ServerConfig] = Field(
        default_factory=dict,
        description=(
            "Environment name -> server (rlray.envs.servers): environments that run as servers beside the run, each "
            "in its own Python environment (OpenEnv). Each environment host starts its servers (or reaches their "
            "URLs), holds one session per episode, restarts a server that dies and stops them with the run. Names "
            "share env.column with env.environments and env.agents and must differ from them."
        ),
    )
    gateway_host: str = Field(
        "127.0.0.1",
        description="Address the agent gateway (one HTTP server per environment host) binds; agents run on that host.",
    )
    agent_batching: Literal["lockstep", "window"] = Field(
        "lockstep",
        description=(
            "How an environment host gathers its agents' gateway calls into engine calls, per rollout actor. lockstep: "
            "each engine call waits until every running agent episode of that actor has asked or ended, so each call's "
            "prompts and seed follow from the episodes alone and a seeded run (and its resume) repeats its agents' "
            "samples bit for bit; an agent slow between its calls (a slow tool) holds the others, at most "
            "env.step_timeout_s. window: it also sends after a tenth of the actor's previous call (0.5 s at most), "
            "so slow agents do not hold fast ones, but the calls' make-up, and so the samples, depend on timing."
        ),
    )
    agent_threads: int = Field(
        64, ge=1,
        description=(
            "Synchronous agent episodes (a plain `def` agent, a thread each) an environment host runs at once, per "
            "batch of agent episodes; the others wait their turn, in episode order, and their time limits count from "
            "their start. The threads are split over the batch's rollout actors (at least one each) and an ended "
            "episode's thread goes to the next episode of its actor, so under lockstep which episodes share an engine "
            "call still follows from the conversations alone. Async agents are not counted (they run at once)."
        ),
    )
    column: str = Field(
        "environment", min_length=1,
        description="Row column naming the row's environment or agent (TRL's dict of factories).",
    )
    default: str | None = Field(
        None, description="Environment or agent of rows without that column; None makes such rows single-turn prompts."
    )
    max_turns: int = Field(
        8, ge=1,
        description="Assistant turns per episode (an agent's calls answered); then it ends (stop reason max_turns).",
    )
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
            "Seconds one reset or step call may take (an agent: its own work between two gateway calls); past it the "
            "episode fails (stop reason timeout). Soft without env.sandbox (the thread is abandoned, not killed), hard "
            "with it (the episode's process is killed); an async agent is cancelled."
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
        600.0, gt=0.0,
        description="Seconds one episode may run, checked between turns, or while an agent runs (stop reason "
                    "episode_timeout).",
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

    @field_validator("agents")
    @classmethod
    def _agent_specs(cls, value: dict[str, str]) -> dict[str, str]:
        for name, spec in value.items():
            if ":" not in spec:
                raise ValueError(f"env.agents.{name}={spec!r}: write 'package.module:function' or 'file.py:function'")
        return value

    @model_validator(mode="after")
    def _names(self) -> EnvConfig:
        both = sorted(set(self.agents) & set(self.environments))
        if both:
            raise ValueError(f"env.agents and env.environments both name {both}; a row's env.column must pick one")
        twice = sorted(set(self.servers) & (set(self.agents) | set(self.environments)))
        if twice:
            raise ValueError(f"env.servers and env.environments/env.agents both name {twice}; a row's env.column must "
                             "pick one")
        names = [s.name for s in self.mcp_servers]
        if len(set(names)) != len(names):
            raise ValueError(f"env.mcp_servers: names must be unique, got {names}")
        if self.mcp_servers and not self.enabled:
            raise ValueError("env.mcp_servers needs env.agents or env.environments that use the tools")
        return self

    @property
    def enabled(self) -> bool:
        """Returns True when environments, servers or agents are configured (rows may run as multi-turn episodes)."""
        return bool(self.environments or self.agents or self.servers)

    @property
    def names(self) -> list[str]:
        """Returns the environment, server and agent names a row's env.column may hold."""
        return [*self.environments, *self.servers, *self.agents]
