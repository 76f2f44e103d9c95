"""Run classes written for TRL 1.16's ``GRPOTrainer(environment_factory=...)`` unchanged, and load environments.

TRL's environment shape (read from ``trl/trainer/grpo_trainer.py``, version 1.16.0):
- ``reset(**row)`` gets every column of the dataset row (``prompt`` included) and returns None or a string; a
  string is appended to the content of the prompt's *last* message (``prompt[-1]``) by plain concatenation, no
  separator (``content + observation``); a list of content parts is appended as parts.
- the tools are the class's public functions (``inspect.getmembers(type(env), inspect.isfunction)``, names not
  starting with ``_``), minus ``reset`` and ``get_reward``, bound to the instance;
- the rollout goes on while a turn calls tools and ends on the first turn without a tool call;
- an optional ``get_reward()`` (sync or async) scores the finished rollout from the instance's state.

``TRLEnvironment`` wraps one such instance in rlray's contract: ``reset`` builds the prompt, ``step`` answers tool
calls and ends the episode on a turn without calls, with ``get_reward()`` (or None). By default
(``trl_parity=True``, config ``env.trl_parity``) the model and the instance see what TRL's ``_tool_call_loop``
gives them (lines 1957-2189 of grpo_trainer.py): tool results as ``str(result)`` (a list as content parts), a
failing or unknown call as ``str({"error": str(e)})`` (``tools.trl_tool_results``); a turn with a call that
cannot be parsed is plain text to TRL (``parse_response`` falls back to decoding it), so it ends the episode; and
the calls of the last turn (``AssistantTurn.last``: turn ``env.max_turns``, TRL's ``max_tool_calling_iterations
+ 1``) are not run, ``get_reward()`` then scores the episode as it stands. With ``trl_parity=False`` rlray's
wording is used (``tools.call_tool``: JSON for dicts and lists, ``Error: ...``), unparsable calls are answered
with an error observation, and the last turn's calls run. One difference remains: one instance per episode (TRL
pools and re-resets instances).

``load_environment`` resolves ``"package.module:Class"`` or ``"path/to/file.py:Class"`` to a factory, wrapping
TRL-shaped classes (``is_trl_environment``) once, when the class is loaded (STYLE.md, anti-pattern 4). Its spec
loader, ``load_object``, also loads the config's step hooks (``run.hooks``, ``rlray.run.hooks``). A file loads with
its own folder first on ``sys.path``, so it may import the modules beside it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlray.envs.base import AssistantTurn, Environment, EnvReset, EnvStep, Message
from rlray.envs.toolenv import tool_step
from rlray.envs.tools import resolve_awaitable, trl_tool_results

_NOT_TOOLS = ("reset", "get_reward")
USER_MODULE_PREFIX = "rlray_user_"  # name prefix of the modules ``load_object`` loads from files


@functools.cache
def trl_tool_names(cls: type) -> tuple[str, ...]:
    """Returns the names of a TRL environment class's tools: its public functions except reset and get_reward (sorted,
    as ``inspect.getmembers`` lists them; TRL's rule)."""
    return tuple(
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in _NOT_TOOLS
    )


def _reset_returns_env_reset(cls: type) -> bool | None:
    """Returns True when ``cls.reset`` is annotated to return EnvReset, False when annotated to return something else
    (str, None), None when it has no return annotation. String annotations are read as written."""
    annotation = inspect.signature(cls.reset).return_annotation
    if annotation is inspect.Signature.empty:
        return None
    if isinstance(annotation, str):
        return annotation.split(".")[-1] == "EnvReset"
    return annotation is EnvReset


def is_trl_environment(obj_or_class: Any) -> bool:
    """Returns whether a class (or an instance's class) is written for TRL's ``environment_factory``.

    The rule, applied once when the class is loaded: it needs a callable ``reset``; a ``reset`` annotated to
    return ``EnvReset`` means rlray's contract (False); annotated to return anything else (``str | None``) means
    TRL (True); unannotated, a class without a ``step`` function is TRL's and one with ``step`` is rlray's. (A TRL
    class may have a tool named ``step``; annotate its ``reset`` with ``-> str | None`` to be unambiguous.)
    """
    cls = obj_or_class if isinstance(obj_or_class, type) else type(obj_or_class)
    if not callable(getattr(cls, "reset", None)):
        return False
    returns_env_reset = _reset_returns_env_reset(cls)
    if returns_env_reset is not None:
        return not returns_env_reset
    return not callable(getattr(cls, "step", None))


