"""The benchmark report in Markdown, rendered from the results dictionary alone.

`python -m bench --report-only DIR` re-renders DIR/report.md (and the plots)
from DIR/results.json, so wording can change without re-running anything.
"""

from __future__ import annotations

from typing import Any

from bench import peers, transport
from bench.convergence import config_label, mark_label, time_marks
from bench.verdicts import Verdict, paper_claims, targets


def _f(x: float | None, fmt: str, scale: float = 1.0, none: str = "–") -> str:
    return none if x is None else format(x * scale, fmt)


def _secs(t: float | None) -> str:
    return "–" if t is None else f"{t:.0f} s"


def verdict_table(verdicts: list[Verdict]) -> str:
    rows = ["| claim | measured | agrees |", "|---|---|---|"]
    rows += [f"| {v.claim} | {v.measured} | **{v.word}** |" for v in verdicts]
    return "\n".join(rows)


def _time_columns(marks: tuple[str, ...]) -> tuple[str, str]:
    """The header cells and alignment cells of the time-to columns: each accuracy mark, then the target if any."""
    return "".join(f"time to {mark_label(m)} | " for m in marks), "---:|" * len(marks)


def convergence_table(configs: list[dict[str, Any]]) -> str:
    marks = time_marks(c["time_to"] for c in configs)
    heads, aligns = _time_columns(marks)
    rows = [
        f"| configuration | runs | {heads}test acc. at budget | train loss | samples/s | "
        "of compute-only / probed speed | staleness mean / p99 | bytes/sample |",
        f"|---|---:|{aligns}---:|---:|---:|---:|---:|---:|",
    ]
    for c in configs:
        times = ""
        for mark in marks:
            t, n = c["time_to"].get(mark), c["reached"].get(mark, 0)
            times += (f"{t:.0f} s ({n}/{c['ok_runs']})" if t is not None else f"– (0/{c['ok_runs']})") + " | "
        acc = _f(c["final_test_acc"], ".2f", 100) + "%"
        if c["final_test_acc_sd"] is not None:
            acc += f" ± {100 * c['final_test_acc_sd']:.2f}"
        rows.append(
            f"| {c['label']} | {c['ok_runs']}/{c['runs']} | {times}{acc} | "
            f"{_f(c['final_train_loss'], '.3f')} | {_f(c['samples_per_s'], ',.0f')} | "
            f"{_f(c['fraction_of_compute'], '.0f', 100)}% / {_f(c['fraction_of_standalone'], '.0f', 100)}% | "
            f"{_f(c['staleness_mean'], '.2f')} / {_f(c['staleness_p99'], '.1f')} | "
            f"{_f(c['bytes_per_sample'], ',.0f')} |"
        )
    return "\n".join(rows)


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Every run on its own line, inside a collapsed block (the table above is their means)."""
    marks = time_marks(r["time_to"] for r in runs)
    heads, aligns = _time_columns(marks)
    rows = [
        "<details><summary>Every run</summary>",
        "",
        f"| configuration | seed | {heads}test acc. | train loss | samples/s | "
        "of compute-only / probed | staleness mean / p99 | bytes/sample |",
        f"|---|---:|{aligns}---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        label = config_label(r["protocol"], r["policy"])
        if r["final_test_acc"] is None:
            rows.append(f"| {label} | {r['seed']} | failed: {r['error']} |" + " |" * (len(marks) + 5))
            continue
        times = "".join(f"{_secs(r['time_to'].get(m))} | " for m in marks)
        rows.append(
            f"| {label} | {r['seed']} | {times}{100 * r['final_test_acc']:.2f}% | "
            f"{_f(r['final_train_loss'], '.3f')} | {_f(r['samples_per_s'], ',.0f')} | "
            f"{_f(r['fraction_of_compute'], '.0f', 100)}% / {_f(r['fraction_of_standalone'], '.0f', 100)}% | "
            f"{_f(r['staleness_mean'], '.2f')} / {_f(r['staleness_p99'], '.0f')} | "
            f"{_f(r['bytes_per_sample'], ',.0f')} |"
        )
    return "\n".join(rows + ["", "</details>"])


def scale_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| light workers | shards | shard updates/s | model updates/s | decision mean | decision p99 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["updates_per_s"] is None:
            out.append(f"| {r['workers']} | {r['shards']} | failed: {r['error']} | | | |")
            continue
        out.append(
            f"| {r['workers']} | {r['shards']} | {r['updates_per_s']:,.0f} | {r['worker_steps_per_s']:,.0f} | "
            f"{1e6 * r['decision_mean_s']:,.0f} µs | {1e6 * r['decision_p99_s']:,.0f} µs |"
        )
    return "\n".join(out)


def render(results: dict[str, Any], img: str) -> str:
    """The whole report; `img` is the prefix of the plots' paths as the Markdown file sees them."""
    s = results["settings"]
    m = results["machine"]
    het = results.get("heterogeneous")
    mid = results.get("midrun")
    ddp = results.get("ddp")
    lines = [
        "# dynabatch benchmarks",
        "",
        f"Mode **{results['mode']}**, run {results['started']} in {results['wall_s'] / 60:.1f} minutes on "
        f"{m['cpus']} CPUs ({m['platform']}, Python {m['python']}, torch {m['torch']}, libzmq {m['libzmq']}).",
        f"Command: `{results['command']}` (from the repository root).",
        "",
        "Everything runs on this one machine over 127.0.0.1: every process is real (scheduler, shards, workers, "
        "evaluator), and heterogeneity is emulated with `--slowdown` (a worker at F idles F-1 times the CPU time of "
        "each compute step). On 2 cores the workers also contend for CPU, which is part of what is measured: "
        "every run measures its workers' own speeds itself (see section 1).",
        "",
        "## Targets, as measured",
        "",
    ]
    runs = het["runs"] if het else []
    interval = s["convergence"]["eval_interval_s"]
    lines += [verdict_table(targets(runs, ddp, interval)), ""]
    lines += [
        "## The papers' claims",
        "",
        "DBS-SGD (performance-aware dynamic batch size SGD) against ASGD and n-softsync, LB-BSP against "
        "synchronous SGD, and the multi-step delay parameter update against SSGD and local SGD, all from the "
        "heterogeneous runs below at equal wall-clock time. Rules are fixed in `bench/verdicts.py`: means over "
        'seeds, times as medians over seeds with a mark never reached counting as never, "sooner" only by more '
        'than the evaluation interval, "accuracy kept" within one point, "speed kept" at 95%.',
        "",
        verdict_table(paper_claims(runs, interval)),
        "",
    ]
    if het:
        lines += [
            "## 1. Convergence under heterogeneity",
            "",
            f"Fashion-MNIST, the CNN (215,370 parameters), 4 workers with slowdowns 1, 1, 2, 4, one shard, global "
            f"batch 192, {s['convergence']['budget_s']:.0f} s of training per run (`--time-budget-s`), seeds "
            f"{', '.join(map(str, s['convergence']['seeds']))}, the model evaluated on the 10k test images every "
            f"{s['convergence']['eval_interval_s']:g} s. Times count from the first batches. Staleness is in shard "
            "versions per update; bytes are tensor bytes both ways.",
            "",
            "Samples/s is given as a fraction of two sums of the workers' own speeds, both measured in the same run. "
            "*Compute-only* is each worker's samples over its seconds of forward and backward (slowdown included) "
            "during training: what it does alone under the same CPU contention, so the fraction is the time the "
            "protocol does not spend communicating or waiting. *Probed* is the speed each worker measured at "
            "start-up, while the other processes were starting too; on 2 cores shared by 4 workers, a shard and "
            "an evaluator these probes swing by 2x from run to run, so targets use the compute-only figure.",
            "",
            convergence_table(het["configs"]),
            "",
            runs_table(het["runs"]),
            "",
            f"![accuracy and loss against time]({img}heterogeneous.png)",
            "",
        ]
    if mid:
        lines += [
            "## 2. A node that slows down mid-run",
            "",
            f"As above (seed {s['midrun']['seeds'][0]}), but worker 0 runs at 1x, then at 4x from a third of the "
            "budget, then at 1x again from two thirds. Dynamic batches re-measure speed and move its share away "
            "and back; fixed batches cannot.",
            "",
            convergence_table(mid["configs"]),
            "",
            runs_table(mid["runs"]),
            "",
            f"![accuracy and loss against time]({img}midrun.png)",
            "",
            f"![batch sizes against time]({img}midrun_batches.png)",
            "",
        ]
    if results.get("transport"):
        lines += [
            "## 3. Transport",
            "",
            "One pull of every parameter plus one push of a same-sized gradient per step against a real scheduler "
            "and shard(s), and against raw ZeroMQ (ROUTER/DEALER, one zero-copy buffer per message, no codec) in "
            "alternating blocks within one run; medians per step, MB = 10^6 bytes of payload.",
            "",
            transport.table([transport.SizeResult.from_dict(r) for r in results["transport"]]),
            "",
            f"![transport throughput]({img}transport.png)",
            "",
        ]
    if ddp:
        st = ddp["settings"]
        lines += [
            "### Synchronous training step against DDP",
            "",
            f"{st['workers']} homogeneous workers, the CNN on Fashion-MNIST, per-worker batch "
            f"{st['global_batch'] // st['workers']}, one torch thread each, {st['duration_s']:.0f} s per side, "
            f"{st['rounds']} alternating rounds. dynabatch: ssgd with fixed batches through one shard; DDP: "
            "torch.distributed gloo all-reduce.",
            "",
            "| round | dynabatch ssgd step | DDP/gloo step |",
            "|---:|---:|---:|",
        ]
        for i, r in enumerate(ddp["rounds"], 1):
            lines.append(f"| {i} | {_f(r['dynabatch_step_s'], '.1f', 1e3)} ms | {_f(r['ddp_step_s'], '.1f', 1e3)} ms |")
        lines += ["", f"Speed ratio (DDP step / dynabatch step): **{_f(ddp['speed_ratio'], '.2f')}**.", ""]
    if results.get("scale"):
        lines += [
            "## 4. Scale",
            "",
            "Light workers speak the whole protocol (heartbeats that drive the speed model and allocation, pulls and "
            "pushes of every chunk of a 200k-parameter model in 13 chunks) but compute nothing; several share a "
            "driver process. Updates are counted by the shards over a window once every worker trains; a model "
            "update is one worker push, a shard update its part on one shard. Decision latency is the scheduler's "
            "time to handle a heartbeat (speed-model fit and allocation included).",
            "",
            scale_table(results["scale"]),
            "",
            f"![scale]({img}scale.png)",
            "",
        ]
    if results.get("peers"):
        lines += [
            "## Against what you would use instead: DDP, hivemind, the fastest machine alone",
            "",
            peers.render(results["peers"], img),
        ]
    lines += [
        "## Reproduce",
        "",
        "```",
        "make bench            # full mode, this report",
        "make bench-quick      # under 10 minutes",
        "python -m bench --help",
        "```",
        "",
    ]
    return "\n".join(lines)


