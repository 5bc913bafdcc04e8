"""Every op of the step runs on the threads the engine is given (issue 49).

The kernels split their work with OpenMP loops (``kernels/csrc/parallel.h``;
``at::parallel_for`` in the AVX2 and AMX GEMMs), which split nothing unless
the code including them is built with OpenMP: built without, they ran on one
core whatever ``--threads`` said. Here: the build's parallel loop runs on
every thread torch has, a thread away from its core leaves its share to the
others, the answer does not depend on how many threads ran it, and each
kernel of the step, called on a batch the size of a real iteration's, keeps
as many cores busy as it has threads (its process CPU time over wall time:
about 2 at two threads, 1 at one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from stallfree import kernels
from stallfree.core.model.loader import load_model
from stallfree.core.model.model_runner import ModelRunner
from stallfree.kernels import build_attention_meta, cpu_build, reference

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def native():
    status = cpu_build.status()
    assert status.backend == "native", f"the CPU kernels did not build: {status}"


def test_a_kernels_parallel_loop_runs_on_every_thread_it_is_given(native):
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        assert torch.ops.stallfree.threads_used(64) == threads


def test_the_start_up_log_states_the_threads_the_kernels_run_on(native):
    torch.set_num_threads(2)
    assert kernels.paths(torch.bfloat16, torch.bfloat16)["threads"] == "2 (a kernel's loop runs on 2)"


@pytest.mark.parametrize("team", [False, True])
@pytest.mark.parametrize("threads", [2, 3])
def test_a_thread_away_from_its_core_leaves_its_share_to_the_others(native, threads, team):
    """The last thread is away 200 ms at its first item: the others run the
    rest of its share (a static split left it all to that thread), in a loop
    of its own or posted to a team as the native layer loop's are."""
    torch.set_num_threads(threads)
    by = torch.ops.stallfree.items_run_by(60, 200, team).tolist()
    assert set(by) <= set(range(threads)), by  # every item ran, on the team's threads
    assert by.count(threads - 1) <= 1, by  # the away thread ran at most the item it held


def test_the_linear_kernels_answer_does_not_depend_on_the_threads(native):
    """An item's output is one thread's whole computation, whoever takes it:
    the same bits at 1, 2 and 3 threads."""
    loaded = load_model(None)
    dtype = torch.bfloat16 if cpu_build.detect_isa() in ("avx512-bf16", "avx512") else torch.float32
    model = ModelRunner(loaded, 8, 16, dtype, CPU).model
    x = torch.randn(37, loaded.config.hidden_size, generator=torch.Generator().manual_seed(3))
    layer = model.layers[0]
    answers = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        answers.append(
            (
                kernels.linear(layer.gate_up, x.to(dtype)),
                kernels.linear(layer.qkv, x.to(dtype)),
                kernels.linear(model.lm_head, x),
            )
        )
    for got in answers[1:]:
        for a, b in zip(answers[0], got, strict=True):
            assert torch.equal(a, b)


def busy_cores(call: Callable[[], object], seconds: float = 0.3, tries: int = 3) -> float:
    """The most cores ``call`` kept busy over ``tries`` runs of about ``seconds``:
    this process's CPU time over wall time (another process busy on a core can
    only lower it, so the best try is the kernel's own)."""
    call()  # warm: packing, first-touch pages
    best = 0.0
    for _ in range(tries):
        cpu, wall, n = time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - wall < seconds:
            call()
            n += 1
        best = max(best, (time.process_time() - cpu) / (time.perf_counter() - wall))
    return best


def step_ops() -> dict[str, Callable[[], object]]:
    """One call of each op of a real iteration's step, bf16 as this machine
    runs the model: 32 decodes at 2,048 tokens of context, a 512-token chunk
    after a 1,536-token prefix."""
    loaded = load_model(None)
    dtype = torch.bfloat16 if cpu_build.detect_isa() in ("avx512-bf16", "avx512") else torch.float32
    runner = ModelRunner(loaded, 8, 16, dtype, CPU)
    model, cfg = runner.model, loaded.config
    layer = model.layers[0]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(512, cfg.hidden_size, generator=gen)
    x32 = hidden[:32].to(dtype)
    heads, kv_heads, dim, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    blocks = 32 * 2048 // bs + 2048 // bs
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    tables = [list(range(i * 128, (i + 1) * 128)) for i in range(32)]
    decode = build_attention_meta(tables, [2048] * 32, [1] * 32, 32, bs, CPU)
    chunk = build_attention_meta([list(range(32 * 128, 33 * 128))], [2048], [512], 0, bs, CPU)
    q32 = torch.randn(32, heads, dim, generator=gen).to(dtype)
    q512 = torch.randn(512, heads, dim, generator=gen).to(dtype)
    gate_up = torch.randn(512, 2 * cfg.intermediate_size, generator=gen).to(dtype)
    positions = torch.arange(1536, 2048)
    q_rope, k_rope = q512.clone(), torch.randn(512, kv_heads, dim, generator=gen).to(dtype)
    return {
        "linear, 32 rows (gate_up)": lambda: kernels.linear(layer.gate_up, x32),
        "linear, a 512-token chunk (gate_up)": lambda: kernels.linear(layer.gate_up, hidden.to(dtype)),
        "the head, 32 rows": lambda: kernels.linear(model.lm_head, hidden[:32]),
        "attention, 32 decodes": lambda: kernels.paged_attention(q32, k_cache, v_cache, decode, dim**-0.5),
        "attention, a chunk after 1,536": lambda: kernels.paged_attention(q512, k_cache, v_cache, chunk, dim**-0.5),
        "rms_norm, 512 rows": lambda: kernels.rms_norm(hidden, model.final_norm, 1e-5),
        "silu_mul, 512 rows": lambda: kernels.silu_mul(gate_up),
        "rope, 512 rows": lambda: kernels.rope(q_rope, k_rope, positions, model.cos_sin),
    }


