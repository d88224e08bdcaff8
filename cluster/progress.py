"""One progress line per status snapshot: the job, then each worker's batch and speed."""

from __future__ import annotations

from typing import Any


def format_progress(state: dict[str, Any]) -> str:
    """E.g. `[ 42.0s] epoch 1.20/3  loss 0.512  test 84.1%  | w0 b=110 1450/s  w1 b=55 720/s`."""
    loss = f"{state['loss']:.3f}" if state.get("loss") is not None else "  -  "
    metrics = {k: v for k, v in (state.get("metrics") or {}).items() if k != "loss"}
    if state.get("test_acc") is not None:
        test = f"test {100 * state['test_acc']:.1f}%"
    elif metrics:
        test = "test " + " ".join(f"{k} {v:.3g}" for k, v in sorted(metrics.items()))
    else:
        test = "test   -  "
    head = (f"[{state.get('wall_t', state['t']):6.1f}s] epoch {state['epoch']:.2f}/{state['target_epochs']:g}"
            f"  loss {loss}  {test}")
    workers = "  ".join(
        f"{wid} b={w['batch']} {w['samples_per_s']:.0f}/s" for wid, w in sorted(state.get("workers", {}).items())
    )
    tail = "  stopping" if state.get("stopping") and not state.get("finished") else ""
    return f"{head}  | {workers or 'waiting for workers'}{tail}"
