"""ps/param_buffers.py and the shard's use of it: memory lent to a reply is never written while the reply
may be read, and memory no reply holds is reused (in place, or as a spare) instead of allocated."""

from __future__ import annotations

import torch
import zmq

from dynabatch import optim as optim_spec
from dynabatch.common.wire.chunking import make_layout
from dynabatch.ps.param_buffers import ParamBuffers
from dynabatch.ps.shard_state import ShardState
from harness import wait_for


def test_a_lent_tensor_becomes_a_spare_only_once_its_frames_are_gone() -> None:
    memory = ParamBuffers()
    old = torch.ones(8)
    frame = memory.lend(old)
    memory.retire(old)
    spare = memory.spare(old)
    assert spare is not old and memory.lent(old), "memory a reply holds was handed out to be written"
    del frame
    memory.retire(spare)
    assert not memory.lent(old)
    assert {id(memory.spare(old)), id(memory.spare(old))} == {id(old), id(spare)}, "free memory was not reused"


def test_a_spare_has_the_size_asked_for() -> None:
    memory = ParamBuffers()
    memory.retire(torch.ones(8))
    assert memory.spare(torch.ones(4)).numel() == 4


def _shard(total: int = 64) -> ShardState:
    """One chunk of `total` parameters under asgd with SGD."""
    layout = make_layout(total, total * 4, 1)
    spec = optim_spec.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
    state = ShardState.initial(layout.chunks, torch.arange(total, dtype=torch.float32), spec, "asgd", 32)
    state.set_membership({"w0"}, allocated=1)
    return state


def _push(state: ShardState) -> None:
    grads = {c.id: torch.ones(c.length) for c in state.chunks}
    state.push("w0", grads, dict(state.chunk_versions), 32, "grad", 0.0)


def test_a_step_writes_in_place_only_parameters_no_reply_holds() -> None:
    state = _shard()
    cid = state.chunks[0].id
    before = state.params[cid]
    _push(state)
    assert state.params[cid] is before, "parameters no reply holds are stepped where they are"
    ((_, tensor, _),) = state.pull([cid])
    frame = state.lend(tensor)
    sent = bytes(frame)
    _push(state)
    _push(state)
    assert bytes(frame) == sent, "a step wrote parameters a reply still held"
    assert state.params[cid] is not tensor


def test_memory_zeromq_has_sent_is_reused_not_allocated() -> None:
    """Over a real socket: once the peer has the reply, pyzmq lets go and the next steps reuse that memory
    (a step while pyzmq still holds it takes a spare: test_a_step_writes_in_place_only_parameters_no_reply_holds)."""
    state = _shard(1 << 15)  # 128 KiB: above pyzmq's copy threshold, so the frame is the shard's own memory
    cid = state.chunks[0].id
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        dealer.send(b"hello")
        identity = router.recv_multipart()[0]
        used: list[torch.Tensor] = []  # every tensor that held the chunk, kept so that their ids stay distinct
        for _ in range(20):
            ((_, tensor, _),) = state.pull([cid])
            router.send_multipart([identity, state.lend(tensor)], copy=False)
            payload = dealer.recv(copy=False)
            assert torch.equal(torch.frombuffer(bytearray(payload.bytes), dtype=torch.float32), tensor)
            del payload

            # pyzmq lets go of a sent frame from its own garbage-collector thread, which a loaded machine may
            # run late: the reuse is what is tested, not that thread's timing
            def let_go(t: torch.Tensor = tensor) -> bool:
                return not state.memory.lent(t)

            wait_for("pyzmq to let go of the sent frame", let_go, 30, 0.001)
            _push(state)
            used.append(state.params[cid])
        distinct = len({id(t) for t in used})
        assert distinct <= 3, f"{distinct} tensors for one chunk in 20 steps: memory is not reused"
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
