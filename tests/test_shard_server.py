"""The shard's socket loop (ps/server.py) on the wire, without a real worker in the way.

A real scheduler and one real shard run as processes; this test registers as a
worker (`Cluster.join_as_worker`) and talks to the shard with a raw `Connection`
and the messages of common/wire/messages.py only, so what is checked here holds
whatever the shard's update rules become: pulls answer every chunk with its
version, a refused push is answered with the code that names its fault, counted,
and changes nothing, and a parked pull is answered when its round closes or,
when nobody pushes, at its deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import zmq

from dynabatch.common.config import JobConfig, job_from_dict
from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.tasks.builtin_tasks import builtin_init
from dynabatch.common.tasks.models import model_for_job
from dynabatch.common.wire.chunking import make_layout
from dynabatch.common.wire.frames import MAX_CHUNKS, ChunkMeta, Message, encode
from dynabatch.common.wire.messages import Error, Params, Pull, Push, PushAck
from dynabatch.ps.outbox import SEND_QUEUE
from dynabatch.ps.peer_limits import MAX_PARKED_PER_PEER, backlog_limit
from dynabatch.ps.push_bounds import max_push_samples
from harness import Cluster, Proc, metric_value
from processes import rss_bytes

pytestmark = pytest.mark.slow

ROUND_TIMEOUT_S = 1.0  # the ssgd job's --round-timeout-s: how long a parked pull may wait on a round
REPLY_S = 10.0  # a reply on a busy two-core machine
# A small flat model cut into several chunks, so that "every chunk" means more than one.
JOB = [
    "--dataset",
    "synthetic",
    "--model",
    "flat:10000",
    "--chunk-bytes",
    "8192",
    "--epochs",
    "1000",
    "--liveness-timeout-s",
    "60",
]

Chunks = dict[int, tuple[int, torch.Tensor]]  # chunk id -> (version, values)


@dataclass
class Shard:
    """A running job whose only worker is this test, and its connection to the shard."""

    cluster: Cluster
    proc: Proc
    conn: Connection
    worker_id: str
    sizes: dict[int, int]  # the shard's chunk ids and their lengths, from the job's layout
    job: JobConfig

    def client(self, sender: str) -> Connection:
        return self.cluster.client(self.conn.endpoint, sender=sender)

    def bad_messages(self, reason: str) -> float:
        return metric_value(self.proc.metrics(), "dynabatch_bad_messages_total", role="ps", reason=reason)


def _start(tmp_path: Path, *flags: str) -> Shard:
    c = Cluster(tmp_path, [*JOB, *flags])
    c.scheduler()
    proc = c.shard()
    _, welcome = c.join_as_worker()  # once it holds a batch, the shard counts it live
    job = job_from_dict(welcome.config)
    total = sum(p.numel() for p in model_for_job(job).parameters())
    sizes = make_layout(total, job.chunk_bytes, job.shards).sizes(0)
    return Shard(c, proc, c.client(welcome.shards[0], sender=welcome.id), welcome.id, sizes, job)


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    s = _start(tmp_path_factory.mktemp("shard_server"))
    yield s
    s.cluster.stop()


@pytest.fixture(scope="module")
def ssgd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    s = _start(
        tmp_path_factory.mktemp("shard_server_ssgd"), "--protocol", "ssgd", "--round-timeout-s", str(ROUND_TIMEOUT_S)
    )
    yield s
    s.cluster.stop()


def _answers(
    conn: Connection,
    seq: int,
    ids: set[int],
    kinds: tuple[type, ...] = (Params,),
    until: type | None = None,
    timeout_s: float = REPLY_S,
) -> tuple[list[object], Chunks]:
    """The answers to request `seq` until every chunk of `ids` has come (and one of type `until`): their bodies
    in the order they came, and the chunks they carried. An answer to another request, or of another kind
    than `kinds`, fails the test."""
    bodies: list[object] = []
    got: Chunks = {}
    deadline = time.monotonic() + timeout_s
    while set(got) != ids or (until is not None and not any(isinstance(b, until) for b in bodies)):
        msg = conn.recv(max(0.0, deadline - time.monotonic()))
        assert msg is not None, f"chunks {sorted(ids - set(got))} never came; answers so far: {bodies}"
        assert msg.seq == seq, f"an answer to request {msg.seq} while waiting for {seq}: {msg.body}"
        assert isinstance(msg.body, kinds), f"answered {msg.body}"
        bodies.append(msg.body)
        for meta, tensor in zip(msg.chunks, msg.tensors, strict=True):
            assert meta.id not in got, f"chunk {meta.id} sent twice"
            got[meta.id] = (meta.version, tensor.clone())
    return bodies, got


def _collect(conn: Connection, seq: int, ids: set[int], timeout_s: float = REPLY_S) -> Chunks:
    """The chunks `ids` answering request `seq`, in PARAMS only."""
    return _answers(conn, seq, ids, timeout_s=timeout_s)[1]


def _pull(conn: Connection, ids: set[int], body: Pull | None = None) -> Chunks:
    """Chunks `ids`, by a PULL of all of them unless `body` asks otherwise."""
    return _collect(conn, conn.send(body or Pull()), ids)


def _gradient(chunks: Chunks, fill: float) -> tuple[list[ChunkMeta], list[torch.Tensor]]:
    """A gradient for every chunk, declared as computed on the versions pulled."""
    metas = [ChunkMeta(cid, "float32", tuple(t.shape), ver) for cid, (ver, t) in chunks.items()]
    return metas, [torch.full_like(t, fill) for _, t in chunks.values()]


def _assert_same(after: Chunks, before: Chunks) -> None:
    assert after.keys() == before.keys()
    for cid, (ver, values) in after.items():
        assert ver == before[cid][0], f"chunk {cid}: version {before[cid][0]} -> {ver}"
        assert torch.equal(values, before[cid][1]), f"chunk {cid} changed"


def test_a_pull_returns_every_chunk_with_its_version(shard: Shard) -> None:
    ids = set(shard.sizes)
    assert len(ids) > 1
    chunks = _pull(shard.conn, ids)
    for cid, (ver, values) in chunks.items():
        assert values.numel() == shard.sizes[cid] and ver >= 0
    some = {min(ids), max(ids)}
    assert _pull(shard.conn, some, Pull(ids=sorted(some))).keys() == some, "a pull of some chunks gets just those"


def _unknown_chunk(chunks: Chunks) -> tuple[list[ChunkMeta], list[torch.Tensor]]:
    metas, tensors = _gradient(chunks, 0.5)
    metas[0] = ChunkMeta(max(chunks) + 1000, "float32", metas[0].shape, 0)
    return metas, tensors


def _short_chunk(chunks: Chunks) -> tuple[list[ChunkMeta], list[torch.Tensor]]:
    metas, tensors = _gradient(chunks, 0.5)
    metas[0] = ChunkMeta(metas[0].id, "float32", (metas[0].numel - 1,), metas[0].version)
    tensors[0] = tensors[0][:-1]
    return metas, tensors


def _nan(chunks: Chunks) -> tuple[list[ChunkMeta], list[torch.Tensor]]:
    metas, tensors = _gradient(chunks, 0.5)
    tensors[-1][-1] = float("nan")
    return metas, tensors


@pytest.mark.parametrize(
    "make, sender, code",
    [
        (_unknown_chunk, "", "unknown_chunk"),
        (_short_chunk, "", "bad_shape"),
        (_nan, "", "non_finite"),
        (lambda chunks: _gradient(chunks, 0.5), "w999", "unknown_sender"),
    ],
    ids=["wrong chunk id", "wrong length", "NaN", "unknown sender"],
)
def test_a_refused_push_is_answered_counted_and_changes_nothing(
    shard: Shard, make: Callable[[Chunks], tuple[list[ChunkMeta], list[torch.Tensor]]], sender: str, code: str
) -> None:
    ids = set(shard.sizes)
    before = _pull(shard.conn, ids)
    counted = shard.bad_messages(code)
    conn = shard.client(sender) if sender else shard.conn
    try:
        with pytest.raises(RemoteError) as refused:
            conn.request(Push(samples=8), REPLY_S, *make(before))
    finally:
        if conn is not shard.conn:
            conn.close()
    assert refused.value.code == code, refused.value
    assert shard.bad_messages(code) == counted + 1
    _assert_same(_pull(shard.conn, ids), before)


def test_a_frame_shorter_than_its_chunk_is_refused_and_changes_nothing(shard: Shard) -> None:
    ids = set(shard.sizes)
    before = _pull(shard.conn, ids)
    counted = shard.bad_messages("frame_length")
    metas, tensors = _gradient(before, 0.5)
    frames = [bytes(f) for f in encode(Message(Push(samples=8), metas, tensors, "dynabatch", shard.worker_id, 99))]
    shard.conn.sock.send_multipart(frames[:-1] + [frames[-1][:-4]])
    reply = shard.conn.recv(REPLY_S)
    assert reply is not None and isinstance(reply.body, Error) and reply.body.code == "frame_length"
    assert shard.bad_messages("frame_length") == counted + 1
    _assert_same(_pull(shard.conn, ids), before)


def test_an_init_with_a_malformed_optimizer_is_refused_counted_and_changes_nothing(shard: Shard) -> None:
    ids = set(shard.sizes)
    before = _pull(shard.conn, ids)
    counted = shard.bad_messages("bad_field")
    init, _ = builtin_init(shard.job)
    init.optimizer = {"name": "adamw", "lr": 1e-3, "betas": [0.9, 1.5]}
    with pytest.raises(RemoteError) as refused:
        shard.conn.request(init, REPLY_S)
    assert refused.value.code == "bad_field" and "betas" in str(refused.value), refused.value
    assert shard.bad_messages("bad_field") == counted + 1
    _assert_same(_pull(shard.conn, ids), before)


@pytest.mark.parametrize(
    "part, value, named",
    [
        ("optimizer", {"name": "adam", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8}, "adam"),
        ("schedule", {"name": "step", "warmup": 0.0, "milestones": [0.5], "gamma": 0.1}, "step"),
    ],
)
def test_an_init_naming_another_optimizer_or_schedule_than_the_jobs_is_refused_naming_it(
    shard: Shard, part: str, value: dict[str, object], named: str
) -> None:
    """The job's optimizer and schedule are part of its signature: a worker whose task names others would train
    as if its own applied; the shards step with the first worker's."""
    ids = set(shard.sizes)
    before = _pull(shard.conn, ids)
    init, _ = builtin_init(shard.job)
    setattr(init, part, value)
    text = _refused_from(shard.conn, shard, "signature", init)
    assert f"{part}: this worker's task names {named}" in text, text
    _assert_same(_pull(shard.conn, ids), before)
    same, _ = builtin_init(shard.job)
    assert shard.conn.request(same, REPLY_S).body.version == max(v for v, _ in before.values())


