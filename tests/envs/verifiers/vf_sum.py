"""A verifiers (0.4, `verifiers.v1`) environment written with verifiers' own API, for rlray's tests.

Single turn: "What is a + b? Answer with the number in <answer></answer> tags." Two reward functions (the rubric):
`correct` (weight 1.0: 1.0 when the tagged answer equals a + b, else 0.0) and `formatted` (weight 0.5: 1.0 when
the last reply holds exactly one `<answer>...</answer>` pair). The episode's reward is verifiers' `Trace.reward`,
the weighted sum. It runs inside the `.venvs/verifiers` Python environment only (rlray's own cannot import
verifiers); rlray reaches it through `rlray/envs/servers/verifiers_bridge.py`. Loaded by taskset id `vf_sum`
with this folder on `sys.path`.
"""

import re

import verifiers.v1 as vf

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class SumData(vf.TaskData):
    """One row: the two addends (the prompt is built from them by the taskset)."""

    a: int
    b: int


def last_reply(trace: vf.Trace) -> str:
    """The text of the trace's last assistant message ('' when the model never answered)."""
    for message in reversed(trace.messages):
        if message.role == "assistant" and isinstance(message.content, str):
            return message.content
    return ""


class SumTask(vf.Task[SumData]):
    """Scores one rollout with the two rubric functions."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = ANSWER.findall(last_reply(trace))
        return 1.0 if found and int(found[-1]) == self.data.a + self.data.b else 0.0

    @vf.reward(weight=0.5)
    async def formatted(self, trace: vf.Trace) -> float:
        return 1.0 if len(ANSWER.findall(last_reply(trace))) == 1 else 0.0


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 8
    """How many tasks `load()` builds (a + b for a, b in 1..num_tasks)."""


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [
            SumTask(
                SumData(a=i + 1, b=2 * i + 3, prompt=f"What is {i + 1} + {2 * i + 3}? Answer in <answer></answer> tags."),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


__all__ = ["SumTaskset"]
