"""The scheduler tells shards each worker's batch (Assignment.batches) before it lets the worker use a larger one."""

from __future__ import annotations

from dynabatch.common.config import JobConfig
from dynabatch.common.messages import Heartbeat, Hello
from dynabatch.scheduler.job_state import JobState


def test_a_worker_gets_a_larger_batch_only_once_every_shard_bounds_its_pushes_by_it():
    state = JobState(JobConfig(dataset="synthetic", global_batch=96), num_shards=2, train_size=1000, now=0.0)
    shards = [state.hello(Hello(role="ps", endpoint=f"tcp://s:{i}", shard_index=i), 0.0).id for i in range(2)]
    a = state.hello(Hello(role="worker"), 0.0).id
    b = state.hello(Hello(role="worker"), 0.0).id
    for w in (a, b):
        state.heartbeat(w, Heartbeat(standalone_sps=1000.0), 0.1)
    for ps in shards:
        state.heartbeat(ps, Heartbeat(membership=state.roster.membership), 0.2)
    assert state.allocator.allocation == {a: 48, b: 48}
    assert state.assignment_for(state.roster.members[a]).batch == 0, "shard 0 answered before the allocation"
    told = state.heartbeat(shards[0], Heartbeat(membership=state.roster.membership), 0.3)
    assert told.batches == {a: 48, b: 48}
    assert state.assignment_for(state.roster.members[a]).batch == 48

    state.bye(b, 0.4)  # a's share grows to the whole batch
    assert state.allocator.allocation == {a: 96}
    assert state.assignment_for(state.roster.members[a]).batch == 48, "no shard knows a's larger batch yet"
    assert state.heartbeat(shards[0], Heartbeat(membership=state.roster.membership), 0.5).batches == {a: 96}
    assert state.assignment_for(state.roster.members[a]).batch == 48, "shard 1 does not know it yet"
    state.heartbeat(shards[1], Heartbeat(membership=state.roster.membership), 0.6)
    assert state.assignment_for(state.roster.members[a]).batch == 96