def test_a_good_push_from_the_registered_worker_is_applied(shard: Shard) -> None:
    """What the refusals are measured against: the same push, well formed, does change the model."""
    ids = set(shard.sizes)
    before = _pull(shard.conn, ids)
    ack = shard.conn.request(Push(samples=8), REPLY_S, *_gradient(before, 0.5))
    assert isinstance(ack.body, PushAck) and ack.body.applied
    after = _pull(shard.conn, ids)
    for cid, (ver, values) in after.items():
        assert ver == before[cid][0] + 1 and not torch.equal(values, before[cid][1]), cid


def _push_pull(conn: Connection, pulled: Chunks) -> tuple[list[object], Chunks]:
    """A PUSH that is also a PULL: its answers' bodies in the order they came, and the chunks they carried."""
    seq = conn.send(Push(samples=8, then_pull=True), *_gradient(pulled, 0.5))
    return _answers(conn, seq, set(pulled), (Params, PushAck), until=PushAck)


@pytest.mark.parametrize("fixture", ["shard", "ssgd"])
def test_a_push_that_is_also_a_pull_sends_each_chunk_back_as_it_is_applied(
    request: pytest.FixtureRequest, fixture: str
) -> None:
    """Chunk k leaves while chunk k+1 is updated, so every chunk comes before the acknowledgement, which
    reports the whole push; each is the model after this push (ssgd: the only worker closes the round)."""
    s: Shard = request.getfixturevalue(fixture)
    ids = set(s.sizes)
    before = _pull(s.conn, ids)
    bodies, got = _push_pull(s.conn, before)
    assert len(ids) > 1 and [type(b) for b in bodies] == [Params] * len(ids) + [PushAck], bodies
    ack = bodies[-1]
    assert isinstance(ack, PushAck) and ack.applied and ack.version == max(ver for ver, _ in before.values()) + 1
    assert {cid: ver for cid, (ver, _) in got.items()} == {cid: ver + 1 for cid, (ver, _) in before.items()}
    _assert_same(_pull(s.conn, ids), got)


