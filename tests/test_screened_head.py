"""The screened head (kernels.screened_head): a row that wants only its argmax
gets the float32 head's argmax from a bf16 screen and float32 rechecks.

Where bf16 products run, the screen is the real one (oneDNN's brgemm on AMX,
else vdpbf16ps); elsewhere the same arithmetic by torch (bf16-rounded
operands, float32 sums), so the bound and the rechecks are tested on every
machine."""

from __future__ import annotations

import pytest
import torch

from stallfree import kernels
from stallfree.core.model.llama import LlamaModel
from stallfree.core.model.model_runner import ModelRunner
from stallfree.core.sched.config import CacheConfig, SchedulerConfig
from stallfree.core.sched.engine import Engine
from stallfree.core.sched.request import Request, SamplingParams
from stallfree.kernels.screened_head import FLUSHED, ScreenedHead
from tests.simkit import tokens


class Emulated(ScreenedHead):
    """The screen's arithmetic by torch, for machines without the brgemm:
    bf16-rounded operands summed in float32, and the bounds per block of 64."""

    def _pack(self, w: torch.Tensor) -> torch.Tensor:
        return w.float()

    def _screen(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = x.bfloat16().float() @ self.packed.T
        err = scale[:, None] * self.norms + FLUSHED
        lo = (logits - err).view(len(x), -1, 64).amax(dim=2)
        hi = (logits + err).view(len(x), -1, 64).amax(dim=2)
        return logits, torch.stack([lo.T, hi.T], dim=2).contiguous()


def screen_of(weight: torch.Tensor) -> ScreenedHead:
    return ScreenedHead(weight) if ScreenedHead.available(kernels.Linear(weight)) else Emulated(weight)


def inverted_leaders(rows: int = 16, v: int = 4096, k: int = 576, seed: int = 0):
    """x [rows, k] and w [v, k] where row r's two leaders (entries 2r and 2r+1,
    logits near 20) differ on two coordinates where x_r is 1: on p, 2r+1 is
    ahead by 0.0035 (both round to 1 in bf16); on q, 2r's weight is just above
    halfway to bf16's next step after 1 and 2r+1's just below, so the screen
    puts 2r ahead by 2^-7 while 2r+1 leads in float32 by 0.0035 - 2e-5."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen) * 2
    half = 1 + 2.0**-8  # halfway between 1 and the next bf16 value
    for r in range(rows):
        p, q = r, rows + r
        x[r, p] = x[r, q] = 1.0
        a, b = 2 * r, 2 * r + 1
        w[a] += 20 * x[r] / x[r].norm() ** 2  # x_r . w_a near 20
        w[a, p], w[a, q] = 1.0, half + 1e-5
        w[b] = w[a]
        w[b, p], w[b, q] = 1.0035, half - 1e-5
    return x, w


def test_the_float32_leader_wins_where_the_screen_puts_another_ahead():
    x, w = inverted_leaders()
    want = (x.double() @ w.double().T).argmax(dim=1)
    assert torch.equal(want, torch.arange(16) * 2 + 1)
    screened = x.bfloat16().float() @ w.bfloat16().float().T
    assert torch.equal(screened.argmax(dim=1), want - 1)  # bf16 alone picks the other one
    assert torch.equal(screen_of(w)(x).argmax(dim=1), want)


@pytest.mark.parametrize("seed", range(6))
def test_rechecked_entries_hold_float32_values_and_the_rest_stay_below(seed):
    gen = torch.Generator().manual_seed(seed)
    v, k = 2048, 64 * (1 + seed % 3)
    w = torch.randn(v, k, generator=gen) * (0.02 + seed / 10)
    x = torch.randn(12, k, generator=gen) * (1 + seed)
    exact = x @ w.T
    got = screen_of(w)(x)
    rechecked = (got - exact).abs() <= 1e-5 * exact.abs().clamp_min(1)
    top = got.max(dim=1, keepdim=True).values
    assert torch.equal(got.argmax(dim=1), exact.argmax(dim=1))
    assert bool(rechecked.gather(1, got.argmax(dim=1, keepdim=True)).all())  # the leader is a float32 value
    assert bool(((got < top) | rechecked).all())


def test_only_rows_that_read_nothing_but_the_argmax_are_screened():
    assert SamplingParams().argmax_only
    for changed in (
        {"temperature": 0.7},
        {"logprobs": 0},
        {"logit_bias": ((5, 1.0),)},
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.5},
        {"grammar": "start: /[a-z]+/"},
    ):
        assert not SamplingParams(**changed).argmax_only, changed


def test_the_model_screens_argmax_rows_and_gives_the_others_the_whole_head(tiny_model):
    model = LlamaModel(tiny_model.config, tiny_model.weights, torch.float32, torch.device("cpu"))
    model.screen = screen_of(model.lm_head.weight)
    rows = model.screen.min_rows + 8
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, tiny_model.config.hidden_size, generator=gen) * 3
    whole = kernels.linear(model.lm_head, x).float()
    few = torch.zeros(rows, dtype=torch.bool)
    few[: model.screen.min_rows - 1] = True
    assert torch.equal(model._head(x, few), whole)  # too few to screen: the head whole
    mixed = torch.tensor([True, False] * 4 + [True] * (rows - 8))
    got = model._head(x, mixed)
    assert not torch.equal(got[mixed], whole[mixed])  # screened: only the leaders are float32 values
    assert torch.equal(got.argmax(dim=1), whole.argmax(dim=1))
    assert torch.allclose(got[~mixed], whole[~mixed], rtol=1e-6, atol=1e-6)


def engine_outputs(tiny_model, screen: bool) -> tuple[list[list[int]], int]:
    """20 greedy requests and 4 that ask for logprobs, decoding side by side:
    each one's tokens, and how many rows the screen took."""
    runner = ModelRunner(tiny_model, 512, 16, torch.float32, torch.device("cpu"))
    model = runner.model
    model.screen = screen_of(model.lm_head.weight) if screen else None
    screened = 0
    if model.screen is not None:
        real = model.screen

        def spy(x: torch.Tensor) -> torch.Tensor:
            nonlocal screened
            screened += len(x)
            return real(x)

        model.screen = spy  # type: ignore[assignment]
        model.screen.min_rows = real.min_rows  # type: ignore[attr-defined]
    engine = Engine(SchedulerConfig(max_num_seqs=32, max_model_len=512), CacheConfig(512, 16), runner)
    reqs = [
        Request(
            f"r{i}",
            tokens(("s", i), 12),
            SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2 if i % 6 == 0 else None),
            0,
        )
        for i in range(24)
    ]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work:
        engine.step()
    return [r.output_token_ids for r in reqs], screened


def test_greedy_outputs_are_the_same_with_the_screen(tiny_model):
    plain, none = engine_outputs(tiny_model, screen=False)
    screened, rows = engine_outputs(tiny_model, screen=True)
    assert none == 0 and rows >= 7 * 20  # 20 argmax-only rows for 7 decode steps at least
    assert screened == plain
