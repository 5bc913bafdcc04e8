"""Per-request streams: bounded queue, coalescing overflow, slow-consumer cut-off."""

import time

import anyio

from core.sched.request import FinishReason
from gateway.streams import RequestStream


async def test_overflow_coalesces_into_one_delta_in_order():
    s = RequestStream("r", capacity=2, slow_consumer_s=60)
    for i in range(6):
        assert s.put([i], emit_ns=i, finish_reason=None, request=None)
    assert s.put([6], emit_ns=6, finish_reason="length", request=None)
    got = [await s.get() for _ in range(3)]
    assert [d.token_ids for d in got] == [[0], [1], [2, 3, 4, 5, 6]]
    assert [d.first_index for d in got] == [0, 1, 2]
    assert got[-1].finish_reason == "length" and got[-1].emit_ns == 6


async def test_consumer_waiting_gets_tokens_as_they_come():
    s = RequestStream("r", capacity=4, slow_consumer_s=60)
    results = []

    async def consume():
        while True:
            d = await s.get()
            results.append(d.token_ids)
            if d.finish_reason:
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for i in range(10):
            await anyio.sleep(0)
            s.put([i], i, "stop" if i == 9 else None, None)
    assert [t for r in results for t in r] == list(range(10))


async def test_hopelessly_behind_is_reported_then_failed():
    s = RequestStream("r", capacity=1, slow_consumer_s=0.05)
    assert s.put([0], 0, None, None)
    assert s.put([1], 1, None, None)  # starts the overflow clock
    assert s.put([2], 2, None, None)
    time.sleep(0.06)
    assert not s.put([3], 3, None, None)  # unread for longer than slow_consumer_s
    s.fail(FinishReason.SLOW_CONSUMER)
    assert (await s.get()).token_ids == [0]
    last = await s.get()
    assert last.finish_reason == FinishReason.SLOW_CONSUMER and last.token_ids == []
    assert s.put([4], 4, None, None)  # ignored once finished


async def test_fail_wakes_a_waiting_consumer():
    s = RequestStream("r", capacity=4, slow_consumer_s=60)
    async with anyio.create_task_group() as tg:
        got = []

        async def consume():
            got.append(await s.get())

        tg.start_soon(consume)
        await anyio.sleep(0.01)
        s.fail(FinishReason.ABORT)
    assert got[0].finish_reason == FinishReason.ABORT