def _park(conn: Connection, ids: set[int]) -> tuple[int, int, float]:
    """Send a pull that must wait for the next version; return (its seq, the version now, when it was sent).

    A second pull on the same connection is answered only after the shard has
    taken the first (one connection keeps its order), so once that answer is in,
    the first pull is parked: had it been answered, its chunks would have come first.
    """
    version = max(ver for ver, _ in _pull(conn, ids).values())
    sent = time.monotonic()
    seq = conn.send(Pull(min_version=version + 1))
    probe = {max(ids)}
    assert _pull(conn, probe, Pull(ids=sorted(probe)))
    return seq, version, sent


def test_a_parked_pull_is_answered_when_its_round_closes(ssgd: Shard) -> None:
    """On the worker's own connection (the only one the shard takes in its name): the push's
    acknowledgement comes first, then the parked pull's chunks."""
    ids = set(ssgd.sizes)
    seq, version, _ = _park(ssgd.conn, ids)
    pushed = _pull(ssgd.conn, ids)
    ack = ssgd.conn.request(Push(samples=8), REPLY_S, *_gradient(pushed, 0.5))
    assert isinstance(ack.body, PushAck) and ack.body.applied, "the only live worker's push closes the round"
    answered = _collect(ssgd.conn, seq, ids, ROUND_TIMEOUT_S)  # well before the pull's own deadline
    assert {ver for ver, _ in answered.values()} == {version + 1}
    _assert_same(_pull(ssgd.conn, ids), answered)


