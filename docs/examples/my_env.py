"""A user's environment: how many letters does a word have? The model may call `spell` to see them."""

from rlray.envs import AssistantTurn, EnvReset, ToolEnvironment


class WordLengthEnv(ToolEnvironment):
    """One question per row (column `word`); reward 1.0 when the final answer is the word's length."""

    def reset(self, *, word: str, **row) -> EnvReset:
        self.word = word
        question = f"How many letters does the word '{word}' have? Answer with the number only."
        return self.begin([{"role": "user", "content": question}], tools=[self.spell])

    def spell(self, word: str) -> str:
        """Spells a word letter by letter.

        Args:
            word: The word to spell.
        """
        return " ".join(word)

    def final_reward(self, turn: AssistantTurn) -> float:
        digits = "".join(ch for ch in turn.text if ch.isdigit())
        return 1.0 if digits == str(len(self.word)) else 0.0

