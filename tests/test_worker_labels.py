"""Workers in the console, the final table and the plots: their names and slowdowns, in the order given."""

from __future__ import annotations

from pathlib import Path

from dynabatch.cluster.main import format_summary
from dynabatch.cluster.progress import format_progress
from dynabatch.cluster.report import summarize
from dynabatch.cluster.worker_labels import emulated, label, labelled, order_key
from dynabatch.common.wire.messages import JobStatus, WorkerStatus


def _workers(*named: tuple[str, str, str]) -> dict[str, WorkerStatus]:
    return {wid: WorkerStatus(name=name, slowdown=slowdown, batch=64) for wid, name, slowdown in named}


def test_workers_are_listed_by_name_in_launch_order_whatever_order_they_joined_in() -> None:
    workers = _workers(
        ("w0", "worker2", "4x"), ("w1", "worker10", "1x"), ("w2", "worker0", "2x"), ("w3", "worker1", "1x")
    )
    assert labelled(workers) == [
        ("w2", "worker0(2x)"),
        ("w3", "worker1(1x)"),
        ("w0", "worker2(4x)"),
        ("w1", "worker10(1x)"),
    ]


def test_slowdowns_are_left_out_where_nothing_is_emulated_and_a_shared_name_gets_its_id() -> None:
    assert labelled(_workers(("w0", "gpu-b", "1x"), ("w1", "gpu-a", ""))) == [("w1", "gpu-a"), ("w0", "gpu-b")]
    assert labelled(_workers(("w4", "worker0", "1x"), ("w0", "worker0", "2x"))) == [
        ("w0", "worker0(2x)[w0]"),
        ("w4", "worker0(1x)[w4]"),
    ]
    assert not emulated(["1x", ""]) and emulated(["1x", "1x,4x@60s"])
    assert label("worker1", "", True) == "worker1", "a worker that reported no slowdown"
    assert order_key("worker0", "w9") < order_key("worker0", "w10") < order_key("worker1", "w0")


def test_the_progress_line_names_each_worker_with_its_slowdown_in_launch_order() -> None:
    status = JobStatus(
        t=3.0,
        epoch=0.5,
        target_epochs=1.0,
        workers=_workers(("w0", "worker1", "2x"), ("w1", "worker2", "4x"), ("w2", "worker0", "1x")),
    )
    line = format_progress(status, 4.0)
    assert line.endswith("| worker0(1x) b=64 0/s  worker1(2x) b=64 0/s  worker2(4x) b=64 0/s"), line
    last = JobStatus(t=9.0, epoch=1.0, target_epochs=1.0, workers=_workers(("w2", "worker0", "1x")))
    assert format_progress(last, 10.0, show_slowdown=True).endswith("| worker0(1x) b=64 0/s"), (
        "the 1x worker left alone at the end keeps the label the run's launch gave it"
    )
    assert format_progress(last, 10.0).endswith("| worker0 b=64 0/s"), "a job that emulates nothing shows no 1x"


def test_summary_json_and_the_final_table_keep_the_same_order_and_give_the_slowdowns() -> None:
    timeline = [JobStatus(t=t, workers=_workers(("w0", "worker1", "2x"), ("w1", "worker0", "1x"))) for t in (1.0, 2.0)]
    summary = summarize(timeline, wall_s=3.0, warmup_fraction=0.0)
    assert [(w["name"], w["slowdown"]) for w in summary["workers"].values()] == [("worker0", "1x"), ("worker1", "2x")]
    rows = [line.split()[:3] for line in format_summary(summary, Path("runs/r")).splitlines() if "batch" in line]
    assert rows == [["worker0(1x)", "id", "w1"], ["worker1(2x)", "id", "w0"]]