def test_a_parked_pull_gets_the_current_chunks_at_its_deadline_when_nobody_pushes(ssgd: Shard) -> None:
    ids = set(ssgd.sizes)
    seq, version, sent = _park(ssgd.conn, ids)
    answered = _collect(ssgd.conn, seq, ids, 2 * ROUND_TIMEOUT_S + REPLY_S)
    waited = time.monotonic() - sent
    assert waited >= ROUND_TIMEOUT_S, f"answered after {waited:.2f}s, before a round could have timed out"
    assert {ver for ver, _ in answered.values()} == {version}
    _assert_same(_pull(ssgd.conn, ids), answered)


def _refused_from(
    conn: Connection,
    shard: Shard,
    code: str,
    body: object,
    chunks: Sequence[ChunkMeta] = (),
    tensors: Sequence[torch.Tensor] = (),
) -> str:
    """`body` sent on `conn` must be refused with `code` and counted; returns the refusal's text."""
    counted = shard.bad_messages(code)
    with pytest.raises(RemoteError) as refused:
        conn.request(body, REPLY_S, chunks, tensors)
    assert refused.value.code == code, refused.value
    assert shard.bad_messages(code) == counted + 1
    return refused.value.text


def test_a_push_in_the_workers_name_from_another_connection_is_refused_and_changes_nothing(shard: Shard) -> None:
    ids = set(shard.sizes)
    before = _pull(shard.conn, ids)  # the worker's own connection speaks for it (bound by now)
    impostor = shard.client(shard.worker_id)
    try:
        _refused_from(impostor, shard, "bad_sender", Push(samples=2**62), *_gradient(before, 1e6))
        _refused_from(impostor, shard, "bad_sender", Pull())
    finally:
        impostor.close()
    _assert_same(_pull(shard.conn, ids), before)


def test_a_push_with_numbers_its_worker_cannot_have_is_refused_naming_the_field(shard: Shard) -> None:
    ids = set(shard.sizes)
    before = _pull(shard.conn, ids)
    too_many = max_push_samples(shard.job) + 1
    text = _refused_from(shard.conn, shard, "bad_field", Push(samples=too_many), *_gradient(before, 0.5))
    assert "PUSH.samples" in text
    metas, tensors = _gradient(before, 0.5)
    metas[-1] = ChunkMeta(metas[-1].id, "float32", metas[-1].shape, metas[-1].version + 1)
    text = _refused_from(shard.conn, shard, "bad_field", Push(samples=8), metas, tensors)
    assert f"PUSH.chunks[{metas[-1].id}].version" in text
    _assert_same(_pull(shard.conn, ids), before)


