"""The torch model path: paged attention, chunking exactness, loaders, the real model."""

import dataclasses
import json
import mmap
import os
import subprocess
import sys

import llguidance
import pytest
import torch

from stallfree import kernels
from stallfree.core.analysis.profiler import choose_budget, compute_label, profile_runner
from stallfree.core.build import ModelSettings, load_runner
from stallfree.core.model.export import export_hf_dir
from stallfree.core.model.loader import ModelLoadError, load_model, load_tiny
from stallfree.core.model.model_config import ModelConfig
from stallfree.core.model.model_runner import ModelRunner, kv_blocks_for
from stallfree.core.sched.batch import Batch, Item
from stallfree.core.sched.block_manager import BlockManager
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine, RequestRejected, check_request
from stallfree.core.sched.request import Request, SamplingParams
from stallfree.kernels import build_attention_meta, cpu_build, paged_attention, write_kv
from stallfree.kernels.linear import dot_available
from tests.simkit import request, run_to_completion, tokens

CPU = torch.device("cpu")


def dense_attention(q, k, v, prefix):
    """Causal attention of n queries after `prefix` cached tokens (contiguous K/V)."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    allowed = torch.arange(length)[None, :] <= torch.arange(prefix, prefix + n)[:, None]
    s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense_on_a_ragged_mixed_batch(dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, num_blocks = 6, 2, 16, 4, 64
    # (cached prefix, new tokens): decodes first (one token, contexts across
    # block boundaries), then chunks with and without a prefix
    seqs = [(0, 1), (3, 1), (4, 1), (11, 1), (0, 9), (8, 5), (13, 1)]
    num_decodes = 4
    k_cache = torch.zeros(num_blocks, bs, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = list(torch.randperm(num_blocks).tolist())  # scattered blocks
    tables, full_k, full_v = [], [], []
    for prefix, new in seqs:
        total = prefix + new
        table = [free.pop() for _ in range(-(-total // bs))]
        tables.append(table)
        k, v = torch.randn(total, kv_heads, dim, dtype=dtype), torch.randn(total, kv_heads, dim, dtype=dtype)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(prefix)], dtype=torch.long)
        write_kv(k_cache, v_cache, k[:prefix], v[:prefix], slots)  # the cached prefix
        full_k.append(k)
        full_v.append(v)
    meta = build_attention_meta(tables, [p + n for p, n in seqs], [n for _, n in seqs], num_decodes, bs, CPU)
    new_k = torch.cat([k[p:] for k, (p, _) in zip(full_k, seqs, strict=True)])
    new_v = torch.cat([v[p:] for v, (p, _) in zip(full_v, seqs, strict=True)])
    write_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping)
    q = torch.randn(new_k.shape[0], heads, dim, dtype=dtype)
    out = paged_attention(q, k_cache, v_cache, meta, dim**-0.5)
    row = 0
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for (prefix, new), k, v in zip(seqs, full_k, full_v, strict=True):
        ref = dense_attention(q[row : row + new].float(), k.float(), v.float(), prefix)
        assert torch.allclose(out[row : row + new].float(), ref, atol=tol), (prefix, new)
        row += new


def first_token_logits(runner, prompt, chunk, decoders):
    """Prefill `prompt` in chunks of `chunk` tokens, each iteration also carrying
    one decode step for every request in `decoders`; return the final logits."""
    kv = BlockManager(runner.k_cache.shape[1], runner.block_size)
    others = [Request(f"d{i}", p, SamplingParams(), 0) for i, p in enumerate(decoders)]
    for r in others:  # their prompts are already cached: one decode token each
        assert kv.admit(r, r.num_tokens + 64)
        assert kv.allocate(r, r.num_tokens)
        runner.execute(Batch(0, [Item(r, 0, r.num_tokens, True)]))
        r.num_computed_tokens = r.num_tokens - 1
    req = Request("p", prompt, SamplingParams(), 0)
    assert kv.admit(req, len(prompt))
    captured = {}
    real = runner.model.forward

    def spy(*args):
        captured["logits"] = real(*args)
        return captured["logits"]

    runner.model.forward = spy
    try:
        for start in range(0, len(prompt), chunk):
            n = min(chunk, len(prompt) - start)
            for r in others:
                assert kv.allocate(r, 1)
            assert kv.allocate(req, n)
            items = [Item(r, r.num_computed_tokens, 1, False) for r in others] + [Item(req, start, n, True)]
            runner.execute(Batch(0, items))
            req.num_computed_tokens += n
            for r in others:
                r.num_computed_tokens += 1
                r.output_token_ids.append(100)  # the next decode input
    finally:
        runner.model.forward = real
    return captured["logits"][-1]


def test_chunked_prefill_is_exact(tiny_model):
    """The article: chunking changes cost accounting, not semantics."""
    runner = ModelRunner(tiny_model, 256, 16, torch.float32, CPU)
    prompt = tokens("chunked", 150)
    whole = first_token_logits(runner, prompt, len(prompt), [])
    for chunk in (1, 7, 16, 33, 64):
        mixed = first_token_logits(runner, prompt, chunk, [tokens("x", 20), tokens("y", 37)])
        assert torch.allclose(mixed, whole, atol=1e-4), chunk
        assert mixed.argmax() == whole.argmax()


@pytest.mark.parametrize(("bias", "threads"), [(False, 2), (True, 2), (False, 3)])
def test_the_native_layer_loop_gives_the_op_by_op_loops_logits(bias, threads):
    """Where every linear layer runs on the dot-product kernel the decoder
    layers run as one native call (``kernels.FusedLayers``), exactly there;
    a chunk's logits beside two decodes are the op-by-op loop's, bit for bit
    (heads of 32, bf16; Qwen2's q/k/v biases too). A path of ``cpu_path``'s
    choosing keeps the loop. The native call runs its ops' loops in one team
    (``kernels/csrc/parallel.h``); at 3 threads on fewer cores some of the
    team is always away."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native_layer_loop_matches(bias)
    finally:
        torch.set_num_threads(before)


def native_layer_loop_matches(bias: bool) -> None:
    config = dataclasses.replace(ModelConfig.tiny(), head_dim=32, attention_bias=bias)
    runner = ModelRunner(load_tiny(config=config), 256, 16, torch.bfloat16, CPU)
    model = runner.model
    assert (model.fused is not None) == (dot_available() and not cpu_build.has_amx())
    if model.fused is None:
        return
    assert runner.kernel_paths["layer loop"] == "one native call (layers.cpp)"
    # the packed weights it streams were moved into one huge-page mapping (kernels.huge_page_copies)
    assert model.fused.qkv[0] is model.layers[0].qkv.dot
    assert model.fused.qkv[0].data_ptr() % (2 << 20) == 0 or not hasattr(mmap, "MADV_HUGEPAGE")
    fused, calls = model.fused, []
    model.fused = lambda *args: calls.append(1) or fused(*args)
    prompt, decoders = tokens("fused", 70), [tokens("x", 20), tokens("y", 37)]
    native = first_token_logits(runner, prompt, 16, decoders)
    assert len(calls) == 2 + 5  # the decoders' prompts, then the prompt's five chunks
    model.fused = None
    assert torch.equal(native, first_token_logits(runner, prompt, 16, decoders))
    with kernels.cpu_path(kernels.reference):
        assert not kernels.native_in_use(torch.zeros(1))


def test_a_bf16_kv_cache_under_float32_compute(tiny_model):
    """--kv-dtype bf16: the cache holds bf16 (twice the blocks in the same bytes),
    attention runs on it, the logits stay near float32's, chunking stays exact."""
    runner = ModelRunner(tiny_model, 256, 16, torch.float32, CPU, kv_dtype=torch.bfloat16)
    assert runner.k_cache.dtype == runner.v_cache.dtype == torch.bfloat16
    assert compute_label(runner) == "float32-kv-bfloat16"
    assert kv_blocks_for(tiny_model, 2**24, 16, torch.bfloat16) == 2 * kv_blocks_for(
        tiny_model, 2**24, 16, torch.float32
    )
    prompt = tokens("kv", 150)
    whole = first_token_logits(runner, prompt, len(prompt), [])
    mixed = first_token_logits(runner, prompt, 33, [tokens("x", 20), tokens("y", 37)])
    assert torch.allclose(mixed, whole, atol=1e-4)  # the same bf16 values, read in another order
    exact = first_token_logits(ModelRunner(tiny_model, 256, 16, torch.float32, CPU), prompt, len(prompt), [])
    assert not torch.equal(whole, exact)  # the cache really rounds
    assert torch.allclose(whole, exact, atol=0.05 * exact.abs().max().item())


def test_kv_dtype_is_the_compute_dtype_or_bf16():
    with pytest.raises(ValueError, match="--kv-dtype fp16"):
        load_runner(ModelSettings("tiny", dtype="fp32", kv_dtype="fp16"))
    with pytest.raises(ValueError, match="--kv-dtype fp7: unknown dtype"):
        load_runner(ModelSettings("tiny", dtype="fp32", kv_dtype="fp7"))


def greedy(tiny_model, dtype=torch.float32, **sched):
    runner = ModelRunner(tiny_model, 512, 16, dtype, CPU)
    engine = Engine(SchedulerConfig(max_num_seqs=8, max_model_len=1024, **sched), CacheConfig(512, 16), runner)
    reqs = [
        Request(f"r{i}", tokens(("g", i), n), SamplingParams(max_tokens=12, ignore_eos=True), 0)
        for i, n in enumerate((300, 20, 75, 5))
    ]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work:
        engine.step()
    assert engine.kv.num_used_blocks == 0
    return [r.output_token_ids for r in reqs]


def test_greedy_outputs_match_across_budgets_and_modes(tiny_model):
    reference = greedy(tiny_model, chunking="none")
    assert greedy(tiny_model, token_budget=24) == reference
    assert greedy(tiny_model, token_budget=100, dynamic_chunking=False) == reference
    assert greedy(tiny_model, chunking="decode_first", token_budget=40) == reference


def test_bf16_agrees_with_fp32(tiny_model):
    a, b = greedy(tiny_model), greedy(tiny_model, torch.bfloat16)
    agree = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra[:4], rb[:4], strict=True))
    assert agree >= 12  # of the first 4 tokens of 4 requests; later tokens may drift


