"""`dynabatch plan`'s figure: each method's predicted time to target as a bar, T* as a line across them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from dynabatch.common.atomic_file import write_atomic
from dynabatch.common.planning.optimum import Optimum
from dynabatch.common.planning.prediction import Prediction


def write_plan_plot(
    path: Path, title: str, predictions: Sequence[Prediction], star: Optimum, chosen: Prediction
) -> None:
    """Bars fastest first, the chosen method's filled; made without pyplot, as the run folder's plots are."""
    fig = Figure(figsize=(7, 0.5 * len(predictions) + 1.6))
    ax = fig.add_subplot()
    names = [f"{p.protocol} + {p.policy}" for p in predictions]
    ax.barh(
        names,
        [p.time_s for p in predictions],
        color=["tab:blue" if p == chosen else "lightsteelblue" for p in predictions],
    )
    ax.axvline(
        star.time_s,
        color="black",
        linestyle="--",
        label=f"T* = {star.time_s:.3g} s ({star.workers} fastest workers, batch {star.batch} each)",
    )
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("predicted seconds to target (log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))
