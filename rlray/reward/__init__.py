"""Rewards: rule-based GSM8K grading (math-verify correctness plus a '#### <number>' format term)."""

from rlray.reward.gsm8k import extract_final_answer, grade_gsm8k, gsm8k_reward

__all__ = ["extract_final_answer", "grade_gsm8k", "gsm8k_reward"]
