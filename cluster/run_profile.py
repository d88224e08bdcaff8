"""A cluster measured by `dynabatch run`: each worker's step curve, cap and link read from a run folder, in the
cluster file's form (common/planning/cluster_file.py), for `dynabatch plan RUN_FOLDER`.

Every STATUS snapshot in timeline.json gives each worker's last step: its batch, its compute seconds and its pull
and push seconds. A worker seen at two or more batch sizes gets the least-squares line a + c*b of its compute
seconds; at one batch size (the fixed policy) its steps cannot tell the fixed cost from the per-sample cost, and
its start-up probe, which timed two batch sizes, gives the fixed part as the scheduler reads it
(common/probe.py `fixed_through`); without a probe the whole step counts as per-sample. A note says which. The model's
bytes are the job's bytes over twice its steps and its evaluations (a step pulls and pushes the model, an
evaluation pulls it; a pull in flight makes it a little high); a worker's link is those bytes over its median
transfer seconds, which on one machine includes the contention of its processes. What was not measured (a
shard's service rate) is left out.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from dynabatch.cluster.report import read_timeline
from dynabatch.common.config import JobConfig, job_from_dict
from dynabatch.common.flags import ConfigError
from dynabatch.common.planning.cluster_file import ClusterFile, WorkerGroup
from dynabatch.common.planning.line_fit import fit_line
from dynabatch.common.planning.optimum import Device
from dynabatch.common.probe import fixed_through, probe_batch
from dynabatch.common.protocols import SPECS
from dynabatch.common.wire.frames import ProtocolError
from dynabatch.common.wire.messages import JobStatus

FASTEST_LINK_MBIT = 1e6
"""The link of a worker whose transfers took no measurable time (loopback): 1 Tbit/s, nothing to count."""


class RunFolderError(ValueError):
    """A folder `dynabatch plan` cannot read a cluster from; the message names the file."""


@dataclass(frozen=True)
class MeasuredCluster:
    """The cluster a run measured, the job it ran, and what the reader had to assume, one note per assumption."""

    cluster: ClusterFile
    job: JobConfig
    notes: tuple[str, ...]


def measured_worker(
    wid: str, timeline: list[JobStatus], model_bytes: float, job_max_batch: int
) -> tuple[WorkerGroup, str | None]:
    """One worker's group (count 1) from its distinct steps, and a note where its curve rests on the start-up probe
    or is a guess."""
    steps = {
        s.workers[wid].steps: s.workers[wid]
        for s in timeline
        if wid in s.workers
        and s.workers[wid].steps > 0
        and s.workers[wid].batch > 0
        and s.workers[wid].times.compute_s > 0
    }
    if not steps:
        raise RunFolderError(f"worker {wid} never reported a step")
    seen = list(steps.values())
    name = seen[-1].name or wid
    points = [(float(w.batch), w.times.compute_s) for w in seen]
    note = None
    fixed, per_sample = fit_line(points) if len({b for b, _ in points}) > 1 else (-1.0, 0.0)
    if fixed < 0 or per_sample <= 0:
        batches = ", ".join(str(int(b)) for b in sorted({b for b, _ in points}))
        batch, seconds = statistics.median(b for b, _ in points), statistics.median(t for _, t in points)
        last = seen[-1]
        if last.standalone_sps > 0 and last.standalone_fixed_s > 0:
            probed = probe_batch(job_max_batch, last.max_batch)
            fixed = fixed_through(batch, seconds, probed, last.standalone_sps, last.standalone_fixed_s)
            per_sample = (seconds - fixed) / batch
            seen_as = (
                f"its steps were of one batch size ({batches})"
                if "," not in batches
                else f"its steps' times do not resolve a fixed cost (batches seen: {batches})"
            )
            note = f"{name}: {seen_as}; its fixed cost is its start-up probe's"
        else:
            fixed, per_sample = 0.0, statistics.median(t / b for b, t in points)
            note = (
                f"{name}: its step times do not resolve a fixed cost (batches seen: {batches}): counted as per-sample"
            )
    transfer = statistics.median(w.times.pull_s + w.times.push_s for w in seen)
    link = 2 * model_bytes * 8 / (transfer * 1e6) if transfer > 0 else FASTEST_LINK_MBIT
    return WorkerGroup(1, Device(fixed, per_sample, seen[-1].max_batch), min(link, FASTEST_LINK_MBIT)), note


def _model_bytes(timeline: list[JobStatus]) -> float | None:
    """The model's bytes on the wire: a snapshot's bytes over the whole models moved by then (`_models_moved`) and
    its evaluations' pulls, read before the job began stopping (a worker that has left no longer counts its steps in
    STATUS, while its bytes stay counted). None if no worker stepped."""
    counted = [s for s in timeline if not s.stopping and any(w.steps for w in s.workers.values())]
    if not counted:
        return None
    snap = counted[-1]
    evaluations = len({s.eval_version for s in timeline if s.eval_t is not None and s.t <= snap.t})
    return snap.bytes / (_models_moved(counted) + evaluations)


def _models_moved(timeline: list[JobStatus]) -> float:
    """The whole models the workers' steps moved: a pull and a push a step, but one of each per H local steps under
    a protocol of local steps (local, msd: H the snapshot's `local_steps`), each stretch between snapshots under the
    protocol the later one names (auto may switch). Counted as two a step, a local SGD run's model came out H times
    too small, and every link with it."""
    moved, last = 0.0, dict[str, int]()
    for snap in timeline:
        spec = SPECS.get(snap.protocol)
        h = max(1, snap.local_steps) if spec is not None and spec.local_steps else 1
        for wid, w in snap.workers.items():
            moved += 2 * max(0, w.steps - last.get(wid, 0)) / h
            last[wid] = w.steps
    return moved


def read_run(run_dir: Path) -> MeasuredCluster:
    """The cluster the run in `run_dir` measured (RunFolderError naming what is missing or unreadable)."""
    if run_dir.is_file():
        hint = " (a cluster file is read with --profile FILE)" if run_dir.suffix == ".json" else ""
        raise RunFolderError(f"{run_dir}: a file, not a run folder written by dynabatch run{hint}")
    try:
        config = json.loads((run_dir / "config.json").read_text())
        timeline = read_timeline(run_dir / "timeline.json")
    except (OSError, ValueError, ProtocolError) as exc:
        raise RunFolderError(f"{run_dir}: not a run folder written by dynabatch run ({exc})") from None
    settings = config.get("job") if isinstance(config, dict) else None
    if not isinstance(settings, dict) or not timeline:
        raise RunFolderError(f"{run_dir}: config.json has no job, or timeline.json no snapshot")
    try:
        job = job_from_dict(settings, allow_auto=True)  # a run of --protocol auto records it as given
    except ConfigError as exc:
        raise RunFolderError(f"{run_dir}: config.json's job cannot be read: {exc}") from None
    model_bytes = _model_bytes(timeline)
    if model_bytes is None:
        raise RunFolderError(f"{run_dir}: no worker took a step")
    ids = sorted({wid for s in timeline for wid in s.workers})
    workers = [measured_worker(wid, timeline, model_bytes, job.max_batch) for wid in ids]
    notes = [n for _, n in workers if n]
    notes.append("shards: their service rate was not measured; counted as serving at once")
    cluster = ClusterFile(
        name=str(run_dir),
        groups=tuple(g for g, _ in workers),
        model_bytes=model_bytes,
        global_batch=job.global_batch,
        shards=job.shards,
    )
    return MeasuredCluster(cluster, job, tuple(notes))