@pytest.fixture(scope="module")
def ops(native) -> dict[str, Callable[[], object]]:
    return step_ops()


@pytest.mark.slow
@pytest.mark.parametrize(
    "op",
    [
        "linear, 32 rows (gate_up)",
        "linear, a 512-token chunk (gate_up)",
        "the head, 32 rows",
        "attention, 32 decodes",
        "attention, a chunk after 1,536",
        "rms_norm, 512 rows",
        "silu_mul, 512 rows",
        "rope, 512 rows",
    ],
)
def test_each_op_of_the_step_keeps_as_many_cores_busy_as_it_has_threads(ops, op):
    call = ops[op]
    torch.set_num_threads(1)
    one = busy_cores(call)
    torch.set_num_threads(2)
    two = busy_cores(call)
    assert one < 1.25 and two > 1.5, f"{op}: {one:.2f} cores busy at 1 thread, {two:.2f} at 2"


@pytest.mark.parametrize("decodes", [2, 9])  # fewer than twice the threads: split by KV head; more: whole
def test_attention_gives_the_same_answer_however_its_work_is_dealt(native, decodes):
    """The items (a decode's KV heads, a chunk's row tiles per KV head) go to the
    threads by cost: at 1 to 4 threads the answer is the reference's."""
    gen = torch.Generator().manual_seed(decodes)
    kv_heads, group, dim, bs = 3, 3, 64, 16
    seqs = [(ctx, 1) for ctx in (5, 300, 40, 129, 7, 64, 200, 1, 90)[:decodes]] + [(700, 300), (0, 40)]
    blocks = [-(-(p + n) // bs) for p, n in seqs]
    k_cache = torch.randn(sum(blocks) + 1, bs, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(sum(blocks) + 1, bs, kv_heads, dim, generator=gen).bfloat16()
    order = torch.randperm(sum(blocks) + 1, generator=gen).tolist()
    tables = [[order.pop() for _ in range(b)] for b in blocks]
    meta = build_attention_meta(tables, [p + n for p, n in seqs], [n for _, n in seqs], decodes, bs, CPU)
    q = torch.randn(sum(n for _, n in seqs), kv_heads * group, dim, generator=gen).bfloat16()
    want = reference.paged_attention(q, k_cache, v_cache, meta, dim**-0.5).float()
    for threads in (1, 2, 3, 4):
        torch.set_num_threads(threads)
        got = kernels.paged_attention(q, k_cache, v_cache, meta, dim**-0.5).float()
        assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), threads


_TEAMS = """
import os, sys, time, torch
from stallfree import kernels
from stallfree.core.sched.step_loop import on_own_thread
kernels.native_cpu()
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
base = threads()
assert on_own_thread(lambda: torch.ops.stallfree.threads_used(64)) == 2
deadline = time.monotonic() + 10
while threads() > base and time.monotonic() < deadline:  # the team's workers leave as the thread ends
    time.sleep(0.01)
after_own = threads() - base
assert torch.ops.stallfree.threads_used(64) == 2
print(after_own, threads() - base)
"""


def test_a_model_built_on_its_own_thread_leaves_no_openmp_team_behind(native):
    """The engine is built (model loaded, start-up profile measured) by
    ``on_own_thread``: its parallel regions' team ends with that thread, so
    the step thread's team is the only one and libgomp keeps its workers
    spinning between regions. The same region run on this script's main
    thread leaves its worker behind: the count can see a team."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _TEAMS], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    after_own, after_main = map(int, out.stdout.split())
    assert after_own == 0, "the build thread's OpenMP workers outlived it"
    assert after_main == 1, "a region on the main thread should leave its one worker"