KEEP_MARK = "<!-- kept by python -m bench --publish -->"


def _sections(text: str) -> list[tuple[str, str]]:
    """`text` cut before each `## ` heading: (heading, the section's text); the preamble's heading is ''."""
    sections: list[tuple[str, str]] = [("", "")]
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            sections.append((line.strip(), ""))
        heading, body = sections[-1]
        sections[-1] = (heading, body + line)
    return sections


def carry_over(previous: str, fresh: str) -> str:
    """`fresh` with the sections of `previous` that hold KEEP_MARK: those measured by commands of their own
    (a protocol added later, the overlap variants, the simulator), which this run did not redo.

    Each goes back after the section it followed, or before Reproduce if that section is gone.
    """
    kept: dict[str, list[str]] = {}
    anchor = ""
    for heading, body in _sections(previous):
        if KEEP_MARK in body:
            kept.setdefault(anchor, []).append(body)
        else:
            anchor = heading
    fresh_sections = _sections(fresh)
    headings = {heading for heading, _ in fresh_sections}
    orphans = [body for heading, bodies in kept.items() if heading not in headings for body in bodies]
    out: list[str] = []
    for heading, body in fresh_sections:
        if heading == "## Reproduce":
            out += orphans
            orphans = []
        out.append(body)
        out += kept.get(heading, [])
    return "".join(out + orphans)
