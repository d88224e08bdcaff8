"""The wire codec: round trips, zero-copy, and every kind of malformed input."""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import torch

from dynabatch.common.wire.frames import (
    PROTOCOL_VERSION,
    ChunkMeta,
    Message,
    ProtocolError,
    WireLimits,
    check_chunks,
    check_finite,
    chunk_meta,
    decode,
    decode_map,
    encode,
)
from dynabatch.common.wire.messages import (
    MESSAGE_TYPES,
    Decision,
    DecisionLatency,
    DepartedWorker,
    Hello,
    JobStatus,
    Push,
    Role,
    ShardStatus,
    StatusReply,
    StatusRequest,
    WorkerHeartbeat,
    WorkerStatus,
)
from dynabatch.common.wire.step_times import StepTimes


def _push(tensors: list[torch.Tensor], seq: int = 7) -> Message[Any]:
    metas = [chunk_meta(i, t, version=3) for i, t in enumerate(tensors)]
    return Message(Push(samples=32, loss=0.5), metas, tensors, job="j", sender="w0", seq=seq)


def _env(frames: Sequence[Any]) -> dict[str, Any]:
    env: dict[str, Any] = msgpack.unpackb(frames[0])
    return env


def _reframe(env: dict[str, Any], tensors: Sequence[Any]) -> list[Any]:
    return [msgpack.packb(env), *tensors]


def test_round_trip_keeps_fields_chunks_and_values() -> None:
    tensors = [torch.randn(100), torch.randn(3, 4)]
    out = decode([bytes(f) for f in encode(_push(tensors))])
    assert out.type == "PUSH" and out.job == "j" and out.sender == "w0" and out.seq == 7
    assert out.body == Push(samples=32, loss=0.5)
    assert [c.version for c in out.chunks] == [3, 3]
    for a, b in zip(out.tensors, tensors, strict=True):
        assert torch.equal(a, b)


def test_encode_does_not_copy_tensor_memory() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    frame = encode(_push([t]))[1]
    t[0] = 42.0
    assert torch.frombuffer(frame, dtype=torch.float32)[0] == 42.0


def _heartbeat_envelope(**fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "HEARTBEAT", "job": "j", "sender": "w0", "seq": 1, "chunks": [], **fields}


def test_optional_fields_take_defaults_and_ints_become_floats() -> None:
    out = decode([msgpack.packb(_heartbeat_envelope(times={"step_s": 1}))])
    assert out.body.times.step_s == 1.0 and isinstance(out.body.times.step_s, float)
    assert out.body.times == StepTimes(step_s=1.0), "a phase left out of a heartbeat's times is 0"
    assert out.body.samples == 0 and math.isnan(out.body.loss)
    assert decode([msgpack.packb(_heartbeat_envelope())]).body.times == StepTimes()


