"""Appending what an iteration drew to a request: its tokens, its timeline, and
why it ends (a stop token, its length, the model's context)."""

from __future__ import annotations

from stallfree.core.sched.batch import Logprobs, NewToken
from stallfree.core.sched.request import FinishReason, Request


def append(
    req: Request,
    new: list[int],
    logprobs: list[Logprobs] | None,
    stalled: bool,
    now_ns: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> tuple[list[NewToken], FinishReason | None]:
    """Append what req drew, up to its end (what it drew after that is dropped):
    the tokens, all but the last kept drafts, and why it ended (None: it goes on).
    ``stalled`` is the first token's."""
    out = []
    for i, token in enumerate(new):
        first = stalled and i == 0
        req.output_token_ids.append(token)
        tl = req.timeline
        if tl.first_token_ns is None:
            tl.first_token_ns = now_ns
        else:
            tl.stalled.append(first)
        tl.token_ns.append(now_ns)
        lp = logprobs[i] if logprobs is not None else None
        out.append(NewToken(req, token, first, lp, draft=i < len(new) - 1))
        reason = end_reason(req, token, eos_token_ids, max_model_len)
        if reason is not None:
            return out, reason
    return out, None


def end_reason(req: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """Does req end with ``token``, its latest one?"""
    sp = req.sampling
    if token in sp.stop_token_ids or (token in eos_token_ids and not sp.ignore_eos):
        return FinishReason.STOP
    if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
