"""Note [Expert lane model]: misses from hit rates, times from the measured fetch rate, and a
simulation that runs the cache's own eviction."""

from __future__ import annotations

import pytest

from ringflow.cli import main
from ringflow.errors import ConfigError
from ringflow.integrations.torch.expert_cache import simulate_hit_rate as simulate
from ringflow.orchestrator.expert_model import expected_distinct, fetch_ms, predict

QWEN = dict(layers=48, expert_layers=48, experts=128, top_k=8, expert_bytes=9_437_184,
            compute_ms=0.1)


def test_fetch_time_fits_the_h200_measurement():
    # profiles/results/expert-fetch-h200.json: 8 experts 1.64 to 1.75 ms, 32 experts 6.43 to 6.55
    assert 1.6 < fetch_ms(8, 9_437_184) < 1.75
    assert 6.4 < fetch_ms(32, 9_437_184) < 6.6
    assert fetch_ms(0, 9_437_184) == 0


def test_distinct_experts_grow_with_tokens_and_stop_at_the_layer():
    assert expected_distinct(128, 8, 1) == 8
    many = [expected_distinct(128, 8, t) for t in (2, 8, 64, 4096)]
    assert many == sorted(many) and 8 < many[0] and many[-1] == pytest.approx(128, abs=1e-6)


def test_a_step_costs_its_misses_and_stays_near_the_missed_bytes_bound():
    hot, cold = predict(tokens=1, hit_rate=0.9, **QWEN), predict(tokens=1, hit_rate=0.1, **QWEN)
    assert hot.misses == pytest.approx(0.8) and cold.misses == pytest.approx(7.2)
    assert hot.step_ms < cold.step_ms < cold.whole_layer_ms
    assert cold.step_ms / cold.bound_ms < 1.3  # the target is reachable by the fetch
    assert predict(tokens=1, hit_rate=1.0, **QWEN).step_ms == pytest.approx(48 * 0.1)
    with pytest.raises(ConfigError, match="0..1"):
        predict(tokens=1, hit_rate=1.5, **QWEN)


def test_the_simulated_hit_rate_follows_skew_and_cache_size():
    uniform, _ = simulate(64, 4, 16, 1, 100, zipf=0.0)
    skewed, _ = simulate(64, 4, 16, 1, 100, zipf=1.2)
    bigger, _ = simulate(64, 4, 32, 1, 100, zipf=1.2)
    assert uniform == pytest.approx(16 / 64, abs=0.1)  # LRU under uniform routing: slots/experts
    assert uniform < skewed < bigger
    assert simulate(64, 4, 64, 1, 50, zipf=0.0)[0] > 0.98  # all fit: only first sightings miss
    with pytest.raises(ConfigError, match="zipf"):
        simulate(8, 2, 4, 1, 1, zipf=-1)


def test_place_experts_prints_the_step_its_bound_and_its_peers(capsys):
    assert main(["place-experts", "--hit-rate", "0.5", "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "hit rate 0.500 (given)" in out and "4.00 fetched per layer" in out
    for name in ("predicted step", "missed-bytes bound", "whole-layer streaming",
                 "all resident"):
        assert name in out
    assert main(["place-experts", "--experts", "16", "--slots", "4", "--top-k", "2",
                 "--steps", "20", "--layers", "2"]) == 0
    assert "simulated over 20 steps" in capsys.readouterr().out
