"""The benchmark's PNG plots, each drawn from the results dictionary alone (so they can be redrawn)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure

matplotlib.use("Agg")  # before pyplot is imported (ruff allows the imports after this call)
import matplotlib.pyplot as plt

from bench.convergence import config_label

# pyplot is exported with the Agg backend chosen: the studies draw with it (bench/simulate_study.py, tuned_study.py).
__all__ = ["accuracy_axis", "batches", "curves", "overlap", "plt", "save", "scale", "styled", "transport"]


def save(fig: Figure, axes: list[Axes], title: str, path: Path) -> Path:
    """Grid and legend on every axis, the title, and the PNG."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _colors(runs: list[dict[str, Any]]) -> dict[str, Any]:
    labels = list(dict.fromkeys(config_label(r["protocol"], r["policy"]) for r in runs))
    cmap = plt.get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def styled(
    runs: list[dict[str, Any]], alpha: float = 0.8, linewidth: float = 1.2
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Each run with its line's style: one colour per configuration, labelled on its first line only."""
    colors = _colors(runs)
    labelled: set[str] = set()
    for r in runs:
        label = config_label(r["protocol"], r["policy"])
        yield (
            r,
            {
                "color": colors[label],
                "alpha": alpha,
                "linewidth": linewidth,
                "label": None if label in labelled else label,
            },
        )
        labelled.add(label)


def accuracy_axis(ax: Axes, xlabel: str, ylim: tuple[float, float]) -> None:
    """Test accuracy in percent, with the benchmark's targets (85% and 88%) as dotted lines."""
    for mark in (85, 88):
        ax.axhline(mark, color="grey", linestyle=":", linewidth=0.8)
    ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)")


def curves(runs: list[dict[str, Any]], title: str, path: Path) -> Path:
    """Test accuracy and training loss against time, every run on one chart, one colour per configuration."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    for r, kw in styled(runs):
        if r["accuracy_curve"]:
            t, acc = zip(*r["accuracy_curve"], strict=True)
            ax1.plot(t, [100 * a for a in acc], **kw)
        if r["loss_curve"]:
            t, loss = zip(*r["loss_curve"], strict=True)
            ax2.plot(t, loss, **kw)
    accuracy_axis(ax1, "seconds of training", (60, 95))
    ax2.set_xlabel("seconds of training")
    ax2.set_ylabel("training loss (smoothed)")
    ax2.set_yscale("log")
    return save(fig, [ax1], title, path)


def batches(runs: list[dict[str, Any]], title: str, path: Path) -> Path:
    """Per-worker batch sizes against time for one run of each dynamic configuration given."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        if r["batches"]:
            t = [row[0] for row in r["batches"]]
            for w in range(1, len(r["batches"][0])):
                ax.step(
                    t,
                    [row[w] if w < len(row) else float("nan") for row in r["batches"]],
                    where="post",
                    label=f"worker{w - 1} (slowdown {r['slowdowns'][w - 1]})",
                )
        ax.set_title(config_label(r["protocol"], r["policy"]), fontsize=10)
        ax.set_xlabel("seconds of training")
        ax.set_ylabel("batch size")
    return save(fig, list(axes[0]), title, path)


def transport(results: list[dict[str, Any]], path: Path) -> Path:
    """Pull + push throughput of dynabatch and of the raw ZeroMQ ceilings against model size (1 MiB chunks, 1 shard)."""
    rows = sorted((r for r in results if r["shards"] == 1 and r["chunk_bytes"] == 1 << 20), key=lambda r: r["params"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["params"] for r in rows]
    ax.plot(x, [r["dynabatch"]["mb_per_s"] for r in rows], "o-", label="dynabatch (scheduler + shard)")
    ax.plot(x, [r["raw"]["mb_per_s"] for r in rows], "s--", label="raw ZeroMQ (ceiling)")
    for key, style, label in (
        ("push_pull", "o-", "dynabatch, push+pull in one round trip"),
        ("raw_sgd", "s:", "raw ZeroMQ applying SGD (ceiling with the arithmetic)"),
    ):
        if all(r.get(key) for r in rows):
            ax.plot(x, [r[key]["mb_per_s"] for r in rows], style, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("MB/s of pull + push payload")
    return save(fig, [ax], "Transport: pull + push throughput on 127.0.0.1 (1 MiB chunks, 1 shard)", path)


def scale(results: list[dict[str, Any]], path: Path) -> Path:
    """Shard updates/s and decision latency against the number of light workers, one line per shard count."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for shards in sorted({r["shards"] for r in results}):
        rows = sorted(
            (r for r in results if r["shards"] == shards and r["updates_per_s"] is not None), key=lambda r: r["workers"]
        )
        w = [r["workers"] for r in rows]
        ax1.plot(w, [r["worker_steps_per_s"] for r in rows], "o-", label=f"{shards} shard(s)")
        ax2.plot(w, [1e3 * r["decision_p99_s"] for r in rows], "o-", label=f"{shards} shard(s)")
    ax1.set_xlabel("light workers")
    ax1.set_ylabel("model updates/s (worker pushes)")
    ax2.set_xlabel("light workers")
    ax2.set_ylabel("scheduler decision p99 (ms)")
    return save(fig, [ax1, ax2], "Scale: many light workers against 1-4 shards", path)


def overlap(entries: list[dict[str, Any]], path: Path) -> Path:
    """The fraction of compute-only speed per variant (bars) for each workload and configuration (groups)."""
    groups = list(dict.fromkeys((e["workload"], e["run"]["protocol"]) for e in entries))
    variants = list(dict.fromkeys(e["variant"] for e in entries))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(groups)), 4.5))
    for i, variant in enumerate(variants):
        kept = {
            (e["workload"], e["run"]["protocol"]): e["run"]["fraction_of_compute"]
            for e in entries
            if e["variant"] == variant and e["run"]["ok"]
        }
        at = [g for g in range(len(groups)) if groups[g] in kept]
        ax.bar(
            [g + (i - (len(variants) - 1) / 2) * width for g in at],
            [100 * kept[groups[g]] for g in at],
            width,
            label=variant,
        )
    ax.set_xticks(range(len(groups)), [f"{w}\n{p}".replace(" ", "\n") for w, p in groups], fontsize=7)
    ax.set_ylabel("% of compute-only speed")
    ax.set_ylim(50, 100)
    return save(fig, [ax], "Communication off the critical path: fraction of compute-only speed kept", path)
