"""A load run's decode rate: tokens per second while every stream decodes,
apart from the run's throughput, which holds the prompts' prefill too."""

from __future__ import annotations

from stallfree.loadtest.clients import Result
from stallfree.loadtest.stats import outlived, summarize
from stallfree.loadtest.workloads import Arrival


def stream(first_s: float, tokens: int, gap_s: float, group: str = "") -> Result:
    """A request sent at 0 whose ``tokens`` came from ``first_s`` on, ``gap_s`` apart."""
    return Result(Arrival(0.0, "p", tokens, group), 0.0, [first_s + i * gap_s for i in range(tokens)])


def test_the_decode_rate_counts_only_the_time_every_stream_decodes():
    # four streams whose first tokens come 0.1 s apart (their prompts prefilled one after
    # another), then one token each every 40 ms: 100 tokens/s while all four decode
    streams = [stream(0.5 + 0.1 * i, 50, 0.04) for i in range(4)]
    s = summarize(streams)
    assert abs(s["decode_tokens_per_s"] - 100.0) < 3.0
    assert s["throughput_tokens_per_s"] < 80.0  # the 0.5 s before any token and the ends one by one


def test_no_decode_rate_where_one_stream_ended_before_another_began():
    s = summarize([stream(0.0, 10, 0.01), stream(1.0, 10, 0.01)])
    assert s["decode_tokens_per_s"] == 0.0
    assert s["throughput_tokens_per_s"] > 0.0


def test_decoders_outlive_a_prefill_only_with_a_token_after_its_first():
    long = stream(3.0, 8, 0.02, "long")  # its prefill ends with its first token at 3 s
    through = [stream(0.2, 200, 0.015, "decoder") for _ in range(3)]  # to 3.185 s
    assert outlived([*through, long])
    # one stream's last token came in the prefill's last iteration, with the first token:
    # the gap after that chunk was never measured on it
    with_it = Result(Arrival(0.0, "p", 3, "decoder"), 0.0, [2.5, 2.75, 3.0])
    assert not outlived([*through, with_it, long])
    assert not outlived([*through, stream(0.2, 100, 0.015, "decoder"), long])  # ended mid-prefill
    assert not outlived(through)  # no long prompt answered: nothing to outlive
