"""One progress line per status snapshot: the job, then each worker's batch and speed; and a line per rollback."""

from __future__ import annotations

from dynabatch.cluster.worker_labels import labelled
from dynabatch.common.wire.messages import JobStatus, Rollback


def format_progress(status: JobStatus, wall_t: float, show_slowdown: bool = False) -> str:
    """E.g. `[ 42.0s] epoch 1.20/3  loss 0.512  test 84.1%  | worker0(1x) b=110 1450/s  worker1(2x) b=55 720/s`.

    Workers are named and ordered as cluster/worker_labels.py says; an idle one shows why, not its last speed.
    `wall_t` is the run's own clock, which starts before the scheduler's. `show_slowdown`: the run was launched
    emulating slower machines, so every line labels its workers' slowdowns (`labelled`). A task without an accuracy
    metric shows its own metrics instead.
    """
    loss = f"{status.loss:.3f}" if status.loss is not None else "  -  "
    metrics = {k: v for k, v in status.metrics.items() if k != "loss"}
    if status.test_acc is not None:
        test = f"test {100 * status.test_acc:.1f}%"
    elif metrics:
        test = "test " + " ".join(f"{k} {v:.3g}" for k, v in sorted(metrics.items()))
    else:
        test = "test   -  "
    head = f"[{wall_t:6.1f}s] epoch {status.epoch:.2f}/{status.target_epochs:g}  loss {loss}  {test}"
    workers = "  ".join(
        f"{name} idle ({status.workers[wid].idle})"
        if status.workers[wid].idle
        else f"{name} b={status.workers[wid].batch} {status.workers[wid].samples_per_s:.0f}/s"
        for wid, name in labelled(status.workers, show_slowdown)
    )
    tail = "  stopping" if status.stopping and not status.finished else ""
    return f"{head}  | {workers or 'waiting for workers'}{tail}"


def format_rollback(rollback: Rollback) -> str:
    """E.g. `diverged at epoch 0.42 (ps0: parameters not finite ...): rolled back to version 120, lr x0.5`."""
    versions = sorted(set(rollback.versions.values()))
    if len(versions) == 1:
        to = f"version {versions[0]}" if versions[0] >= 0 else "no checkpoint (the model stays)"
    else:
        to = "versions " + ", ".join(f"ps{i} {v}" for i, v in sorted(rollback.versions.items()))
    return f"diverged at epoch {rollback.epoch:.2f} ({rollback.cause}): rolled back to {to}, lr x{rollback.lr_factor:g}"
