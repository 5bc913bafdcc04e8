"""Scheduler and KV-cache settings, and the one place they are checked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

CHUNKING_MODES = ("stall_free", "none", "decode_first")
POLICIES = ("fcfs", "sjf", "lpm", "priority")

# Settings the step thread may change between iterations (PUT /api/config).
LIVE_SETTINGS = ("chunking", "token_budget", "policy", "max_partial_prefills", "dynamic_chunking", "max_defer_s")


@dataclass(slots=True)
class SchedulerConfig:
    """How each iteration's batch is formed.

    chunking:
      ``stall_free``   Sarathi-Serve: decodes, then partial prefills, then new
                       prompts, all inside ``token_budget``.
      ``none``         vLLM-V0 prefill-first: waiting prompts run whole in an
                       iteration of their own while decodes wait.
      ``decode_first`` FasterTransformer-style: new prompts wait until no
                       request is decoding.
    """

    token_budget: int = 512
    max_num_seqs: int = 64
    max_partial_prefills: int = 2
    max_model_len: int = 8192
    chunking: str = "stall_free"
    policy: str = "fcfs"
    max_defer_s: float = 30.0
    dynamic_chunking: bool = False
    # KV admission reserves room for this many generated tokens (at most
    # max_tokens) beyond the prompt, so admitted prompts can start decoding
    # without preempting anybody.
    decode_reserve_tokens: int = 64

    @property
    def min_token_budget(self) -> int:
        """Every decode gets a token and prefill still gets a real share."""
        return self.max_num_seqs + max(16, self.max_num_seqs // 4)

    def validated(self) -> tuple[SchedulerConfig, list[str]]:
        """Return a checked copy (budget clamped up if too small) and warnings.

        Raises ValueError for values that cannot be repaired.
        """
        if self.chunking not in CHUNKING_MODES:
            raise ValueError(f"chunking must be one of {', '.join(CHUNKING_MODES)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        for name in ("token_budget", "max_num_seqs", "max_partial_prefills", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1")
        if not isinstance(self.decode_reserve_tokens, int) or self.decode_reserve_tokens < 0:
            raise ValueError("decode_reserve_tokens must be an integer >= 0")
        if not isinstance(self.max_defer_s, (int, float)) or not self.max_defer_s > 0:
            raise ValueError("max_defer_s must be a number > 0")
        warnings = []
        checked = dataclasses.replace(self)
        if self.token_budget < self.min_token_budget:
            warnings.append(
                f"token_budget {self.token_budget} leaves no prefill headroom over "
                f"max_num_seqs {self.max_num_seqs}; clamped to {self.min_token_budget}"
            )
            checked.token_budget = self.min_token_budget
        return checked, warnings

    def with_changes(self, changes: dict[str, Any]) -> tuple[SchedulerConfig, list[str]]:
        """Apply live changes (only LIVE_SETTINGS) and validate the result."""
        unknown = set(changes) - set(LIVE_SETTINGS)
        if unknown:
            raise ValueError(f"cannot change {', '.join(sorted(unknown))} at runtime")
        return dataclasses.replace(self, **changes).validated()


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache geometry."""

    num_blocks: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size
