"""An algorithm of your own, outside rlray/ (docs/adding_an_algorithm.md): "sign_grpo", whose advantage is the sign of
the group-centred reward (+1 above the group's mean, -1 below, 0 at it) on every response token, with PPO's clipped
loss. A run names it in the config: ``algo.name: sign_grpo`` and ``algo.user_algorithms:
["docs/examples/sign_grpo.py:SIGN_GRPO"]``; tests/run/test_registered_algorithm.py trains it (one step in-process,
one on Ray workers).
"""

import torch

from rlray import algos
from rlray.algos import AdvantageInputs, Advantages, AdvantageSpec, Algorithm, estimators


def sign_grpo(inputs: AdvantageInputs, spec: AdvantageSpec, sum_fn: algos.SumFn) -> Advantages:
    """Returns sign(r - mean of the group's valid rewards) on every valid token (an ``algos.Estimator``)."""
    rewards, valid, mask = estimators.sequence_inputs(inputs, spec)
    centred = algos.dr_grpo_advantages(rewards, inputs.group_id, valid_mask=valid)
    return estimators.broadcast(torch.sign(centred), mask)


SIGN_GRPO = Algorithm("sign_grpo", "online", advantage=sign_grpo, policy_loss="ppo_clip", needs_groups=True)