@pytest.mark.parametrize(
    "times, text",
    [
        ({"step_s": "fast"}, "HEARTBEAT.times.step_s must be float"),
        ({"step_s": 0.1, "data_s": None}, "HEARTBEAT.times.data_s must be float"),
        ([0.1, 0.05], "HEARTBEAT.times must be a map (StepTimes)"),
        (0.1, "HEARTBEAT.times must be a map (StepTimes)"),
    ],
)
def test_a_heartbeats_bad_step_times_are_refused_naming_the_phase(times: Any, text: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode([msgpack.packb(_heartbeat_envelope(steps=1, times=times))])
    assert info.value.code == "bad_field" and info.value.text == text and info.value.ref == 1


def test_a_heartbeats_step_times_travel_as_one_map() -> None:
    hb = WorkerHeartbeat(steps=2, loss=1.0, times=StepTimes(step_s=0.5, compute_s=0.3, pull_s=0.1, push_s=0.1))
    frames = encode(Message(hb, job="j", sender="w0", seq=3))
    assert _env(frames)["times"] == {
        "step_s": 0.5,
        "compute_s": 0.3,
        "pull_s": 0.1,
        "push_s": 0.1,
        "wait_s": 0.0,
        "data_s": 0.0,
    }
    assert decode([bytes(f) for f in frames]).body == hb


@pytest.mark.parametrize(
    "frames, code",
    [
        ([b"\xc1\xff\x00garbage"], "malformed"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "type": "PULL"})[:-3]], "malformed"),
        ([msgpack.packb([1, 2, 3])], "malformed"),
        ([], "malformed"),
        ([msgpack.packb({"v": 0, "type": "PULL", "job": "j", "sender": "w", "seq": 1, "chunks": []})], "version"),
        ([msgpack.packb({"v": 99, "type": "PULL", "job": "j", "sender": "w", "seq": 1, "chunks": []})], "version"),
        (
            [msgpack.packb({"v": PROTOCOL_VERSION, "type": "NOPE", "job": "j", "sender": "w", "seq": 1, "chunks": []})],
            "unknown_type",
        ),
        (
            [msgpack.packb({"v": PROTOCOL_VERSION, "type": "PULL", "job": "j", "sender": "w", "chunks": []})],
            "bad_field",
        ),
        (
            [
                msgpack.packb(
                    {"v": PROTOCOL_VERSION, "type": "PULL", "job": "j", "sender": "w", "seq": "1", "chunks": []}
                )
            ],
            "bad_field",
        ),
        (
            [msgpack.packb({"v": PROTOCOL_VERSION, "type": "PUSH", "job": "j", "sender": "w", "seq": 1, "chunks": []})],
            "bad_field",
        ),
        (
            [
                msgpack.packb(
                    {
                        "v": PROTOCOL_VERSION,
                        "type": "PUSH",
                        "job": "j",
                        "sender": "w",
                        "seq": 1,
                        "chunks": [],
                        "samples": True,
                    }
                )
            ],
            "bad_field",
        ),
        (
            [
                msgpack.packb(
                    {
                        "v": PROTOCOL_VERSION,
                        "type": "PULL",
                        "job": "j",
                        "sender": "w",
                        "seq": 1,
                        "chunks": [],
                        "ids": [1, "x"],
                    }
                )
            ],
            "bad_field",
        ),
    ],
)
def test_malformed_envelopes_are_refused_with_a_code(frames: list[Any], code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code == code


def test_wrong_frame_count_and_length_are_refused() -> None:
    frames = [bytes(f) for f in encode(_push([torch.ones(10), torch.ones(5)]))]
    with pytest.raises(ProtocolError, match="frame_count"):
        decode(frames[:-1])
    with pytest.raises(ProtocolError, match="frame_count"):
        decode(frames + [b"\x00" * 20])
    with pytest.raises(ProtocolError, match="frame_length"):
        decode(frames[:1] + [frames[1][:-4], frames[2]])


LIMITS = WireLimits(max_chunks=3, max_frame_bytes=40, max_envelope_bytes=1000, max_array=16)


def _limited(frames: list[Any]) -> str:
    """The code `decode` refuses `frames` with under LIMITS."""
    with pytest.raises(ProtocolError) as info:
        decode(frames, LIMITS)
    return info.value.code


def test_a_message_within_limits_decodes_as_without_them() -> None:
    frames = encode(_push([torch.ones(10), torch.ones(5), torch.ones(1)]))
    assert decode(frames, LIMITS).chunks == decode(frames).chunks


def test_messages_beyond_a_receivers_limits_are_refused_before_they_are_parsed() -> None:
    env = _env(encode(_push([])))
    env["ids"] = list(range(17))
    fine_without = [
        (encode(_push([torch.ones(1)] * 4)), "bad_chunk"),  # more chunks than held
        (encode(_push([torch.ones(11)])), "bad_chunk"),  # a frame larger than the largest chunk
        (encode(Message(Push(samples=1), job="j" * 1000, sender="w0")), "too_large"),
        ([msgpack.packb(env)], "bad_chunk"),  # a list longer than any the receiver needs
    ]
    for frames, code in fine_without:
        decode(frames)
        assert _limited(frames) == code
    del env["ids"]
    env["chunks"] = [{"id": 0, "dtype": "float32", "shape": [0]}] * 4  # more entries than held, without frames
    with pytest.raises(ProtocolError, match="frame_count"):  # found only after every entry is parsed
        decode([msgpack.packb(env)])
    assert _limited([msgpack.packb(env)]) == "bad_chunk"


@pytest.mark.parametrize(
    "chunk",
    [
        {"id": -1, "dtype": "float32", "shape": [1]},
        {"id": 0, "dtype": "float128", "shape": [1]},
        {"id": 0, "dtype": "float32", "shape": [-1]},
        {"id": 0, "dtype": "float32", "shape": "10"},
        {"id": 0, "dtype": "float32", "shape": [1 << 20, 1 << 20]},
        {"id": 0, "dtype": "float32", "shape": [1], "version": -5},
        "not a map",
    ],
)
def test_bad_chunk_entries_are_refused(chunk: object) -> None:
    env = {"v": PROTOCOL_VERSION, "type": "PUSH", "job": "j", "sender": "w", "seq": 1, "samples": 1, "chunks": [chunk]}
    with pytest.raises(ProtocolError) as info:
        decode([msgpack.packb(env), b"\x00" * 4])
    assert info.value.code == "bad_chunk"
    assert info.value.ref == 1


def test_check_chunks_refuses_unknown_duplicate_and_resized_chunks() -> None:
    msg = decode([bytes(f) for f in encode(_push([torch.ones(4)]))])
    check_chunks(msg, {0: 4})
    with pytest.raises(ProtocolError, match="unknown_chunk"):
        check_chunks(msg, {1: 4})
    with pytest.raises(ProtocolError, match="bad_shape"):
        check_chunks(msg, {0: 5})
    twice = Message(Push(samples=1), [ChunkMeta(0, "float32", (4,))] * 2, [torch.ones(4)] * 2)
    with pytest.raises(ProtocolError, match="twice"):
        check_chunks(twice, {0: 4})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_refuses_nan_and_inf(bad: float) -> None:
    t = torch.ones(100)
    t[57] = bad
    msg = decode([bytes(f) for f in encode(_push([torch.ones(3), t]))])
    with pytest.raises(ProtocolError) as info:
        check_finite(msg)
    assert info.value.code == "non_finite" and "chunk 1" in info.value.text


def test_bodies_without_fields_and_with_lists_round_trip() -> None:
    for body in (StatusRequest(), Hello(role=Role.WORKER, name="n"), WorkerHeartbeat(steps=3, loss=1.5)):
        out = decode([bytes(f) for f in encode(Message(body, job="j", sender="s", seq=1))])
        assert out.body == body


def _status() -> JobStatus:
    return JobStatus(
        t=12.5,
        job="j",
        protocol="asgd",
        batch_policy="dynamic",
        epoch=1.5,
        target_epochs=8.0,
        samples=18000,
        staleness=[3, 1],
        training_t=10.0,
        loss=0.7,
        test_acc=None,
        eval_version=None,
        workers={
            "w0": WorkerStatus(name="worker0", batch=64, times=StepTimes(step_s=0.05), loss=None, observed_steps=10),
            "w1": WorkerStatus(name="worker1", batch=32, times=StepTimes(step_s=0.05), loss=0.69),
        },
        departed={"w2": DepartedWorker("worker2", 3, 96, 1)},
        shards={"0": ShardStatus("tcp://ps:1", 40, "http://ps:9")},
        decisions=[Decision(2.0, "joined", "w1", {"w0": 64, "w1": 32}, {"w0": 0.05, "w1": 0.05})],
        decision_s=DecisionLatency(5, 1e-4, 3e-4),
    )


def _status_envelope() -> dict[str, Any]:
    return _env(encode(Message(StatusReply(state=_status()), job="j", sender="scheduler", seq=4)))


def test_status_reply_round_trips_nested_fields_and_none() -> None:
    frames = encode(Message(StatusReply(state=_status()), job="j", sender="scheduler", seq=4))
    assert _env(frames)["state"]["workers"]["w0"]["batch"] == 64, "nested dataclasses travel as maps"
    out = decode([bytes(f) for f in frames])
    assert out.body == StatusReply(state=_status())
    assert isinstance(out.body.state.workers["w1"], WorkerStatus) and isinstance(out.body.state.decisions[0], Decision)
    assert out.body.state.test_acc is None and out.body.state.workers["w0"].loss is None


def test_optional_fields_take_a_value_or_none() -> None:
    env = _status_envelope()
    env["state"]["test_acc"], env["state"]["eval_version"] = 1, 7
    out = decode([msgpack.packb(env)])
    assert out.body.state.test_acc == 1.0 and isinstance(out.body.state.test_acc, float)
    assert out.body.state.eval_version == 7


@pytest.mark.parametrize(
    "change, text",
    [
        (lambda s: s["workers"]["w0"].update(batch="64"), "STATUS_REPLY.state.workers.w0.batch must be int"),
        (lambda s: s["workers"]["w1"].update(loss="low"), "STATUS_REPLY.state.workers.w1.loss must be float | None"),
        (
            lambda s: s["workers"]["w0"]["times"].update(wait_s="long"),
            "STATUS_REPLY.state.workers.w0.times.wait_s must be float",
        ),
        (lambda s: s.update(eval_version=1.5), "STATUS_REPLY.state.eval_version must be int | None"),
        (lambda s: s["workers"].update(w0=[1, 2]), "STATUS_REPLY.state.workers.w0 must be a map (WorkerStatus)"),
        (lambda s: s["workers"].update({b"w9": {}}), "STATUS_REPLY.state.workers has key b'w9'; keys must be str"),
        (lambda s: s["shards"]["0"].pop("version"), "STATUS_REPLY.state.shards.0 lacks required field 'version'"),
        (
            lambda s: s["decisions"][0]["batches"].update(w1=None),
            "STATUS_REPLY.state.decisions[0].batches.w1 must be int",
        ),
        (lambda s: s["decision_s"].update(count=True), "STATUS_REPLY.state.decision_s.count must be int"),
        (lambda s: s.pop("t"), "STATUS_REPLY.state lacks required field 't'"),
    ],
)
def test_a_bad_nested_value_is_refused_naming_its_path(change: Callable[[dict[str, Any]], object], text: str) -> None:
    env = _status_envelope()
    change(env["state"])
    with pytest.raises(ProtocolError) as info:
        decode([msgpack.packb(env)])
    assert info.value.code == "bad_field" and info.value.text == text and info.value.ref == 4


def test_every_message_type_has_annotations_the_codec_takes() -> None:
    for name, cls in MESSAGE_TYPES.items():
        assert isinstance(decode_map(cls, _required_values(cls), name), cls)


def _required_values(cls: type[Any]) -> dict[str, Any]:
    """A value for each required field of a message type (all of them are scalars, maps or STATUS)."""
    samples: dict[str, dict[str, Any]] = {
        "HELLO": {"role": "worker"},
        "WELCOME": {"id": "w0", "config": {}, "shards": []},
        "ASSIGNMENT": {"assignment_id": 1},
        "PARAMS": {"version": 1},
        "PUSH": {"samples": 1},
        "PUSH_ACK": {"version": 1},
        "EVAL": {"version": 1, "test_loss": 0.5, "test_acc": 0.9},
        "STATUS_REPLY": {"state": {"t": 0.0}},
        "ERROR": {"code": "c", "text": "t"},
        "INIT": {"names": ["w"], "shapes": [[2]], "dtypes": ["float32"], "train_size": 1},
        "INIT_ACK": {"version": 0},
    }
    return samples.get(cls.TYPE, {})


def test_annotations_the_codec_cannot_check_are_refused_when_first_used() -> None:
    @dataclass
    class Either:
        value: int | str

    @dataclass
    class Maybe:
        value: int | None = None

    assert decode_map(Maybe, {"value": None}, "maybe") == Maybe(None)
    with pytest.raises(TypeError, match="only X | None"):
        decode_map(Either, {"value": 1}, "either")


def test_a_protocol_error_survives_pickling_as_itself() -> None:
    """A simulation in bench's process pool that raises one reaches the study as itself (it used to fail to unpickle
    and break the pool, hiding the error)."""
    import pickle

    from dynabatch.ps.shard_state import StaleGradient

    back = pickle.loads(pickle.dumps(ProtocolError("bad_state", "w3 already pushed chunk 0", 7)))
    assert (type(back), back.code, back.text, back.ref) == (ProtocolError, "bad_state", "w3 already pushed chunk 0", 7)
    stale = pickle.loads(pickle.dumps(StaleGradient("old")))
    assert (type(stale), stale.code, stale.text) == (StaleGradient, "too_stale", "old")


def test_a_hello_of_a_role_that_does_not_exist_is_refused_naming_the_roles() -> None:
    env = {"v": PROTOCOL_VERSION, "type": "HELLO", "job": "j", "sender": "", "seq": 1, "chunks": [], "role": "boss"}
    with pytest.raises(ProtocolError, match="HELLO.role must be one of worker, evaluator, ps") as info:
        decode([msgpack.packb(env)])
    assert info.value.code == "bad_field"
    env["role"] = "ps"
    assert decode([msgpack.packb(env)]).body.role is Role.SHARD
