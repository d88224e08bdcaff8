"""bench/links.py's pure parts: the figures from what was read, the time to target, the order of runs, the table."""

from __future__ import annotations

import pytest

from bench.links import Watch, WorkerFigures, figures, first_reaching, link_allows, rate_mbit, schedule, table


def test_each_worker_gets_its_samples_per_second_share_batch_and_steps_over_the_span() -> None:
    watch = Watch(
        elapsed_s=10.0,
        start={"fast-0": (100.0, 5.0, 1.0), "slow-0": (50.0, 2.0, 0.5)},
        end={"fast-0": (700.0, 35.0, 2.5), "slow-0": (450.0, 6.0, 0.5)},
        batches={"fast-0": [16.0, 24.0, 20.0], "slow-0": [96.0, 104.0]},
    )
    job, (fast, slow) = figures(watch, [("fast-0", "1gbit"), ("slow-0", "100mbit")], {"slow-0": 410.0})
    assert job == pytest.approx(100.0)  # 600 + 400 samples in 10 s
    assert (fast.samples_per_s, fast.share, fast.mean_batch, fast.last_batch, fast.steps_per_s) == pytest.approx(
        (60.0, 0.6, 20.0, 20.0, 3.0)
    )
    assert (slow.host, slow.rate, slow.standalone_sps) == ("slow-0", "100mbit", 410.0)
    assert (slow.share, slow.mean_batch) == pytest.approx((0.4, 100.0))
    assert fast.standalone_sps == 0.0, "a worker whose log never said its speed"
    assert fast.compute_sps == pytest.approx(400.0), "600 samples in 1.5 s of compute and data"
    assert slow.compute_sps == 0.0, "no compute time reported over the span"


def test_a_span_in_which_nothing_trained_has_no_shares_rather_than_a_division_by_zero() -> None:
    watch = Watch(5.0, {"w": (10.0, 1.0, 0.0)}, {"w": (10.0, 1.0, 0.0)}, {"w": []})
    job, (w,) = figures(watch, [("w", "1gbit")], {})
    assert (job, w.share, w.mean_batch, w.last_batch) == (0.0, 0.0, 0.0, 0.0)


def test_the_time_to_target_is_the_first_reading_at_or_above_it() -> None:
    readings = [(1.0, 0.0), (6.0, 0.62), (11.0, 0.86), (16.0, 0.84), (21.0, 0.9)]
    assert first_reaching(readings, 0.85) == 11.0
    assert first_reaching(readings, 0.86) == 11.0
    assert first_reaching(readings, 0.95) is None
    assert first_reaching([], 0.5) is None


def test_policies_alternate_their_order_run_by_run() -> None:
    assert schedule(["dynamic", "fixed"], 3) == [
        (1, "dynamic"),
        (1, "fixed"),
        (2, "fixed"),
        (2, "dynamic"),
        (3, "dynamic"),
        (3, "fixed"),
    ]


def test_the_table_gives_the_time_to_target_or_what_was_reached_instead() -> None:
    worker = {
        "host": "slow-0",
        "rate": "100mbit",
        "samples_per_s": 301.4,
        "share": 0.251,
        "mean_batch": 87.4,
        "last_batch": 88.0,
        "steps_per_s": 3.91,
        "standalone_sps": 410.0,
        "compute_sps": 395.2,
    }
    reached = {
        "run": 1,
        "policy": "dynamic",
        "span_s": 73.2,
        "samples_per_s": 1201.0,
        "workers": [worker],
        "target": 0.85,
        "time_to_target_s": 73.2,
        "accuracy": 0.853,
    }
    missed = reached | {"run": 2, "policy": "fixed", "span_s": 300.4, "time_to_target_s": None, "accuracy": 0.842}
    window = {"run": 1, "policy": "fixed", "span_s": 40.0, "samples_per_s": 900.0, "workers": [worker]}
    text = table([reached, missed, window])
    assert "| 1 | dynamic | job | | 73 | 1201 | 100% | | | | | |" in text
    assert "| 2 | fixed | job | | not in 300 (reached 84.2%) | 1201 | 100% |" in text
    assert "| 1 | fixed | job | | | 900 | 100% |" in text
    assert "| 1 | dynamic | slow-0 | 100mbit | | 301 | 25.1% | 87 | 88 | 3.91 | 410 | 395 |" in text


def test_tc_rates_read_in_mbit_and_a_bad_one_is_refused() -> None:
    assert (rate_mbit("100mbit"), rate_mbit("1gbit"), rate_mbit("512kbit")) == pytest.approx((100.0, 1000.0, 0.512))
    with pytest.raises(ValueError, match="kbit, mbit or gbit"):
        rate_mbit("100 Mbps")


def _worker(rate: str, compute_sps: float) -> WorkerFigures:
    return WorkerFigures("w", rate, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, compute_sps)


def test_what_a_slow_link_allows_is_its_batch_over_compute_plus_the_model_twice_over_the_link() -> None:
    # 1 MB each way at 100 Mbit/s is 80 ms a transfer; B = 192 split 64 each (fixed), 64 samples at 1000/s = 64 ms.
    workers = [_worker("1gbit", 1000.0), _worker("1gbit", 1000.0), _worker("100mbit", 1000.0)]
    shares = link_allows(workers, "asgd", "fixed", 1e6, 1 << 20)
    fast, slow = 64 / (0.064 + 0.016), 64 / (0.064 + 0.160)
    assert shares == pytest.approx([fast / (2 * fast + slow)] * 2 + [slow / (2 * fast + slow)])
    equal = link_allows([_worker("1gbit", 1000.0)] * 3, "asgd", "fixed", 1e6, 1 << 20)
    assert equal == pytest.approx([1 / 3] * 3), "equal links, equal compute: equal shares"
