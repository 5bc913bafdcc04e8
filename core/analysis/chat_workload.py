"""A multi-turn chat workload, closed loop: the routers' test ground.

Conversations start at Poisson arrivals. Every prompt opens with one shared
system prompt; turn k's prompt is the whole conversation so far (earlier
prompts and the tokens the engine actually generated for them) plus a new
user message, sent a think time after the previous answer finished. A
replica that served turn k-1 therefore holds all but the new message in its
prefix cache; any other replica holds at most the system prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class ChatWorkload:
    conversations: int = 256
    rate_per_s: float = 8.0  # conversations started per second
    turns: int = 6
    system_tokens: int = 1024
    user_tokens: tuple[int, int] = (32, 384)  # each new message, uniform
    output_tokens: tuple[int, int] = (32, 256)
    think_s: tuple[float, float] = (1.0, 6.0)
    seed: int = 0


@dataclass(slots=True)
class Conversation:
    index: int
    history: list[int] = field(default_factory=list)
    turn: int = 0


class ChatSession:
    """Hands out each conversation's next prompt as the previous one finishes."""

    def __init__(self, workload: ChatWorkload, vocab: int = 32000) -> None:
        self.w = workload
        self.vocab = vocab
        self.rng = random.Random(workload.seed)
        system = random.Random(f"system-{workload.seed}")
        self.system = [system.randrange(17, vocab) for _ in range(workload.system_tokens)]

    def starts(self) -> list[tuple[float, Conversation]]:
        """When each conversation sends its first turn."""
        t, out = 0.0, []
        for i in range(self.w.conversations):
            out.append((t, Conversation(i, list(self.system))))
            t += self.rng.expovariate(self.w.rate_per_s)
        return out

    def next_prompt(self, conv: Conversation) -> tuple[str, list[int], int]:
        """(request id, prompt, max tokens) of the conversation's next turn."""
        msg = random.Random(f"user-{self.w.seed}-{conv.index}-{conv.turn}")
        conv.history += [msg.randrange(17, self.vocab) for _ in range(msg.randint(*self.w.user_tokens))]
        return f"c{conv.index}-t{conv.turn}", list(conv.history), msg.randint(*self.w.output_tokens)

    def answered(self, conv: Conversation, output: list[int]) -> float | None:
        """Record the answer; the think time before the next turn, or None when the conversation is over."""
        conv.history += output
        conv.turn += 1
        if conv.turn >= self.w.turns:
            return None
        return self.rng.uniform(*self.w.think_s)
