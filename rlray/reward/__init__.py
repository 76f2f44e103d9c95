"""Rewards: rule-based GSM8K grading (math-verify correctness plus a '#### <number>' format term) and user functions."""

from rlray.reward.gsm8k import extract_final_answer, grade_gsm8k, gsm8k_reward
from rlray.reward.scorer import RewardFunctionError, RewardScorer, load_reward_function

__all__ = [
    "RewardFunctionError",
    "RewardScorer",
    "extract_final_answer",
    "grade_gsm8k",
    "gsm8k_reward",
    "load_reward_function",
]
