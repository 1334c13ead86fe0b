"""A generated multi-turn workload with shared prefixes.

Like SGLang's generated-shared-prefix benchmark: ``groups`` groups of conversations share a
system prompt; each of a group's ``conversations`` adds, turn after turn, a question and the
answer the model gave (synthetic tokens here: the benchmark measures prefill, i.e. time to first
token). Requests are issued turn by turn across all conversations, so the working set grows
past the smaller tiers the way a busy server's does.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    groups: int = 4
    conversations: int = 4
    turns: int = 4
    system_tokens: int = 1024
    question_tokens: int = 64
    answer_tokens: int = 64
    vocab_size: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("groups", "conversations", "turns", "system_tokens", "question_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        if self.answer_tokens < 0:
            raise ValueError("answer_tokens: must not be negative")

    @property
    def max_prompt_tokens(self) -> int:
        return self.system_tokens + self.turns * (self.question_tokens + self.answer_tokens)

    @property
    def working_set_tokens(self) -> int:
        """Distinct tokens (and so KV) the whole workload touches."""
        per_conversation = self.turns * (self.question_tokens + self.answer_tokens)
        return self.groups * (self.system_tokens + self.conversations * per_conversation)


@dataclass(frozen=True)
class TurnRequest:
    """One request: the prompt (history + new question) and the answer that follows it."""

    conversation: int
    turn: int
    prompt: list[int]
    answer: list[int]


def generate(spec: WorkloadSpec) -> Iterator[TurnRequest]:
    """The requests in issue order (turn-major); deterministic for a given ``spec.seed``."""
    rng = random.Random(spec.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(spec.vocab_size) for _ in range(n)]

    histories: list[list[int]] = []
    for _group in range(spec.groups):
        system = tokens(spec.system_tokens)
        histories.extend(list(system) for _ in range(spec.conversations))
    for turn in range(spec.turns):
        for conversation, history in enumerate(histories):
            question = tokens(spec.question_tokens)
            answer = tokens(spec.answer_tokens)
            prompt = history + question
            yield TurnRequest(conversation, turn, prompt, answer)
            history.extend(question)
            history.extend(answer)
