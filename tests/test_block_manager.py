"""Paged KV blocks: prefix hits, sharing, eviction order, reservations, conservation."""

import pytest

from stallfree.core.sched.block_manager import Admitted, BlockManager, Grown
from tests.simkit import request


def admitted(bm: BlockManager, req, reserve: int | None = None):
    found = bm.admit(req, req.num_tokens if reserve is None else reserve)
    assert found is not None
    req.num_computed_tokens = found.computed_tokens  # what the scheduler records
    return req


def compute_all(bm: BlockManager, req) -> None:
    """Pretend the whole request ran: allocate and register its blocks."""
    assert bm.allocate(req, req.num_pending_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_computed(req)


def test_prefix_hit_reuses_full_blocks_only():
    bm = BlockManager(num_blocks=16, block_size=4)
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = admitted(bm, request("a", [*shared, 1, 2]))
    compute_all(bm, a)
    b = admitted(bm, request("b", [*shared, 7, 8, 9]))
    assert b.num_computed_tokens == 8  # the two full blocks, not the partial third
    assert b.block_ids[:2] == a.block_ids[:2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    assert bm.prefix_hit_tokens == 8


def test_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(200, 208))  # exactly 2 blocks
    a = admitted(bm, request("a", prompt))
    compute_all(bm, a)
    b = admitted(bm, request("b", list(prompt)))
    assert b.num_computed_tokens == 4  # one token must still run to give logits
    assert b.num_pending_tokens == 4


def test_hash_chain_depends_on_parent():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = admitted(bm, request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    compute_all(bm, a)
    # b starts with a's *second* block: same tokens, different position and parent
    b = admitted(bm, request("b", [5, 6, 7, 8, 10]))
    assert b.num_computed_tokens == 0


def salted(rid: str, prompt: list[int], cache_salt: str, tenant: str = ""):
    req = request(rid, list(prompt))
    req.cache_salt, req.tenant = cache_salt, tenant
    return req


def test_prefix_hits_stay_within_one_cache_salt():
    """Another tenant's hit would tell it the prompt, block by block: the salt scopes the cache."""
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(300, 310))  # 2 full blocks + 2 tokens
    compute_all(bm, admitted(bm, salted("a", prompt, "key-1", "key-1")))
    b = salted("b", prompt, "key-2", "key-2")
    assert bm.cached_prefix_tokens(b) == 0  # what the lpm policy sees too
    assert admitted(bm, b).num_computed_tokens == 0
    assert admitted(bm, salted("u", prompt, "")).num_computed_tokens == 0  # nor unsalted
    assert admitted(bm, salted("a2", prompt, "key-1", "key-1")).num_computed_tokens == 8  # the same tenant hits
    # a shared cache (share_prefix_cache: no salt) serves every tenant
    compute_all(bm, admitted(bm, salted("x", [1, *prompt], "", "key-1")))
    assert admitted(bm, salted("y", [1, *prompt], "", "key-2")).num_computed_tokens == 8


def test_freed_cached_blocks_are_reusable_until_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = admitted(bm, request("a", [1, 2, 3, 4, 5]))  # blocks: [1,2] [3,4] [5]
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 6
    assert bm.num_cached_blocks == 2
    # a later identical prefix still hits after a is gone
    b = admitted(bm, request("b", [1, 2, 3, 4, 9]))
    assert b.num_computed_tokens == 4
    bm.free(b)
    # fill the pool: plain blocks go first, then cached ones, least recently freed first
    c = admitted(bm, request("c", list(range(50, 58))))  # 4 blocks
    assert bm.allocate(c, 8)
    assert bm.num_cached_blocks == 2  # only the 4 uncached blocks were used
    d = admitted(bm, request("d", [60, 61]))
    assert bm.allocate(d, 2)  # needs 1 block: evicts the tail block [3,4] first
    assert bm.num_cached_blocks == 1
    bm.free(c)
    bm.free(d)
    e = admitted(bm, request("e", [1, 2, 70]))
    assert e.num_computed_tokens == 2  # [1,2] survived


def test_no_leak_after_free_and_counts_add_up():
    bm = BlockManager(num_blocks=32, block_size=4)
    reqs = [admitted(bm, request(f"r{i}", 10 + i)) for i in range(4)]
    for r in reqs:
        compute_all(bm, r)
    assert bm.num_used_blocks + bm.num_free_blocks == 32
    for r in reqs:
        bm.free(r)
    assert bm.num_free_blocks == 32
    assert bm.num_reserved_blocks == 0


def test_admission_reserves_final_footprint():
    bm = BlockManager(num_blocks=10, block_size=4)
    big = admitted(bm, request("big", 20), reserve=24)  # 6 blocks reserved, none allocated yet
    assert bm.num_reserved_blocks == 6
    assert bm.num_used_blocks == 0
    # only 4 unreserved blocks remain: a 5-block footprint is refused
    assert not bm.admit(request("x", 17), 20)
    small = admitted(bm, request("small", 8), reserve=16)  # 4 blocks: fits exactly
    # big can still take every block of its reservation, chunk by chunk
    for _ in range(3):
        assert bm.allocate(big, 8)
        big.num_computed_tokens += 8
    assert len(big.block_ids) == 6
    # unreserved growth beyond small's reserve fails: nothing is left
    assert bm.allocate(small, 16)
    small.num_computed_tokens = 16
    assert not bm.allocate(small, 1)


def test_allocate_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = admitted(bm, request("r", 4), reserve=4)
    assert bm.allocate(r, 4)
    r.num_computed_tokens = 4
    before = (list(r.block_ids), bm.num_free_blocks)
    assert not bm.allocate(r, 8)
    assert (r.block_ids, bm.num_free_blocks) == before


def test_check_invariants_passes_on_real_use_and_names_corruption():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = admitted(bm, request("a", 10), reserve=16)
    b = admitted(bm, request("b", 9), reserve=12)
    compute_all(bm, a)
    compute_all(bm, b)
    bm.check_invariants([a, b])
    with pytest.raises(RuntimeError, match="ref_count"):
        bm.check_invariants([a])  # b's blocks are counted but no table holds them
    a.block_ids.append(a.block_ids[-1])  # one block twice in a table: its ref_count is one short
    with pytest.raises(RuntimeError, match="block tables"):
        bm.check_invariants([a, b])
    a.block_ids.pop()
    a.footprint_blocks += 1  # a reservation the pool never made
    with pytest.raises(RuntimeError, match="reserve"):
        bm.check_invariants([a, b])


def test_shared_blocks_are_copied_by_whichever_request_writes_first():
    bm = BlockManager(num_blocks=16, block_size=4)
    head = admitted(bm, request("h", 10), reserve=16)
    compute_all(bm, head)  # 10 tokens: 2 full blocks and a partial one
    child = request("c", head.prompt_token_ids)
    assert bm.share(child, head, 16) == Admitted(9)  # all but the last prompt token
    assert child.block_ids == head.block_ids
    assert all(bm.blocks[b].ref_count == 2 for b in head.block_ids)
    bm.check_invariants([head, child])
    partial = head.block_ids[2]
    grown = bm.allocate(head, 1)  # the head writes token 10 into the shared partial block: it copies it
    assert head.block_ids[2] != partial and child.block_ids[2] == partial
    assert grown == Grown(((partial, head.block_ids[2]),)) and bm.blocks[partial].ref_count == 1
    child.num_computed_tokens = 9
    assert bm.allocate(child, 1) == Grown()  # now the child's alone in it: no copy
    bm.check_invariants([head, child])
    for r in (head, child):
        bm.free(r)
    assert bm.num_free_blocks == 16 and bm.num_reserved_blocks == 0