def _append_to_content(content: Any, observation: Any) -> Any:
    """Returns ``content + observation`` as TRL builds it: str + str; a str next to a list of parts becomes a
    ``{"type": "text"}`` part first."""
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return content + observation


class TRLEnvironment:
    """rlray's environment contract over one instance of a TRL ``environment_factory`` class (module docstring).

    Args:
        instance: the TRL-shaped instance.
        trl_parity: answer tool calls as TRL 1.16 does (its wording, unparsable calls end the episode, the last
            turn's calls are not run); False: rlray's wording (``env.trl_parity``).

    Raises:
        TypeError: the instance has no callable ``reset``.
    """

    def __init__(self, instance: Any, trl_parity: bool = True) -> None:
        if not callable(getattr(instance, "reset", None)):
            raise TypeError(f"{type(instance).__name__} has no callable reset(); TRL environments need one")
        self.instance = instance
        self.trl_parity = trl_parity
        self.tools = [getattr(instance, name) for name in trl_tool_names(type(instance))]
        self.tools_by_name = {tool.__name__: tool for tool in self.tools}

    def reset(self, **row: Any) -> EnvReset:
        """Returns the opening conversation: ``row["prompt"]`` (a str becomes one user message; a list of messages is
        copied; missing means one empty user message, as TRL), with the string ``instance.reset(**row)`` returns
        appended to the last message's content as TRL does; the tools are the instance's public methods."""
        prompt = row.get("prompt", [{"role": "user", "content": ""}])
        messages: list[Message] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        observation = self.instance.reset(**row)
        if observation is not None:
            messages[-1] = {**messages[-1], "content": _append_to_content(messages[-1]["content"], observation)}
        return EnvReset(prompt=messages, tools=list(self.tools))

    def step(self, turn: AssistantTurn) -> EnvStep:
        """Returns the tool observations for a turn with tool calls; for a turn without, the end of the episode with
        the reward ``instance.get_reward()`` (awaited when async; None when the class has no ``get_reward``). With
        ``trl_parity`` a turn with an unparsable call also ends the episode, and the last turn's calls are not run
        (module docstring)."""
        if not self.trl_parity:
            result = tool_step(self.tools_by_name, turn)
            if result is not None:
                return result
            return EnvStep(reward=self.final_reward(), done=True, tool_calls=0, tool_errors=0)
        attempted, unparsable = len(turn.tool_calls) + len(turn.tool_call_errors), len(turn.tool_call_errors)
        if not turn.tool_calls or unparsable:  # TRL: no tool call, or text that parse_response cannot read as calls
            return EnvStep(reward=self.final_reward(), done=True, tool_calls=attempted, tool_errors=unparsable)
        if turn.last:  # TRL's loop stops at max_tool_calling_iterations without running this turn's calls
            return EnvStep(tool_calls=0, tool_errors=0)
        results, failures = trl_tool_results(self.tools_by_name, turn.tool_calls)
        observations: list[Message] = [{"role": "tool", "name": name, "content": content} for name, content in results]
        return EnvStep(observations=observations, tool_calls=attempted, tool_errors=failures)

    def final_reward(self) -> float | None:
        """Returns ``instance.get_reward()`` as a float (awaited when async), None when the class has no
        ``get_reward``; whatever it raises propagates (the episode fails)."""
        get_reward = getattr(self.instance, "get_reward", None)
        reward = None if get_reward is None else resolve_awaitable(get_reward())
        return None if reward is None else float(reward)

    def reward_at_limit(self) -> float | None:
        """Returns ``instance.get_reward()`` for an episode a limit ended (max turns, tokens) before a turn without a
        tool call; TRL scores every episode with get_reward at its end. None without ``get_reward``."""
        return self.final_reward()


def _where(err: BaseException) -> str:
    """Returns ' (at file:line)' of the innermost frame of ``err``'s traceback outside importlib (the user's code), or
    of a SyntaxError's own position; '' when there is none."""
    if isinstance(err, SyntaxError) and err.filename:
        return f" (at {err.filename}:{err.lineno})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _import_file(path_text: str, label: str, shape: str) -> Any:
    """Returns the module loaded from the Python file ``path_text`` (relative to the current folder), registered in
    ``sys.modules`` under a name derived from its resolved path, so loading it twice gives the same module. The file's
    folder is first on ``sys.path`` while it loads (its imports of modules beside it work from any folder).

    Raises:
        ValueError: not a .py file, no such file, or running the file raised (names ``label``, the error and where).
    """
    path = Path(path_text).expanduser().resolve()
    if path.suffix != ".py":
        raise ValueError(f"{label}: {path_text!r} is not a .py file; use 'path/to/file.py:{shape}'")
    if not path.is_file():
        raise ValueError(f"{label}: file {path_text!r} not found (relative paths start at {Path.cwd()})")
    name = f"{USER_MODULE_PREFIX}{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - any error of user code at import becomes one message naming the spec
        del sys.modules[name]
        raise ValueError(f"{label}: importing {path} raised {type(err).__name__}: {err}{_where(err)}") from err
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    return module


