"""rlray.algos: the RL math as pure torch functions (no Ray, vLLM or MLflow imports).

Legend: B sequences, P prompts, G samples per prompt (B = P*G), T response tokens,
L prompt+response tokens, V vocabulary.

Choose an algorithm's pieces from the plain dicts below; every function in one dict has the same signature:

    GROUP_ADVANTAGES[name](rewards [B], group_ids [B], *, valid_mask=None) -> advantages [B]
        "grpo" (group std; also takes std_scale=, eps=), "dr_grpo", "rloo"
    POLICY_LOSSES[name](logprobs, old_logprobs, advantages, response_mask, *, clip_eps_low, clip_eps_high)
        -> (per_token_loss [B, T], diagnostics {name: [B, T]})
        "ppo_clip" (also takes dual_clip=), "gspo", "cispo"
    PAIRWISE_LOSSES[name](chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta) -> [P]
        "sigmoid", "ipo" (also takes chosen_num_tokens=, rejected_num_tokens=), "robust" (label_smoothing=),
        "hinge"

Batch-level statistics (GRPO's batch std, ``whiten`` and the REINFORCE++ estimators) take ``sum_fn``
(``SumFn``: sums a 0-dim tensor over data-parallel ranks), so a sharded step whitens over the whole step.

Online advantages of a whole step (``estimators.py``): every ``Estimator`` is
``fn(AdvantageInputs, AdvantageSpec, SumFn) -> Advantages``. The algorithm registry (``registry.py``: ``Algorithm``,
``register``, ``load_algorithms``, ``get_algorithm``, ``algorithm_names``) gives each algorithm its family, estimator,
policy loss and sampling extras; nothing else compares an algorithm's name.

The rest have their own signatures: token-level estimators (``reinforce_pp_advantages``,
``reinforce_pp_baseline_advantages``, ``gae_advantages``), ``remax_advantages``, ``kl_penalty``,
``aggregate_loss``, ``value_loss``, KTO/ORPO/SimPO/Bradley-Terry, the DAPO helpers and on-policy
distillation (``reverse_kl_advantages``, ``generalized_jsd``).
"""

from rlray.algos.advantages import (
    STD_SCALES,
    SumFn,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    token_level_rewards,
    whiten,
)
from rlray.algos.aggregation import AGGREGATION_MODES, aggregate_loss, masked_mean
from rlray.algos.dapo import (
    DynamicSamplingError,
    dynamic_sampling_shortfall,
    groups_with_spread,
    overlong_penalty,
)
from rlray.algos.distillation import generalized_jsd, reverse_kl_advantages
from rlray.algos.estimators import AdvantageInputs, Advantages, AdvantageSpec, Estimator
from rlray.algos.kl import KL_ESTIMATORS, kl_penalty
from rlray.algos.policy_losses import (
    LOG_RATIO_BOUND,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_MODES,
    cispo_loss,
    entropy_bonus_loss,
    entropy_from_logits,
    gspo_loss,
    ppo_clip_loss,
    rollout_correction_weights,
)
from rlray.algos.preference import (
    bradley_terry_loss,
    dpo_hinge_loss,
    dpo_sigmoid_loss,
    ipo_loss,
    kto_kl_estimate,
    kto_loss,
    orpo_odds_ratio_loss,
    robust_dpo_loss,
    sequence_logps,
    simpo_loss,
)
from rlray.algos.registry import ALGORITHMS, Algorithm, algorithm_names, get_algorithm, load_algorithms, register
from rlray.algos.value import gae_advantages, value_loss

GROUP_ADVANTAGES = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}

PAIRWISE_LOSSES = {
    "sigmoid": dpo_sigmoid_loss,
    "ipo": ipo_loss,
    "robust": robust_dpo_loss,
    "hinge": dpo_hinge_loss,
}

__all__ = [
    "ALGORITHMS",
    "AdvantageInputs",
    "AdvantageSpec",
    "Advantages",
    "Algorithm",
    "Estimator",
    "algorithm_names",
    "get_algorithm",
    "load_algorithms",
    "register",
    "AGGREGATION_MODES",
    "GROUP_ADVANTAGES",
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "PAIRWISE_LOSSES",
    "ROLLOUT_CORRECTION_MODES",
    "POLICY_LOSSES",
    "STD_SCALES",
    "SumFn",
    "DynamicSamplingError",
    "aggregate_loss",
    "bradley_terry_loss",
    "cispo_loss",
    "dpo_hinge_loss",
    "dpo_sigmoid_loss",
    "dr_grpo_advantages",
    "dynamic_sampling_shortfall",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "gae_advantages",
    "generalized_jsd",
    "groups_with_spread",
    "grpo_advantages",
    "gspo_loss",
    "ipo_loss",
    "kl_penalty",
    "kto_kl_estimate",
    "kto_loss",
    "masked_mean",
    "orpo_odds_ratio_loss",
    "overlong_penalty",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "reverse_kl_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "robust_dpo_loss",
    "sequence_logps",
    "simpo_loss",
    "token_level_rewards",
    "rollout_correction_weights",
    "value_loss",
    "whiten",
]
