"""`dynabatch plan RUN_FOLDER` or `dynabatch plan --profile FILE.json`: each method's predicted time to target on a
measured cluster against T*, the method `auto` would choose and why, and a plot.

The cluster comes from a run folder (each worker's steps as `dynabatch run` measured them, cluster/run_profile.py)
or from a cluster file (`dynabatch check --save-profile` writes one per machine probed). The predictions are
common/planning/prediction.py's model, whose limits its docstring states: they rank methods, they are not measurements.
A cluster that cannot be read exits 2 naming why.
"""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from dynabatch.cluster.options import PlanOptions
from dynabatch.cluster.run_profile import RunFolderError, read_run
from dynabatch.common.config import JobConfig
from dynabatch.common.flags import ConfigError, FlagParser, add_flags, from_args, given
from dynabatch.common.planning.auto_choice import Choice, choose
from dynabatch.common.planning.cluster_file import ClusterFileError, read_cluster
from dynabatch.common.planning.optimum import NoiseScale, Optimum
from dynabatch.common.planning.prediction import PROTOCOLS, Cluster, Prediction, cluster_of, optimum, predict_all
from dynabatch.common.planning.protocol_switch import SWITCHABLE
from dynabatch.common.protocols import PROTOCOLS as ALL_PROTOCOLS

NOT_MODELLED = tuple(p for p in ALL_PROTOCOLS if p not in PROTOCOLS)

# The job's settings a plan reads: its B, the wire's chunks and the local protocol's steps, and the model and
# dataset that size what moves. Every method is predicted, so --protocol and --batch-policy are not among them, nor
# is anything that does not change a prediction; a flag plan would ignore is refused.
JOB_FLAGS = ("global_batch", "chunk_bytes", "local_steps", "model", "dataset")


def _measured(
    run_dir: Path | None, opts: PlanOptions, flags: JobConfig, args: Namespace
) -> tuple[Cluster, str, tuple[str, ...], Path]:
    """The cluster, its name, the reader's notes and the default plot path.

    A run folder is planned at the settings it ran with, and a cluster file at the file's global batch and model
    bytes where it names them; a flag given here (on the command line or in the environment) wins over either, as
    it does in the simulator and in `dynabatch run --cluster-profile`. A file without `model_bytes` moves the job's
    --model, as the simulator does, so that its links count."""
    if opts.profile:
        file, job, notes, plot = read_cluster(opts.profile), flags, [], Path(opts.profile).with_suffix(".plan.png")
        if not file.model_bytes:
            from dynabatch.common.tasks.models import model_wire_bytes  # torch's import: only where a model is built

            file = replace(file, model_bytes=model_wire_bytes(job))
            notes.append(
                f"model_bytes: the file names none, so the job's --model {job.model}'s, {file.model_bytes:,} bytes"
            )
    else:
        assert run_dir is not None
        run = read_run(run_dir)
        file, notes, plot = run.cluster, list(run.notes), run_dir / "plan.png"
        job = replace(run.job, **{k: getattr(flags, k) for k in JOB_FLAGS if given(args, k)})
    if file.global_batch and given(args, "global_batch") and file.global_batch != job.global_batch:
        notes.append(f"global batch {job.global_batch} (--global-batch), not the cluster's {file.global_batch}")
        file = replace(file, global_batch=job.global_batch)
    cluster = replace(cluster_of(file, job.global_batch, job.chunk_bytes, job.min_batch), local_steps=job.local_steps)
    return cluster, file.name, tuple(notes), plot


def _report(
    name: str,
    cluster: Cluster,
    noise: NoiseScale,
    star: Optimum,
    ranked: list[Prediction],
    choice: Choice,
    at_run_time: Choice,
    notes: Sequence[str],
    plot: Path,
) -> dict[str, Any]:
    return {
        "cluster": name,
        "workers": len(cluster.nodes),
        "global_batch": cluster.global_batch,
        "model_bytes": cluster.model_bytes,
        "nodes": [
            {
                "fixed_s": n.device.fixed_s,
                "per_sample_s": n.device.per_sample_s,
                "max_batch": n.device.max_batch,
                "link_mbit": n.link_mbit,
            }
            for n in cluster.nodes
        ],
        "noise_scale": {"k_min": noise.k_min, "b_noise": noise.b_noise},
        "optimum": {"time_s": star.time_s, "workers": star.workers, "batch": star.batch},
        "methods": [
            {
                "protocol": p.protocol,
                "policy": p.policy,
                "time_s": p.time_s,
                "ratio_to_optimum": p.time_s / star.time_s,
                "samples_per_s": p.samples_per_s,
                "effective_batch": p.effective_batch,
                "staleness": p.staleness,
                "discarded": p.discarded,
                "startup_s": p.startup_s,
                "batches": list(p.batches),
            }
            for p in ranked
        ],
        "chosen": {"protocol": choice.protocol, "policy": choice.policy, "reason": choice.reason},
        "chosen_at_run_time": {
            "protocol": at_run_time.protocol,
            "policy": at_run_time.policy,
            "reason": at_run_time.reason,
            "among": list(SWITCHABLE),
        },
        "not_modelled": list(NOT_MODELLED),
        "notes": list(notes),
        "plot": str(plot),
    }


