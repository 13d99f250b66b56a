from __future__ import annotations

import pytest

from compactor.bench.ingest import run


@pytest.mark.slow
def test_quick_ingest_bench_reports_every_measurement() -> None:
    messages: list[str] = []
    result = run(quick=True, progress=messages.append)
    assert result["events_per_s"] > 0 and result["baseline_events_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["events_per_s"] / result["baseline_events_per_s"], abs=0.01)
    assert 0 < result["p99_turn_end_to_enqueue_ms"] < 1000
    assert result["latency_load_events_per_s"] > 0  # half of the drain rate measured again right before
    assert 0 < result["cost_ratio_long_vs_short"] < 3
    assert len(messages) == 6  # baseline, watcher, drain rate again, latency (running, cold), long vs short
    assert 0 < result["p99_cold_start_ms"] < 5000