def test_hf_directory_roundtrip(tiny_model, tmp_path):
    export_hf_dir(tiny_model, tmp_path, torch.float32)
    loaded = load_model(str(tmp_path))
    assert loaded.config.num_layers == tiny_model.config.num_layers
    a = ModelRunner(tiny_model, 64, 16, torch.float32, CPU)
    b = ModelRunner(loaded, 64, 16, torch.float32, CPU)
    prompt = tokens("hf", 40)
    assert torch.allclose(first_token_logits(a, prompt, 40, []), first_token_logits(b, prompt, 40, []), atol=1e-5)


def test_bad_model_directories_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_attention_heads": 4,
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
            }
        )
    )
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(str(tmp_path))


def test_bad_requests_are_refused_before_work(tiny_model):
    runner = ModelRunner(tiny_model, 64, 16, torch.float32, CPU)
    engine = Engine(SchedulerConfig(max_model_len=512), CacheConfig(64, 16), runner)

    def check(req: Request) -> None:  # what the gateway asks before any engine sees a request
        check_request(req.num_prompt_tokens, req.sampling, engine.config.max_model_len, runner.vocab_size)

    with pytest.raises(RequestRejected, match="context limit") as info:
        check(Request("long", tokens("l", 600), SamplingParams(), 0))
    assert info.value.code == "prompt_too_long"
    for bad, field in [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(top_k=runner.vocab_size + 1), "top_k"),
        (SamplingParams(max_tokens=0), "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            check(Request("x", [5, 6], bad, 0))


def test_profile_fits_and_chooses_a_budget(tiny_model):
    runner = ModelRunner(tiny_model, 1024, 16, torch.float32, CPU)
    prof = profile_runner(runner, 1024, threads=torch.get_num_threads(), quick=True)
    curve = sorted((p.tokens, p.measured_ms) for p in prof.points if p.chunk and p.prefix == 0)
    assert max(prof.errors_pct()) < 1000
    assert prof.hardware.flops > 0
    # SLOs outside the measured times, so noise between the tiny model's nearly
    # flat points cannot move the answer: below every point, above every point
    times = [ms for _, ms in curve]
    fast, _ = choose_budget(prof.points, tpot_slo_ms=min(times) * 0.5)
    slow, _ = choose_budget(prof.points, tpot_slo_ms=max(times) * 2)
    assert fast == curve[0][0] < slow == curve[-1][0]


AVX512_RUNS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_build.cpu_flags()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "options"),
    [
        ({}, []),
        ({"STALLFREE_CPU_KERNELS": "reference"}, []),
        ({}, ["--dtype", "fp32", "--kv-dtype", "bf16"]),
        # bf16 on the avx512 kind's paths (oneDNN's GEMMs, float32-FMA attention), where this CPU runs them
        pytest.param(
            {"STALLFREE_CPU_ISA": "avx512"},
            ["--dtype", "bf16"],
            marks=pytest.mark.skipif(not AVX512_RUNS, reason="the CPU cannot execute an AVX-512 build"),
        ),
    ],
)
def test_real_model_answers_paris(env, options):
    """The embedded SmolLM2-135M-Instruct, greedy, through the CLI, at this
    machine's default dtype (bf16 where the CPU has AVX512-BF16 or AMX: the
    dot-product or AMX paths; else fp32), in bf16 on the paths of an AVX-512
    CPU without BF16, and with a bf16 KV cache under float32 GEMMs.

    Its top two first tokens ("The", "L") are 0.08 apart in float32, inside
    bf16's rounding: bf16 keeps the answer because the head and the GEMMs
    that feed the residual stream give float32 outputs (kernels.Linear).
    """
    question = "What is the capital of France?"
    out = subprocess.run(
        [sys.executable, "-m", "stallfree.cli", "generate", question, "--max-tokens", "24", *options],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "prompt tokens" in out.stderr


def test_a_constrained_or_penalized_request_leaves_no_runner_state_behind(tiny_model):
    runner = ModelRunner(tiny_model, 256, 16, torch.float32, CPU)
    e = Engine(SchedulerConfig(max_num_seqs=4, token_budget=64), CacheConfig(256, 16), runner)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    e.add_request(request("g", 6, max_tokens=3, grammar=llguidance.LLMatcher.grammar_from_json_schema(schema)))
    e.add_request(request("p", 6, max_tokens=3, frequency_penalty=0.5))
    run_to_completion(e)
    e.step()  # the batch after their end names them
    assert runner.sampler.grammars._matchers == {} and dict(runner.sampler.counts._row_of) == {}
