"""`dynabatch run --protocol auto` on an emulated mixed-device cluster: the job starts on asgd, the scheduler chooses
another protocol from what it measured, switches the shards and then the workers while the job runs, says so in
STATUS, in its metric and on the console, and the job trains exactly its epochs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dynabatch.common.planning.protocol_switch import START, SWITCHABLE
from dynabatch.common.protocols import protocol_spec
from harness import mlp_job, run_job, trained_its_epochs

pytestmark = pytest.mark.slow

B = 96


def test_a_job_under_protocol_auto_switches_protocol_while_it_runs_and_trains_exactly_its_epochs(
    tmp_path: Path,
) -> None:
    """Three devices whose step is mostly a fixed cost (`--slowdowns 1:A`), one of them four times the others':
    under asgd with equal batches the slow device's fixed cost is paid for a third of the samples, so the
    predictor, told each device's fixed cost by its start-up probe of two batch sizes, says a protocol that sizes
    batches by step time reaches the target first, and the scheduler switches to it."""
    run, printed = run_job(
        tmp_path,
        "r",
        *mlp_job(1, "1:0.03", "1:0.03", "1:0.12"),
        "--protocol",
        "auto",
        "--global-batch",
        str(B),
        "--chunk-bytes",
        "262144",  # four chunks: the gradient steps run pipelined, whose hooks a switch must take off the model
        "--status-s",
        "0.2",
        "--eval-interval-s",
        "600",
    )
    summary = trained_its_epochs(run)
    timeline = json.loads((run / "timeline.json").read_text())
    # The job trains exactly its epochs (issue 41), switch or no switch: a gradient push is sized to what its worker
    # has left; a local round's last push passes it by fewer than its H steps (common/allotment.py).
    steps = protocol_spec(summary["protocol"]).report_steps(max(s["local_steps"] for s in timeline))
    assert 0 <= summary["overshoot_samples"] <= (steps - 1) * 3, summary["overshoot_samples"]
    first = next(s for s in timeline if s["workers"])
    assert first["protocol"] == START and first["auto_protocol"] == START, first
    chosen = {s["auto_protocol"] for s in timeline} - {START}
    assert len(chosen) == 1 and chosen <= set(SWITCHABLE), [
        (s["auto_protocol"], s["auto_protocol_reason"]) for s in timeline
    ]
    new = chosen.pop()
    running = [s for s in timeline if s["protocol"] == new]
    assert running, "the workers were told the new protocol"
    assert all(s["auto_protocol"] == new for s in running), "workers follow only what the shards were told first"
    switched_at = timeline.index(running[0])
    assert (
        any(s["auto_protocol"] == new for s in timeline[:switched_at])
        or "since assignment" in running[0]["auto_protocol_reason"]
    )
    assert any(f"{new} + " in s["auto_protocol_reason"] for s in running), "the reason names the method chosen"
    assert summary["protocol"] == new
    assert f"protocol auto runs {START}: {START} from the start" in printed, printed
    assert f"protocol auto runs {new}: {new} since assignment" in printed, printed
    assert f"protocol auto ran {new} last: {new} since assignment" in printed
    assert summary["auto_protocol"] == new and summary["auto_protocol_reason"].startswith(f"{new} since assignment")
    logs = (run / "logs" / "scheduler.log").read_text()
    assert re.search(rf"protocol auto chose {new}: .*\({new} \+ \w+: predicted fastest to target", logs), logs
    assert f"every shard applies {new}" in logs
    shards_said = "".join(p.read_text() for p in (run / "logs").glob("ps*.log"))
    assert f"protocol {new} from now on, was {START}" in shards_said
    workers_said = "".join(p.read_text() for p in (run / "logs").glob("worker*.log"))
    assert workers_said.count(f"protocol {new} from now on, was {START}") == 3, "every worker switched once"