def test_a_message_of_more_chunk_entries_than_the_model_has_is_refused_before_it_is_parsed(shard: Shard) -> None:
    ids = set(shard.sizes)
    before = _pull(shard.conn, ids)
    """Its 65,536 entries make a 2 MB envelope: refused on its size alone, which bounds the cost of a refusal."""
    counted = shard.bad_messages("too_large")
    metas = [ChunkMeta(i, "float32", (0,), 0) for i in range(MAX_CHUNKS)]
    frames = encode(Message(Push(samples=8), metas, [torch.empty(0)] * MAX_CHUNKS, "dynabatch", shard.worker_id, 5))
    shard.conn.sock.send_multipart(frames, copy=False)
    reply = shard.conn.recv(REPLY_S)
    assert reply is not None and isinstance(reply.body, Error) and reply.body.code == "too_large", reply
    assert shard.bad_messages("too_large") == counted + 1
    _assert_same(_pull(shard.conn, ids), before)


def test_a_connection_may_park_only_so_many_pulls(ssgd: Shard) -> None:
    ids = set(ssgd.sizes)
    version = max(ver for ver, _ in _pull(ssgd.conn, ids).values())
    counted = ssgd.bad_messages("busy")
    stranger = ssgd.client("stranger")  # not a worker: its pulls only read, and may wait
    try:
        for _ in range(MAX_PARKED_PER_PEER):
            stranger.send(Pull(min_version=version + 1))
        seq = stranger.send(Pull(min_version=version + 1))
        reply = stranger.recv(REPLY_S)  # the parked ones are answered only at their deadline, after this
    finally:
        stranger.close()
    assert reply is not None and reply.seq == seq and isinstance(reply.body, Error) and reply.body.code == "busy", reply
    assert ssgd.bad_messages("busy") == counted + 1


BIG_PARAMS = 2_000_000  # 8 MB of float32, in 1 MB chunks: what replies never read would pin
ROUNDS = 50


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    s = _start(
        tmp_path_factory.mktemp("shard_server_big"), "--model", f"flat:{BIG_PARAMS}", "--chunk-bytes", str(1 << 20)
    )
    yield s
    s.cluster.stop()


def test_pulls_never_read_do_not_grow_the_shard_and_it_keeps_serving(big: Shard) -> None:
    """Every round a peer that never reads asks for the whole model, and the worker's push makes a new
    version of it: queued unread, each answer would pin that version in the shard's memory."""
    ids = set(big.sizes)
    reader: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    reader.setsockopt(zmq.RCVHWM, 1)
    reader.setsockopt(zmq.RCVBUF, 4096)
    reader.setsockopt(zmq.LINGER, 0)
    reader.connect(big.conn.endpoint)
    pull = [bytes(f) for f in encode(Message(Pull(), job="dynabatch", sender="stranger", seq=1))]
    busy = big.bad_messages("busy")
    try:
        before_rss = rss_bytes(big.proc.proc.pid)
        for _ in range(ROUNDS):
            reader.send_multipart(pull)
            pushed = _pull(big.conn, ids)
            ack = big.conn.request(Push(samples=8), REPLY_S, *_gradient(pushed, 1e-3))
            assert isinstance(ack.body, PushAck) and ack.body.applied
        grown = rss_bytes(big.proc.proc.pid) - before_rss
        after = _pull(big.conn, ids)
    finally:
        reader.close()
    model_bytes = 4 * BIG_PARAMS
    chunk_bytes = 4 * max(big.sizes.values())
    bound = (SEND_QUEUE + backlog_limit(len(ids))) * chunk_bytes + 4 * model_bytes  # queued replies, sockets' slack
    assert grown < bound, f"the shard grew {grown / 1e6:.0f} MB in {ROUNDS} rounds (bound {bound / 1e6:.0f} MB)"
    assert big.bad_messages("busy") > busy, "the reader's pulls were all answered though it read none"
    assert metric_value(big.proc.metrics(), "dynabatch_ps_replies_dropped_total", shard="0") > 0
    assert {ver for ver, _ in after.values()} == {max(ver for ver, _ in pushed.values()) + 1}
