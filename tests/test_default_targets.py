"""`stallfree serve` on the model holds a TBT and a TTFT target out of the box
(issue 50: the default is the configuration that wins): the TBT target 5 x the
decode-only iteration it measures before serving; a target set on the command
line, 0 included, is kept; a derived TBT target stretches while TTFT targets press, a stated one holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stallfree.cli import build_parser
from stallfree.cli.options import scheduler_config
from stallfree.cli.serve import local_engine
from stallfree.core.analysis import profiler, targets
from stallfree.core.analysis.targets import SLO_DECODES, STRETCH, TTFT_TARGET_MS, measured_decode_s
from tests.simkit import sim_engine
from tests.test_ttft_target import FakeCost  # 10 ms an iteration, 1 ms a decode, 0.5 ms a prompt token

TINY = ["serve", "--model", "tiny", "--dtype", "fp32", "--threads", "1", "--kv-cache-gib", "0.01"]


def test_the_decode_probe_times_eight_decodes_and_leaves_the_engine_idle():
    e = sim_engine(4096, 16, cost=FakeCost(), token_budget=512, max_num_seqs=64)
    assert measured_decode_s(e) == pytest.approx((10 + SLO_DECODES) / 1e3)
    assert not e.has_work and e.kv.num_used_blocks == 0


def test_with_fewer_sequences_allowed_the_probe_decodes_that_many():
    e = sim_engine(4096, 16, cost=FakeCost(), token_budget=512, max_num_seqs=4)
    assert measured_decode_s(e) == pytest.approx(14 / 1e3)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Profiles saved in a folder of the module's own: none at first, so the first start measures one."""
    folder = tmp_path_factory.mktemp("profiles")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiler, "default_profile_path", lambda model, dtype, threads: folder / f"{threads}t.json")
        yield folder


def started(flags: list[str]):
    args = build_parser().parse_args([*TINY, *flags])
    return local_engine(args, scheduler_config(args, {}), False)


def test_serve_sets_both_targets_from_the_decode_iteration_it_measured(profiles, monkeypatch):
    probed = []
    monkeypatch.setattr(targets, "measured_decode_s", lambda engine: probed.append(engine) or 0.0123)
    built = started([])
    assert probed == [built.engine]
    assert (built.engine.config.tbt_slo_ms, built.engine.config.ttft_slo_ms) == (61.5, TTFT_TARGET_MS)
    assert built.engine.config.tbt_stretch == STRETCH > 1  # a derived target yields while deadlines press
    assert "12.3 ms" in str(built.facts["targets_basis"])
    assert started(["--tbt-stretch", "1"]).engine.config.tbt_stretch == 1.0  # told: kept


def test_the_real_probe_runs_on_the_model_and_leaves_its_kv_free(profiles):
    built = started(["--ttft-slo-ms", "0"])
    config = built.engine.config
    assert config.tbt_slo_ms > 0 and config.ttft_slo_ms == 0.0
    assert not built.engine.has_work and built.engine.kv.num_used_blocks == 0


def test_a_target_set_on_the_command_line_is_kept_and_zero_is_off(profiles, monkeypatch):
    monkeypatch.setattr(targets, "measured_decode_s", lambda engine: pytest.fail("no TBT target to derive"))
    config = started(["--tbt-slo-ms", "75"]).engine.config
    assert (config.tbt_slo_ms, config.ttft_slo_ms, config.tbt_stretch) == (75.0, TTFT_TARGET_MS, 1.0)
    built = started(["--tbt-slo-ms", "0", "--ttft-slo-ms", "0"])
    assert (built.engine.config.tbt_slo_ms, built.engine.config.ttft_slo_ms) == (0.0, 0.0)
    assert "targets_basis" not in built.facts


def test_the_simulated_runner_keeps_its_targets_off_unless_set():
    args = build_parser().parse_args(["serve", "--sim"])
    config = local_engine(args, scheduler_config(args, {}), False).engine.config
    assert (config.tbt_slo_ms, config.ttft_slo_ms) == (0.0, 0.0)