def _seconds(s: float) -> float:
    """A predicted duration as printed: a rounding error's 4e-19 s is 0."""
    return s if abs(s) >= 1e-9 else 0.0


def _text(report: dict[str, Any]) -> str:
    star, noise = report["optimum"], report["noise_scale"]
    lines = [
        f"cluster: {report['cluster']}, {report['workers']} workers at the start, global batch "
        f"{report['global_batch']}, model {report['model_bytes'] / 1e6:.3g} MB on the wire",
        f"K(B) = {noise['k_min']:g} (1 + {noise['b_noise']:g} / B) steps to target (--k-min, --b-noise: "
        "the default is the study's MLP on Fashion-MNIST to 80%; measure your task's with "
        "bench/steps_to_target.py)",
        f"T* = {star['time_s']:.3g} s (compute only: the {star['workers']} fastest workers, "
        f"{star['batch']} samples each per step)",
        f"{'method':<22} {'predicted s':>12} {'x T*':>7} {'samples/s':>11} {'stale':>6} {'discarded':>9} "
        f"{'start-up s':>10}",
    ]
    lines += [
        f"{m['protocol'] + ' + ' + m['policy']:<22} {m['time_s']:>12.3g} {m['ratio_to_optimum']:>7.2f} "
        f"{m['samples_per_s']:>11,.0f} {m['staleness']:>6.1f} {m['discarded']:>9.0%} {_seconds(m['startup_s']):>10.3g}"
        for m in report["methods"]
    ]
    chosen, at_run = report["chosen"], report["chosen_at_run_time"]
    lines.append(f"chosen: {chosen['reason']} (as --protocol auto --cluster-profile chooses)")
    if (at_run["protocol"], at_run["policy"]) != (chosen["protocol"], chosen["policy"]):
        among = ", ".join(at_run["among"])
        lines.append(f"chosen at run time (--protocol auto alone, among {among}): {at_run['reason']}")
    lines.append(f"not modelled: {', '.join(report['not_modelled'])} (common/planning/prediction.py says why)")
    lines += [f"note: {n}" for n in report["notes"]]
    lines.append(f"plot: {report['plot']}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = FlagParser("dynabatch plan", __doc__)
    parser.add_argument(
        "run_dir",
        metavar="RUN_FOLDER",
        type=Path,
        nargs="?",
        help="a run folder written by dynabatch run (or --profile FILE.json)",
    )
    add_flags(parser, PlanOptions)
    add_flags(parser, JobConfig, only=JOB_FLAGS)
    args = parser.parse_args(argv)
    opts, job = from_args(PlanOptions, args), from_args(JobConfig, args, only=JOB_FLAGS)
    try:
        opts.validate()
        job.validate()
        if (args.run_dir is None) == (not opts.profile):
            raise ConfigError("name one measured cluster: a RUN_FOLDER or --profile FILE.json")
    except ConfigError as exc:
        parser.error(str(exc))
    noise = NoiseScale(opts.k_min, opts.b_noise)
    try:
        cluster, name, notes, plot = _measured(args.run_dir, opts, job, args)
        star = optimum(cluster, noise)
    except (ClusterFileError, RunFolderError, ValueError) as exc:
        print(f"dynabatch plan: {exc}", file=sys.stderr)
        return 2
    ranked = predict_all(cluster, noise)
    choice = choose(cluster, noise)
    at_run_time = choose(cluster, noise, protocols=SWITCHABLE)  # what auto chooses among while a job runs
    plot = Path(opts.plot) if opts.plot else plot
    report = _report(name, cluster, noise, star, ranked, choice, at_run_time, notes, plot)
    from dynabatch.cluster.plan_plot import write_plan_plot  # matplotlib: only once there is something to draw

    try:
        write_plan_plot(plot, f"{name}: predicted time to target", ranked, star, choice.prediction)
    except OSError as exc:
        print(f"dynabatch plan: --plot {plot}: cannot write it: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if opts.json else _text(report))
    return 0