def _import_module(module_part: str, label: str) -> Any:
    """Returns the imported module ``module_part``.

    Raises:
        ValueError: the module cannot be found, or importing it raised (names ``label``, the error and where).
    """
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_part == err.name or module_part.startswith(err.name + ".")):
            raise ValueError(f"{label}: cannot import module {module_part!r}: {err}") from err
        raise ValueError(f"{label}: importing {module_part!r} raised ModuleNotFoundError: {err}{_where(err)}") from err
    except Exception as err:  # noqa: BLE001 - any error of user code at import becomes one message naming the spec
        raise ValueError(f"{label}: importing {module_part!r} raised {type(err).__name__}: {err}{_where(err)}") from err


def load_object(spec: str, *, label: str, shape: str) -> Any:
    """Returns the object a ``"package.module:name"`` or ``"path/to/file.py:name"`` spec names.

    The one loader of user code named in the config: environments (``load_environment_class``), agents
    (``rlray.envs.agents.load_agent``) and step hooks (``rlray.run.hooks.load_step_hooks``). A module is imported;
    a file (relative to the current folder) is loaded once per resolved path, as the module
    ``rlray_user_<stem>_<hash>`` (``USER_MODULE_PREFIX``), with its own folder first on ``sys.path`` while it loads.

    Args:
        spec: the spec.
        label: how errors name it, e.g. ``"environment 'm:C'"`` or ``"run.hooks[0]='m:f'"``.
        shape: the name's placeholder in the usage hints, e.g. ``"ClassName"`` or ``"factory"``.

    Raises:
        ValueError: the spec has no ``:name`` part, the file or module is missing or raises when imported (with the
            user code's file:line), or the module has no such name (listing its classes); each message starts with
            ``label``.
    """
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise ValueError(f"{label}: use 'package.module:{shape}' or 'path/to/file.py:{shape}'")
    if module_part.endswith(".py") or "/" in module_part:
        module = _import_file(module_part, label, shape)
    else:
        module = _import_module(module_part, label)
    if not hasattr(module, name):
        classes = sorted(k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise ValueError(f"{label}: {name!r} is not defined in {module_part!r} (its classes: {', '.join(classes) or 'none'})")
    return getattr(module, name)


def load_environment_class(spec: str) -> type:
    """Returns the class named by ``spec`` (``"package.module:ClassName"`` or ``"path/to/file.py:ClassName"``), as is.

    Raises:
        ValueError: as ``load_object``, or the name is not a class, or it has no callable ``reset``; each message
            names the spec.
    """
    label = f"environment {spec!r}"
    cls = load_object(spec, label=label, shape="ClassName")
    module_part, _, class_name = spec.rpartition(":")
    if not isinstance(cls, type):
        raise ValueError(f"{label}: {class_name!r} is not a class in {module_part!r}")
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"{label}: class {class_name} has no reset method; an environment needs reset(**row)")
    return cls


def load_environment(spec: str, trl_parity: bool = True) -> Callable[[], Environment]:
    """Returns a factory building one environment per call (one per episode) from ``spec``.

    Args:
        spec: ``"package.module:ClassName"`` (imported) or ``"path/to/file.py:ClassName"`` (a file, relative to
            the current folder; ``load_object``). A TRL-shaped class (``is_trl_environment``) is wrapped in
            ``TRLEnvironment``.
        trl_parity: how the wrapped TRL class's tool calls are answered (``TRLEnvironment``, ``env.trl_parity``).

    Raises:
        ValueError: as ``load_environment_class``.
    """
    cls = load_environment_class(spec)
    if is_trl_environment(cls):
        return functools.partial(_build_trl, cls, trl_parity)
    return cls


def _build_trl(cls: type, trl_parity: bool = True) -> TRLEnvironment:
    """Returns a new instance of the TRL-shaped ``cls`` wrapped in ``TRLEnvironment``."""
    return TRLEnvironment(cls(), trl_parity)
