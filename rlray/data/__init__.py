"""Prompt data (rows in TRL's standard or conversational format, chat templates, the training cursor), preference
pairs, and dataset fetching."""

from rlray.data.fetch import FetchError, fetch_dataset
from rlray.data.jsonl import DataError
from rlray.data.pairs import PreferencePair, load_preference_pairs, pairs_table, split_pairs
from rlray.data.prompts import PromptStream, filter_long_prompts, prepare_prompts, render_prompt
from rlray.data.rows import PromptRow, columns_json, load_prompt_rows

__all__ = [
    "DataError",
    "FetchError",
    "PreferencePair",
    "PromptRow",
    "PromptStream",
    "columns_json",
    "fetch_dataset",
    "filter_long_prompts",
    "load_preference_pairs",
    "load_prompt_rows",
    "pairs_table",
    "prepare_prompts",
    "render_prompt",
    "split_pairs",
]
