"""The article's worked example, for any model, hardware and token budget.

By default it follows the article's simplified arithmetic (attention FLOPs and
the chunk KV re-read kept out of iteration times and reported on their own
lines); ``attention``/``kv_reads`` put them in for a fuller estimate.
"""

from __future__ import annotations

from typing import Any

from stallfree.core.analysis.cost_model import CostModel
from stallfree.core.sched.chunk_rule import even_share

GIB = 2**30


def chunks(decoders: int, prompt: int, budget: int) -> list[tuple[int, int]]:
    """(prefix, tokens) of each chunk `prompt` is prefilled in next to `decoders`
    decodes: the scheduler's even shares of what the budget leaves."""
    left = budget - decoders
    if left < 1:
        raise ValueError(f"token budget {budget} leaves no room for prefill next to {decoders} decodes")
    out: list[tuple[int, int]] = []
    prefix = 0
    while prefix < prompt:
        n = even_share(prompt - prefix, left)
        out.append((prefix, n))
        prefix += n
    return out


def chunk_schedule(cost: CostModel, decoders: int, decode_context: int, prompt: int, budget: int) -> list[float]:
    """Iteration times (s) while `prompt` is prefilled in chunks next to `decoders` decodes."""
    return _times(cost, decoders, decode_context, chunks(decoders, prompt, budget))


def _times(cost: CostModel, decoders: int, decode_context: int, placed: list[tuple[int, int]]) -> list[float]:
    return [cost.iteration_s([decode_context] * decoders, [c]) for c in placed]


def budget_row(cost: CostModel, decoders: int, decode_context: int, prompt: int, budget: int) -> dict[str, Any]:
    placed = chunks(decoders, prompt, budget)
    times = _times(cost, decoders, decode_context, placed)
    return {
        "token_budget": budget,
        "chunk_tokens": max(n for _, n in placed),
        "chunk_iteration_ms": max(times) * 1e3,  # worst decode gap while it prefills
        "num_chunks": len(times),
        "ttft_chunked_ms": sum(times) * 1e3,
        "prefill_tokens_per_s": prompt / sum(times),
        "kv_reread_token_reads": sum(prefix for prefix, _ in placed),
    }


def plan(
    cost: CostModel,
    decoders: int = 64,
    prompt_tokens: int = 8192,
    budgets: tuple[int, ...] = (576,),
    burst_prompts: int = 10,
    decode_context: int = 0,
) -> dict[str, Any]:
    """All figures of the worked example; the first budget is the headline one."""
    if not budgets:
        raise ValueError("give at least one token budget")
    m, hw = cost.model, cost.hardware
    unchunked_s = cost.iteration_s([], [(0, prompt_tokens)])
    rows = [budget_row(cost, decoders, decode_context, prompt_tokens, b) for b in budgets]
    head = rows[0]
    kv_tok = m.kv_bytes_per_token
    reread_bytes = head["kv_reread_token_reads"] * kv_tok
    for row in rows:
        row["stall_reduction"] = unchunked_s * 1e3 / row["chunk_iteration_ms"]
        row["ttft_increase_pct"] = (row["ttft_chunked_ms"] / (unchunked_s * 1e3) - 1) * 100
    return {
        "model": m.name,
        "hardware": hw.name,
        "attention_in_iterations": cost.attention,
        "kv_reads_in_iterations": cost.kv_reads,
        "decoders": decoders,
        "prompt_tokens": prompt_tokens,
        "token_budget": head["token_budget"],
        "chunk_tokens": head["chunk_tokens"],
        "weight_gb": m.weight_bytes / 1e9,
        "decode_weights_ms": m.weight_bytes / hw.mem_bw * 1e3,
        "decode_compute_ms": 2.0 * m.params * decoders / hw.flops * 1e3,
        "decode_step_ms": cost.iteration_s([decode_context] * decoders, []) * 1e3,
        "prefill_unchunked_ms": unchunked_s * 1e3,
        "stall_unchunked_ms": unchunked_s * 1e3,
        "chunk_iteration_ms": head["chunk_iteration_ms"],
        "num_chunks": head["num_chunks"],
        "ttft_chunked_ms": head["ttft_chunked_ms"],
        "ttft_increase_pct": head["ttft_increase_pct"],
        "stall_reduction": head["stall_reduction"],
        "decode_tokens_during_prefill": head["num_chunks"] * decoders,
        "kv_bytes_per_token": kv_tok,
        "prompt_kv_gib": prompt_tokens * kv_tok / GIB,
        "kv_reread_token_reads": head["kv_reread_token_reads"],
        "kv_reread_gib": reread_bytes / GIB,
        "kv_reread_ms": reread_bytes / hw.mem_bw * 1e3,
        "attention_prefill_ms": m.attention_flops(0, prompt_tokens) / hw.flops * 1e3,
        "burst_prompts": burst_prompts,
        "burst_prefill_tokens_per_s": head["prefill_tokens_per_s"],
        "burst_last_ttft_s": burst_prompts * prompt_tokens / head["prefill_tokens_per_s"],
        "burst_prefill_compute_s": burst_prompts * unchunked_s,
        "budgets": rows,
    }


