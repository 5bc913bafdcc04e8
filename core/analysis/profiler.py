"""Measure iteration time against batch composition on the real model, fit the
cost model to this machine, and pick the token budget from a TPOT target.

The Sarathi-Serve recipe: the largest budget whose iteration time still meets
the TPOT SLO, since every decode waits one iteration per token.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallfree.core.analysis.cost_model import CostModel, HardwareSpec, ModelSpec
from stallfree.core.sched.batch import Batch, Item
from stallfree.core.sched.block_manager import BlockManager
from stallfree.core.sched.request import Request, SamplingParams

if TYPE_CHECKING:  # measuring needs the model; fitting and loading a profile do not
    from stallfree.core.model.model_runner import ModelRunner

FULL_CHUNKS = (16, 64, 128, 256, 512, 768, 1024, 1536, 2048)
QUICK_CHUNKS = (16, 128, 512, 1024, 2048)


@dataclass(slots=True)
class Point:
    decodes: int
    decode_context: int
    chunk: int
    prefix: int
    measured_ms: float
    predicted_ms: float = 0.0

    @property
    def tokens(self) -> int:
        return self.decodes + self.chunk


class ShapeBench:
    """Builds batches of fake requests straight onto the runner's KV cache:
    an iteration of a chosen shape, to time (here, and ``bench.engine.shape_repeat``)."""

    def __init__(self, runner: ModelRunner, num_blocks: int) -> None:
        self.runner = runner
        self.kv = BlockManager(num_blocks, runner.block_size, enable_prefix_caching=False)
        self.n = 0

    def request(self, computed: int, new: int) -> Request:
        self.n += 1
        ids = [(self.n * 7919 + i) % 30000 + 100 for i in range(computed + new)]
        req = Request(f"p{self.n}", ids, SamplingParams(max_tokens=1), 0)
        if not (self.kv.admit(req, computed + new) and self.kv.allocate(req, computed + new)):
            raise ValueError("KV cache too small for the profile; raise --kv-cache-gib")
        req.num_computed_tokens = computed
        return req

    def batch(self, decodes: int, ctx: int, chunk: int, prefix: int) -> tuple[Batch, list[Request]]:
        """``decodes`` decodes after ``ctx`` cached tokens each, and a chunk of
        ``chunk`` tokens after ``prefix`` (none at 0); its requests, to ``free``."""
        reqs = [self.request(ctx, 1) for _ in range(decodes)]
        items = [Item(r, ctx, 1, is_prefill=False) for r in reqs]
        if chunk:
            r = self.request(prefix, chunk)
            reqs.append(r)
            items.append(Item(r, prefix, chunk, is_prefill=True))
        return Batch(0, items), reqs

    def free(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.kv.free(r)

    def time_ms(self, decodes: int, ctx: int, chunk: int, prefix: int, repeats: int) -> float:
        batch, reqs = self.batch(decodes, ctx, chunk, prefix)
        self.runner.execute(batch)  # warm-up (allocator, caches)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.runner.execute(batch)
            times.append((time.perf_counter() - start) * 1e3)
        self.free(reqs)
        return statistics.median(times)


def measure(runner: ModelRunner, num_blocks: int, quick: bool = False, decodes: int = 8, ctx: int = 256) -> list[Point]:
    """Iteration time for: decode-only batches; `decodes` decodes plus a chunk of
    each size (the budget curve); one chunk after a growing prefix."""
    b = ShapeBench(runner, num_blocks)
    repeats = 2 if quick else 3
    points = [
        Point(n, ctx, 0, 0, b.time_ms(n, ctx, 0, 0, repeats)) for n in ((1, 8, 32) if quick else (1, 8, 16, 32, 64))
    ]
    for chunk in QUICK_CHUNKS if quick else FULL_CHUNKS:
        points.append(Point(decodes, ctx, chunk, 0, b.time_ms(decodes, ctx, chunk, 0, repeats)))
    for prefix in (1024, 3072) if quick else (512, 1024, 2048, 4096):
        points.append(Point(0, 0, 256, prefix, b.time_ms(0, 0, 256, prefix, repeats)))
    return points


def fit(spec: ModelSpec, points: list[Point], small_batch_rows: int = 0) -> CostModel:
    """Fit the roofline's FLOP/s, bandwidth, fixed overhead, attention FLOP/s
    and per-sequence cost to the measurements, minimising the summed
    |log(predicted / measured)|:
    a coarse grid, then multiplicative refinement of one coefficient at a time;
    once with weight reads overlapping compute and once adding to it, keeping
    the better fit. With ``small_batch_rows``, those five come from the larger
    batches, and the small batches' own GEMM FLOP/s and weight-read rate are
    fitted next, on theirs."""
    small = [p for p in points if p.tokens <= small_batch_rows]
    large = [p for p in points if p.tokens > small_batch_rows] if len(points) - len(small) >= 4 else points

    def cost_of(v: tuple[float, ...], overlap: bool) -> CostModel:
        hw = HardwareSpec("fitted", v[0], v[1], v[2], v[3], overlap, per_sequence_s=v[4])
        return CostModel(spec, hw, attention=True, kv_reads=True)

    def loss(cost: CostModel, on: list[Point]) -> float:
        return sum(abs(math.log(_predict_ms(cost, p) / p.measured_ms)) for p in on)

    def refine(best: tuple[float, ...], score: Callable[[tuple[float, ...]], float]) -> tuple[float, ...]:
        for step in (2.0, 1.4, 1.15, 1.05, 1.01):
            improved = True
            while improved:
                improved = False
                for i in range(len(best)):
                    for factor in (step, 1 / step):
                        trial = list(best)
                        trial[i] = trial[i] * factor if trial[i] else (1e-4 if factor > 1 else 0.0)
                        if score(tuple(trial)) < score(best):
                            best, improved = tuple(trial), True
        return best

    def fit_one(overlap: bool) -> tuple[float, ...]:
        grid = itertools.product(
            [f * 1e9 for f in (10, 30, 100, 300, 1000, 3000, 10000, 100000)],  # FLOP/s
            [b * 1e9 for b in (2, 5, 10, 20, 50, 200, 1000, 4000)],  # bytes/s
            [o / 1e3 for o in (0.0, 0.1, 1.0, 3.0, 10.0)],  # overhead s
            [a * 1e9 for a in (3, 10, 30, 100, 300, 1000, 10000, 100000)],  # attention FLOP/s
            [q / 1e3 for q in (0.0, 0.1, 0.3, 1.0, 3.0)],  # per sequence s
        )

        def score(v: tuple[float, ...]) -> float:
            return loss(cost_of(v, overlap), large)

        return refine(min(grid, key=score), score)

    fits = {overlap: fit_one(overlap) for overlap in (True, False)}
    overlap = min(fits, key=lambda o: loss(cost_of(fits[o], o), large))
    cost = cost_of(fits[overlap], overlap)
    if small and large is not points:

        def with_small(v: tuple[float, ...]) -> CostModel:
            hw = replace(cost.hardware, small_batch_rows=small_batch_rows, small_batch_flops=v[0], small_batch_bw=v[1])
            return replace(cost, hardware=hw)

        grid = itertools.product(
            [f * 1e9 for f in (10, 30, 100, 300, 1000, 10000)], [b * 1e9 for b in (2, 5, 10, 20, 50, 200, 1000)]
        )
        v = refine(min(grid, key=lambda v: loss(with_small(v), small)), lambda v: loss(with_small(v), small))

        def joint(v: tuple[float, ...]) -> CostModel:  # all seven together, on every point
            flops, mem_bw, overhead_s, attention_flops, per_sequence_s, small_flops, small_bw = v
            hw = HardwareSpec(
                "fitted",
                flops,
                mem_bw,
                overhead_s,
                attention_flops,
                overlap,
                small_batch_rows,
                small_flops,
                small_bw,
                per_sequence_s,
            )
            return CostModel(spec, hw, attention=True, kv_reads=True)

        start = (*fits[overlap], *v)
        cost = joint(refine(start, lambda v: loss(joint(v), points)))
    for p in points:
        p.predicted_ms = _predict_ms(cost, p)
    return cost


def _predict_ms(cost: CostModel, p: Point) -> float:
    chunks = [(p.prefix, p.chunk)] if p.chunk else []
    return cost.iteration_s([p.decode_context] * p.decodes, chunks) * 1e3


def choose_budget(points: list[Point], tpot_slo_ms: float) -> tuple[int, str]:
    """Largest budget on the measured budget curve (decodes + one chunk, no
    prefix) whose iteration time meets the SLO, interpolated between points."""
    curve = sorted((p.tokens, p.measured_ms) for p in points if p.chunk and p.prefix == 0)
    if curve[0][1] > tpot_slo_ms:
        return curve[0][0], f"even {curve[0][0]} tokens take {curve[0][1]:.1f} ms > SLO; using the smallest measured"
    best = curve[0][0]
    for (t0, m0), (t1, m1) in itertools.pairwise(curve):
        if m1 <= tpot_slo_ms:
            best = t1
        else:
            best = int(t0 + (t1 - t0) * (tpot_slo_ms - m0) / (m1 - m0)) if m1 > m0 else t0
            break
    else:
        return best, f"the whole measured curve (up to {best} tokens) meets the SLO"
    return max(best // 16 * 16, curve[0][0]), "interpolated on the measured curve"


@dataclass(slots=True)
class Profile:
    model: str
    dtype: str
    threads: int
    points: list[Point]
    spec: ModelSpec
    hardware: HardwareSpec
    # the machine's measured limits on one thread (kernels.roofline), beside the fitted rates
    roofline: dict[str, float] | None = None

    @property
    def cost_model(self) -> CostModel:
        """The fitted cost model: calibrates simulate and dynamic chunking."""
        return CostModel(self.spec, self.hardware, attention=True, kv_reads=True)

    def errors_pct(self) -> list[float]:
        return [abs(p.predicted_ms - p.measured_ms) / p.measured_ms * 100 for p in self.points]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "threads": self.threads,
            "model_spec": asdict(self.spec),
            "hardware": asdict(self.hardware),
            "roofline": self.roofline,
            "points": [{**asdict(p), "tokens": p.tokens} for p in self.points],
            "simulated_vs_measured_error_pct": {
                "mean": statistics.fmean(self.errors_pct()),
                "max": max(self.errors_pct()),
            },
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: Path) -> Profile:
        d = json.loads(path.read_text())
        points = [Point(**{k: v for k, v in p.items() if k != "tokens"}) for p in d["points"]]
        return cls(
            d["model"],
            d["dtype"],
            d["threads"],
            points,
            ModelSpec(**d["model_spec"]),
            HardwareSpec(**d["hardware"]),
            d.get("roofline"),
        )


def profile_runner(runner: ModelRunner, num_blocks: int, threads: int, quick: bool = False) -> Profile:
    """Measure, fit, and probe the machine's limits (``quick``: fewer points,
    and a probe of a fifth the length: 1 s rather than 4.5 on the Xeon)."""
    points = measure(runner, num_blocks, quick)
    cost = fit(runner.config.spec(runner.dtype.itemsize, runner.kv_dtype.itemsize), points, runner.small_batch_rows)
    dtype = compute_label(runner)
    limits = runner.roofline(0.02 if quick else 0.1)
    return Profile(runner.config.name, dtype, threads, points, cost.model, cost.hardware, limits)


def default_profile_path(model: str, dtype: str, threads: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return Path.home() / ".cache" / "stallfree" / f"profile-{safe}-{dtype}-{threads}t.json"


def format_profile(p: Profile, tpot_slo_ms: float | None = None) -> str:
    hw = p.hardware
    lines = [
        f"{p.model} ({p.dtype}, {p.threads} threads): fitted {hw.flops / 1e12:.2f} TFLOP/s (GEMM), "
        f"{(hw.attention_flops or hw.flops) / 1e12:.3f} TFLOP/s (attention), {hw.mem_bw / 1e9:.1f} GB/s, "
        f"{hw.overhead_s * 1e3:.2f} ms fixed per iteration and {hw.per_sequence_s * 1e3:.2f} ms per sequence, "
        "weight reads "
        f"{'overlapping' if hw.overlap else 'added to'} GEMM compute"
        + (
            f"; batches up to {hw.small_batch_rows} tokens: {hw.small_batch_flops / 1e12:.3f} TFLOP/s, "
            f"weight reads {p.spec.weight_bytes / hw.small_batch_bw * 1e3:.1f} ms"
            if hw.small_batch_rows
            else ""
        ),
        "",
        "  decodes  context  chunk  prefix  tokens  measured ms  simulated ms  error",
    ]
    if p.roofline:
        r = {"dot_bf16": 0.0} | p.roofline  # records from before the dot-product probe lack it
        # the arithmetic a GEMM of this dtype uses here: AMX tiles, else vdpbf16ps, else float32 FMAs
        peak, arithmetic = r["fma_f32"], "float32 FMA"
        if p.dtype == "bfloat16" and (r["brgemm_bf16"] or r["dot_bf16"]):
            peak, arithmetic = (r["brgemm_bf16"], "AMX") if r["brgemm_bf16"] else (r["dot_bf16"], "vdpbf16ps")
        lines[1:1] = [
            f"measured limits of one thread: float32 FMA peak {r['fma_f32'] / 1e9:.0f} GFLOP/s, "
            f"bf16 vdpbf16ps {r['dot_bf16'] / 1e9:.0f}, bf16 brgemm {r['brgemm_bf16'] / 1e9:.0f} GFLOP/s, "
            f"int8 {r['brgemm_int8'] / 1e9:.0f} GOP/s, reads {r['read_bw'] / 1e9:.1f} GB/s; the fitted GEMM "
            f"rate is {hw.flops / peak * 100:.0f}% of the {p.dtype} peak ({arithmetic})"
        ]
    for pt, err in zip(p.points, p.errors_pct(), strict=True):
        lines.append(
            f"  {pt.decodes:>7}  {pt.decode_context:>7}  {pt.chunk:>5}  {pt.prefix:>6}  {pt.tokens:>6}"
            f"  {pt.measured_ms:>11.1f}  {pt.predicted_ms:>12.1f}  {err:>4.0f}%"
        )
    errs = p.errors_pct()
    lines.append(f"  simulated vs measured: mean error {statistics.fmean(errs):.0f}%, max {max(errs):.0f}%")
    if tpot_slo_ms is not None:
        budget, how = choose_budget(p.points, tpot_slo_ms)
        lines += ["", f"token_budget for a {tpot_slo_ms:g} ms TPOT target: {budget} ({how})"]
    return "\n".join(lines)


def compute_label(runner: ModelRunner) -> str:
    """What the runner computes in: its dtype, or ``int8`` with ``--compute int8``;
    then ``-kv-<dtype>`` where the KV cache (and attention) is narrower."""
    label = "int8" if runner.compute == "int8" else str(runner.dtype).removeprefix("torch.")
    if runner.kv_dtype != runner.dtype:
        label += "-kv-" + str(runner.kv_dtype).removeprefix("torch.")
    return label


def runner_profile_path(runner: ModelRunner) -> Path:
    """Where this runner's profile is saved by default (model, compute dtype, threads)."""
    return default_profile_path(runner.config.name, compute_label(runner), runner.threads)


def saved_profile(runner: ModelRunner) -> Profile | None:
    """The profile saved for this runner, if there is a readable one."""
    path = runner_profile_path(runner)
    if path.exists():
        try:
            return Profile.load(path)
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or from an older format
    return None


def saved_or_quick_profile(runner: ModelRunner) -> tuple[Profile, str]:
    """The saved profile for this model, dtype and thread count, or a quick one
    measured now (and saved). Returns the profile and where it came from."""
    saved = saved_profile(runner)
    if saved is not None:
        return saved, str(runner_profile_path(runner))
    prof = profile_runner(runner, runner.num_blocks, runner.threads, quick=True)
    path = runner_profile_path(runner)
    prof.save(path)
    return prof, f"quick profile at startup, saved to {path}"
