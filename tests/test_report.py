"""summary.json from a timeline of STATUS snapshots: throughput, time to accuracy, staleness."""

from __future__ import annotations

import pytest

from dynabatch.cluster.report import summarize, time_to_accuracy


def _snap(t: float, samples: int, training_t: float | None, stopping: bool = False, acc: float | None = None,
          eval_t: float | None = None, staleness: list[int] | None = None) -> dict:
    worker = {"name": "worker0", "batch": 64, "standalone_sps": 1000.0, "samples": samples,
              "observed_steps": samples // 64, "step_s_total": samples / 64 * 0.05,
              "observed_samples": samples, "compute_s_total": samples / 1250}
    return {"t": t, "epoch": samples / 60000, "samples": samples, "loss": 0.5, "test_acc": acc, "test_loss": 0.4,
            "eval_t": eval_t, "training_t": training_t, "stopping": stopping, "finished": stopping,
            "bytes": samples * 100, "staleness": staleness or [], "workers": {"w0": worker}}


def test_throughput_counts_from_the_first_batches_to_the_stop():
    timeline = [
        _snap(1.0, 0, None),  # registered, probing its speed: not training yet
        _snap(4.0, 0, 0.0),
        _snap(9.0, 4000, 5.0, acc=0.80, eval_t=8.5),
        _snap(14.0, 8000, 10.0, stopping=True, acc=0.86, eval_t=13.0, staleness=[10, 80, 10]),
        _snap(20.0, 8100, 16.0, stopping=True, acc=0.87, eval_t=19.5, staleness=[10, 80, 10]),  # final eval
    ]
    s = summarize(timeline, wall_s=21.0, warmup_fraction=0.0)
    assert s["train_s"] == pytest.approx(10.0)
    assert s["samples_per_s"] == pytest.approx(800.0)
    assert s["fraction_of_standalone"] == pytest.approx(0.8)
    assert s["workers"]["w0"]["compute_samples_per_s"] == pytest.approx(1250.0)
    assert s["fraction_of_compute_speed"] == pytest.approx(800.0 / 1250.0)
    assert s["time_to_accuracy_s"] == {"0.85": pytest.approx(9.0), "0.88": None}
    assert s["staleness_mean"] == pytest.approx(1.0) and s["staleness_p99"] == 2 and s["updates"] == 100
    assert s["final_test_acc"] == 0.87


def test_time_to_accuracy_is_none_before_training_starts():
    assert time_to_accuracy([_snap(1.0, 0, None, acc=0.9, eval_t=1.0)], (0.85,)) == {"0.85": None}
