"""The algorithm registry: one ``Algorithm`` entry per algorithm, the only place that tells algorithms apart by name.

Everything rlray reads about an algorithm is an attribute of its entry: the config's validation (the name, the
family, whether it needs groups), the build step (the estimator and the policy loss of the update, the critic),
the rank-0 sampling extras (DAPO's dynamic sampling, ReMax's greedy baseline) and the offline run (the pair
objective, the cached reference logprobs, KTO's reference point, a reward head). Nothing outside this module
compares an algorithm's name.

The built-in entries are registered below in the order ``rlray config --describe`` lists them. A user (or a test)
adds one with ``register``, which takes effect in the calling process only. For a run, the config names the entry
instead (``algo.user_algorithms``: ``"package.module:NAME"`` or ``"path/to/file.py:NAME"``), and every process that
validates the config (the driver, each Ray Train worker, a sweep's trials) loads it with ``load_algorithms`` before
it resolves ``algo.name``, as step hooks (``run.hooks``) are named in the config and loaded where they run. See
docs/adding_an_algorithm.md for the other places an algorithm touches.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlray.algos import estimators
from rlray.algos.estimators import Estimator
from rlray.algos.policy_losses import POLICY_LOSSES

Family = Literal["online", "offline"]


@dataclass(frozen=True)
class Algorithm:
    """One algorithm: its family and the pieces the run composes for it.

    Attributes:
        name: the value of ``algo.name`` (configs/algos/<name>.yaml holds its recommended settings).
        family: "online" (rollouts, rewards, advantages) or "offline" (preference pairs).
        advantage: online: the estimator of stage 5 (``estimators.Estimator``).
        policy_loss: online: a key of ``algos.POLICY_LOSSES`` ("ppo_clip", "gspo", "cispo").
        needs_groups: online: the advantage is a statistic of each prompt's group (rollout.samples_per_prompt >= 2).
        dynamic_sampling: online: DAPO's dynamic sampling on rank 0 (keep groups whose reward varies, refill).
        greedy_baseline: online: ReMax's greedy baseline on rank 0 (one temperature-0 completion per prompt, scored).
        needs_critic: online: PPO's critic (values at rollout time in stage 4, a value-loss update in stage 6).
        pair_objective: offline: a key of ``rlray.learner.preference.PAIR_OBJECTIVES``.
        reference_logps: offline: cache the initial policy's sequence logprobs per pair before step 1.
        kl_reference_point: offline: KTO's reference point z_ref over mismatched pairs (also cached for the reference).
        reward_head: offline: the trained model is a one-label sequence classifier scoring whole sequences.
    """

    name: str
    family: Family
    advantage: Estimator | None = None
    policy_loss: str | None = None
    needs_groups: bool = False
    dynamic_sampling: bool = False
    greedy_baseline: bool = False
    needs_critic: bool = False
    pair_objective: str | None = None
    reference_logps: bool = False
    kl_reference_point: bool = False
    reward_head: bool = False


ALGORITHMS: dict[str, Algorithm] = {}
"""Every registered algorithm by name, in registration order (the built-ins first)."""


def _check(algo: Algorithm) -> None:
    """Raises ValueError when ``algo`` is not a consistent entry (the message names the field and the fix)."""
    where = f"algorithm {algo.name!r}"
    if not algo.name.isidentifier():
        raise ValueError(f"{where}: the name must be a Python identifier (letters, digits, underscores)")
    if algo.name in ALGORITHMS:
        raise ValueError(f"{where} is already registered; pick another name")
    online = (algo.advantage, algo.policy_loss, algo.needs_groups, algo.dynamic_sampling, algo.greedy_baseline,
              algo.needs_critic)
    offline = (algo.pair_objective, algo.reference_logps, algo.kl_reference_point, algo.reward_head)
    if algo.family == "online":
        if not callable(algo.advantage):
            raise ValueError(f"{where}: an online algorithm needs advantage=<an estimators.Estimator function>")
        if algo.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"{where}: policy_loss={algo.policy_loss!r} is not one of {sorted(POLICY_LOSSES)}")
        if any(offline):
            raise ValueError(f"{where}: pair_objective, reference_logps, kl_reference_point and reward_head are offline")
    elif algo.family == "offline":
        if not algo.pair_objective:
            raise ValueError(f"{where}: an offline algorithm needs pair_objective=<a PAIR_OBJECTIVES key>")
        if any(online):
            raise ValueError(f"{where}: advantage, policy_loss, needs_groups and the sampling extras are online")
    else:
        raise ValueError(f"{where}: family={algo.family!r} must be 'online' or 'offline'")


def register(algo: Algorithm) -> Algorithm:
    """Returns ``algo`` after adding it to ``ALGORITHMS``, where the config, the build step and the run find it.

    Raises:
        ValueError: the name is taken or not an identifier, or the entry mixes online and offline pieces, lacks
            its family's required ones, or names an unknown policy loss.
    """
    _check(algo)
    ALGORITHMS[algo.name] = algo
    return algo


def get_algorithm(name: str) -> Algorithm:
    """Returns the registered algorithm ``name``.

    Raises:
        KeyError: ``name`` is not registered (the message lists the names that are).
    """
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"algorithm {name!r} is not registered; registered: {', '.join(ALGORITHMS)}") from None


def algorithm_names(family: Family | None = None) -> tuple[str, ...]:
    """Returns the registered names in registration order, only those of ``family`` when given."""
    return tuple(n for n, a in ALGORITHMS.items() if family is None or a.family == family)


USER_MODULE_PREFIX = "rlray_user_"  # the module name rlray.envs.trl's loader gives a file too: one module per file


def _import_file(path: Path) -> object:
    """Returns the module run from the Python file ``path`` (absolute), loaded once per path as
    ``rlray_user_<stem>_<hash>`` (the name ``rlray.envs.trl.load_object`` gives it), its folder first on sys.path."""
    name = f"{USER_MODULE_PREFIX}{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    added = str(path.parent) not in sys.path
    if added:
        sys.path.insert(0, str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if added and str(path.parent) in sys.path:
            sys.path.remove(str(path.parent))
    return module


def load_algorithms(specs: Sequence[str]) -> list[Algorithm]:
    """Returns the entries ``specs`` name, each registered (``register``) unless this very entry already is.

    Each spec is ``"package.module:NAME"`` (imported) or ``"path/to/file.py:NAME"`` (relative to the current folder,
    or absolute), where ``NAME`` is an ``Algorithm``. Loading again is a no-op: a module is imported once and a file
    run once per resolved path, and an entry that its module registered itself at import counts as registered.
    This is how ``algo.user_algorithms`` reaches every process that validates the config.

    Raises:
        ValueError: a spec has no ``:NAME``, its module or file is missing or raised at import, ``NAME`` is missing
            or not an ``Algorithm``, or ``register`` refused the entry (for example a name another entry holds); the
            message names the spec.
    """
    out = []
    for spec in specs:
        target, sep, name = spec.rpartition(":")
        if not sep or not target or not name:
            raise ValueError(f"{spec!r}: write 'package.module:NAME' or 'path/to/file.py:NAME' (NAME an Algorithm)")
        try:
            if target.endswith(".py") or "/" in target:
                path = Path(target).expanduser().resolve()
                if not path.is_file():
                    raise ValueError(f"file not found (relative paths start at {Path.cwd()})")
                module = _import_file(path)
            else:
                module = importlib.import_module(target)
        except Exception as err:  # noqa: BLE001 - any error of user code at import becomes one message naming the spec
            raise ValueError(f"{spec!r}: cannot load {target!r}: {type(err).__name__}: {err}") from err
        algo = getattr(module, name, None)
        if not isinstance(algo, Algorithm):
            raise ValueError(f"{spec!r}: {name!r} in {target!r} is {type(algo).__name__}, not an rlray.algos.Algorithm")
        if ALGORITHMS.get(algo.name) is not algo:
            try:
                register(algo)
            except ValueError as err:
                raise ValueError(f"{spec!r}: {err}") from err
        out.append(algo)
    return out


def _online(name: str, advantage: Estimator, policy_loss: str = "ppo_clip", **extras: bool) -> Algorithm:
    return register(Algorithm(name, "online", advantage=advantage, policy_loss=policy_loss, **extras))


def _offline(name: str, **extras: bool) -> Algorithm:
    return register(Algorithm(name, "offline", pair_objective=name, **extras))


_online("grpo", estimators.grpo, needs_groups=True)
_online("dr_grpo", estimators.dr_grpo, needs_groups=True)
_online("dapo", estimators.grpo, needs_groups=True, dynamic_sampling=True)
_online("gspo", estimators.grpo, "gspo", needs_groups=True)
_online("cispo", estimators.grpo, "cispo", needs_groups=True)
_online("rloo", estimators.rloo, needs_groups=True)
_online("reinforce_pp", estimators.reinforce_pp)
_online("reinforce_pp_baseline", estimators.reinforce_pp_baseline, needs_groups=True)
_online("remax", estimators.remax, greedy_baseline=True)
_online("ppo", estimators.ppo, needs_critic=True)
_offline("dpo", reference_logps=True)
_offline("ipo", reference_logps=True)
_offline("kto", reference_logps=True, kl_reference_point=True)
_offline("orpo")
_offline("simpo")
_offline("reward_model", reward_head=True)
_offline("sft")
