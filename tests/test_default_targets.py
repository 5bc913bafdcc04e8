"""`stallfree serve` on the model holds a TBT and a TTFT target out of the box,
derived from the profile it starts from (issue 50: the default is the
configuration that wins); a target set on the command line, 0 included, is kept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stallfree.cli import build_parser
from stallfree.cli.options import scheduler_config
from stallfree.cli.serve import local_engine
from stallfree.core.analysis import profiler
from stallfree.core.analysis.capacity_search import STRICT
from stallfree.core.analysis.profiler import Profile
from stallfree.core.analysis.targets import SLO_CONTEXT, SLO_DECODES, TTFT_TARGET_MS, derived_targets

TINY = ["serve", "--model", "tiny", "--dtype", "fp32", "--threads", "1", "--kv-cache-gib", "0.01"]


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


def test_serve_derives_both_targets_from_the_profile_it_measured(profiles):
    built = started([])
    saved = Profile.load(profiles / "1t.json")  # the quick profile the start measured
    decode_ms = saved.cost_model.iteration_s([SLO_CONTEXT] * SLO_DECODES, []) * 1e3
    config = built.engine.config
    assert config.tbt_slo_ms > 0
    assert config.tbt_slo_ms == pytest.approx(STRICT * decode_ms, abs=0.05)
    assert config.tbt_slo_ms == derived_targets(saved.cost_model).tbt_slo_ms
    assert config.ttft_slo_ms == TTFT_TARGET_MS
    assert "decode-only iteration" in str(built.facts["targets_basis"])


def test_a_target_set_on_the_command_line_is_kept_and_zero_is_off(profiles):
    config = started(["--tbt-slo-ms", "0", "--ttft-slo-ms", "500"]).engine.config
    assert (config.tbt_slo_ms, config.ttft_slo_ms) == (0.0, 500.0)
    config = started(["--tbt-slo-ms", "75"]).engine.config
    assert (config.tbt_slo_ms, config.ttft_slo_ms) == (75.0, TTFT_TARGET_MS)
    built = started(["--tbt-slo-ms", "0", "--ttft-slo-ms", "0"])
    assert (built.engine.config.tbt_slo_ms, built.engine.config.ttft_slo_ms) == (0.0, 0.0)
    assert "targets_basis" not in built.facts


def test_the_simulated_runner_keeps_its_targets_off_unless_set():
    args = build_parser().parse_args(["serve", "--sim"])
    config = local_engine(args, scheduler_config(args, {}), False).engine.config
    assert (config.tbt_slo_ms, config.ttft_slo_ms) == (0.0, 0.0)
