"""Whether a shard takes a PUSH (ps/push_admission.py), driven directly with a real ServedJob and ShardState: the
checks run in the order `STEPS` declares, the sender's standing before its gradient is assessed, and a refused
push changes nothing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from dynabatch.common.config import JobConfig, to_dict
from dynabatch.common.wire.frames import ChunkMeta, Message, ProtocolError
from dynabatch.common.wire.messages import Push, Welcome
from dynabatch.common.wire.model_signature import signature_from_fields
from dynabatch.ps import push_admission
from dynabatch.ps.push_admission import STEPS, PushAdmission, PushCase
from dynabatch.ps.replay_guard import ReplayGuard
from dynabatch.ps.served_job import ServedJob
from dynabatch.ps.shard_state import ShardState

SIG = signature_from_fields(["w", "b"], [[30, 10], [10]], ["float32", "float32"], train_size=500)
BATCH = 32


def _shard(tmp_path: Path) -> tuple[ServedJob, ShardState, PushAdmission, list[str]]:
    """Shard 0 of one, serving live workers w0 and w1 with a batch of BATCH each; the list records the workers
    the scheduler was told were quarantined."""
    config = replace(JobConfig(), job="j", shards=1, chunk_bytes=1024, protocol="asgd", global_batch=2 * BATCH)
    served = ServedJob.welcomed(
        Welcome(id="ps0", config=to_dict(config), shards=[], shard_index=0), CollectorRegistry(), str(tmp_path)
    )
    state = served.new_state(SIG, torch.ones(SIG.total), {}, {})
    state.set_membership({"w0", "w1"}, allocated=2)
    served.assigned.update({"w0": BATCH, "w1": BATCH})
    told: list[str] = []
    return served, state, PushAdmission(ReplayGuard(), lambda identity: None, lambda: told.append("told")), told


def _case(
    served: ServedJob, state: ShardState, sender: str, scale: float = 1e-3, samples: int = BATCH, seq: int = 1
) -> PushCase:
    metas = [ChunkMeta(c.id, "float32", (c.length,), 0) for c in state.chunks]
    tensors = [torch.full((c.length,), scale) for c in state.chunks]
    return PushCase(
        Message(Push(samples=samples), metas, tensors, "j", sender, seq), b"conn-" + sender.encode(), served, state, 0
    )


def test_the_steps_check_the_message_then_its_claims_then_its_sender_and_only_then_assess_the_gradient() -> None:
    names = [step.__name__ for step in STEPS]
    assert names == [
        "well_formed",
        "protocol_in_force",
        "room_to_answer",
        "base_not_rolled_back",
        "numbers_possible",
        "not_replayed",
        "sender_not_quarantined",
        "sender_live",
        "samples_within_batch",
        "norms_bounded",
        "direction_not_held",
    ]
    assert all(getattr(push_admission, name) is step for name, step in zip(names, STEPS, strict=True))


def test_a_push_from_a_worker_that_is_not_live_is_refused_before_its_gradient_is_assessed(tmp_path: Path) -> None:
    served, state, admission, _ = _shard(tmp_path)
    case = _case(served, state, "w9", scale=1e6)
    with pytest.raises(ProtocolError) as refused:
        admission.admit(case)
    assert refused.value.code == "unknown_sender"
    assert case.found is None, "the gradient bounds never saw it"


def test_a_quarantined_worker_that_left_is_still_told_it_was_quarantined(tmp_path: Path) -> None:
    """A worker the scheduler dropped for its pushes hears why (`quarantined`), not `unknown_sender`, which it
    would take for a join not yet known and send again."""
    served, state, admission, _ = _shard(tmp_path)
    served.bounds.quarantine("w1", "pointing against the other workers' gradients (--direction-check)")
    state.set_membership({"w0"}, allocated=1)
    with pytest.raises(ProtocolError) as refused:
        admission.admit(_case(served, state, "w1"))
    assert refused.value.code == "quarantined"


@pytest.mark.parametrize("samples, code", [(0, "bad_field"), (-3, "bad_field"), (BATCH + 1, "bad_field")])
def test_a_push_claiming_impossible_samples_is_refused_and_changes_nothing(
    tmp_path: Path, samples: int, code: str
) -> None:
    served, state, admission, _ = _shard(tmp_path)
    before = {cid: t.clone() for cid, t in state.params.items()}
    with pytest.raises(ProtocolError) as refused:
        admission.admit(_case(served, state, "w0", samples=samples))
    assert refused.value.code == code and "PUSH.samples" in refused.value.text
    assert all(torch.equal(state.params[cid], t) for cid, t in before.items()) and state.version == 0


def test_a_taken_push_is_not_taken_twice_and_its_norms_are_recorded(tmp_path: Path) -> None:
    served, state, admission, told = _shard(tmp_path)
    case = _case(served, state, "w0")
    admission.admit(case)
    state.push(case.sender, case.assessed.tensors, case.base, case.body.samples, case.body.kind, 0.0)
    admission.taken(case)
    assert state.version == 1 and not told
    assert all(served.bounds.history[cid].by_worker.get("w0") for cid in case.tensors), "its norms are recorded"
    with pytest.raises(ProtocolError) as refused:
        admission.admit(_case(served, state, "w0"))  # the same seq on the same connection
    assert refused.value.code == "replay"
