"""Small builders shared by the engine tests: requests, and engines on SimRunner."""

from __future__ import annotations

import os
import random

from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.analysis.sim_runner import SimRunner, VirtualClock
from stallfree.core.sched.batch import IterationRecord
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.cost import IterationCost
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.request import Request, SamplingParams


def examples(n: int) -> int:
    """A property test's example count: n, or a tenth of it under ``make test-fast``."""
    return max(10, n // 10) if os.environ.get("STALLFREE_FAST_TESTS") else n


def tokens(seed: object, n: int) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randrange(17, 32000) for _ in range(n)]


def request(
    rid: str, prompt: int | list[int], max_tokens: int = 8, arrival_ns: int = 0, priority: int = 0, **sampling
) -> Request:
    ids = prompt if isinstance(prompt, list) else tokens(rid, prompt)
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, **sampling), arrival_ns, priority)


def sim_engine(
    num_blocks: int = 256,
    block_size: int = 4,
    prefix_caching: bool = True,
    cost: IterationCost | None = None,
    vocab_size: int = 32000,
    *,
    runs: IterationCost | None = None,
    time_scale: float = 1.0,
    read_context: bool = True,
    **sched,
) -> Engine:
    """An engine on SimRunner with a virtual clock (engine.clock); by default
    the article's model and GPU, with attention. A small ``vocab_size`` makes
    its outputs repeat, so prompt lookup finds drafts (tokens 17..vocab_size-1).
    ``cost`` is what the engine predicts with; ``runs`` (default: the same) and
    ``time_scale`` what the simulated machine takes; ``read_context=False``
    samples from the last token alone (no KV read back)."""
    clock = VirtualClock()
    cost = cost or CostModel(attention=True)
    runner = SimRunner(runs or cost, block_size, clock, vocab_size, time_scale, read_context)
    sched.setdefault("max_num_seqs", 8)
    sched.setdefault("token_budget", 32)
    return Engine(
        SchedulerConfig(**sched),
        CacheConfig(num_blocks, block_size, prefix_caching),
        runner,
        clock,
        cost,
    )


def run_to_completion(engine: Engine, max_steps: int = 100_000) -> list:
    """Step until idle; returns the StepOutputs."""
    outs = []
    for _ in range(max_steps):
        if not engine.has_work:
            return outs
        out = engine.step()
        if out is not None:
            outs.append(out)
    raise AssertionError("engine did not drain")


def step_items(engine: Engine) -> tuple[list[tuple[str, int, bool]], IterationRecord | None]:
    """Run one iteration; return [(request id, tokens, is_prefill)] in batch order, and its record."""
    seen: list[tuple[str, int, bool]] = []
    real = engine.runner.execute

    def spy(batch):
        seen.extend((i.request.request_id, i.num_tokens, i.is_prefill) for i in batch.items)
        return real(batch)

    engine.runner.execute = spy
    try:
        out = engine.step()
    finally:
        engine.runner.execute = real
    return seen, out.iteration if out is not None else None