def format_plan(p: dict[str, Any]) -> str:
    """The plan as a readable table."""
    lines = [
        f"Prefill-decode interference: {p['model']} ({p['weight_gb']:.0f} GB weights) on {p['hardware']}",
        f"{p['decoders']} decoding users, one {p['prompt_tokens']:,}-token prompt, "
        f"token budget {p['token_budget']:,} (prefill chunk {p['chunk_tokens']:,})",
        "",
    ]
    rows = [
        ("decode step: weight read", p["decode_weights_ms"], "ms"),
        ("decode step: compute (hidden under memory)", p["decode_compute_ms"], "ms"),
        ("unchunked prefill = every decoder's stall", p["prefill_unchunked_ms"], "ms"),
        ("chunked: iteration (decodes + one chunk)", p["chunk_iteration_ms"], "ms"),
        ("chunked: number of chunks", p["num_chunks"], ""),
        ("chunked: TTFT of the long prompt", p["ttft_chunked_ms"], "ms"),
        ("  TTFT increase over unchunked", p["ttft_increase_pct"], "%"),
        ("stall reduction (unchunked / chunk iteration)", p["stall_reduction"], "x"),
        ("decode tokens produced during the prefill", p["decode_tokens_during_prefill"], ""),
        ("KV per token", p["kv_bytes_per_token"], "bytes"),
        ("KV of the whole prompt", p["prompt_kv_gib"], "GiB"),
        ("chunk KV re-read (token reads)", p["kv_reread_token_reads"], ""),
        ("chunk KV re-read", p["kv_reread_gib"], "GiB"),
        ("chunk KV re-read time", p["kv_reread_ms"], "ms"),
        ("attention FLOPs of the prompt, as time", p["attention_prefill_ms"], "ms"),
        (f"burst of {p['burst_prompts']}: prefill throughput", p["burst_prefill_tokens_per_s"], "tokens/s"),
        (f"burst of {p['burst_prompts']}: last prompt's TTFT", p["burst_last_ttft_s"], "s"),
    ]
    for label, value, unit in rows:
        text = f"{value:,}" if isinstance(value, int) else f"{value:,.1f}" if value >= 10 else f"{value:,.2f}"
        lines.append(f"  {label:<48} {text:>12} {unit}")
    if not (p["attention_in_iterations"] or p["kv_reads_in_iterations"]):
        lines.append("  (article arithmetic: attention and KV re-reads not in iteration times; --attention/--kv-reads)")
    if len(p["budgets"]) > 1:
        lines += ["", "  budget  chunk  iteration ms  chunks   TTFT ms  stall reduction"]
        for r in p["budgets"]:
            lines.append(
                f"  {r['token_budget']:>6}  {r['chunk_tokens']:>5}  {r['chunk_iteration_ms']:>12.1f}"
                f"  {r['num_chunks']:>6}  {r['ttft_chunked_ms']:>8.1f}  {r['stall_reduction']:>14.1f}x"
            )
    return "\n".join(lines)
