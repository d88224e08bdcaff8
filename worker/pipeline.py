"""One gradient step with communication overlapped, chunk by chunk (P3 / ByteScheduler style).

The pull is sent at the start of the step and shards stream chunks front
first. A forward pre-hook on every module with parameters waits only for the
chunks that hold that module's parameters, so layer 1 computes while later
chunks are still arriving. During backward, a hook on every parameter notes
when its gradient is final; the moment every parameter overlapping a chunk is
final, that chunk's gradient is pushed, while backward goes on with earlier
layers. Bytes in flight are bounded: a push waits for acknowledgements when
sending it would exceed the credit. The scheduler may ask (WorkerAssignment.chunk_group,
credit_bytes: scheduler/chunk_schedule.py) for several of a shard's final chunks
in one PUSH and for another credit; the layout itself never changes.

A model's travelling buffers (BatchNorm's running statistics) come with shard
0's first chunk: the first module to run loads them all. Forward has finished
updating them before backward pushes anything, so they go out with the step's
first push to shard 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from dynabatch.common import staleness
from dynabatch.common.net.transport import RemoteError
from dynabatch.common.wire.chunking import Layout, TravellingBuffers, travelling
from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.worker.ps_client import Pending, PendingPull, PendingPush, PullResult, ShardClients


@dataclass
class StepTrace:
    """When things happened in one step (perf_counter seconds), for tests and profiling."""

    forward_start: dict[str, float] = field(default_factory=dict)
    backward_end: float = 0.0
    pushed_at: dict[int, float] = field(default_factory=dict)
    arrived_at: dict[int, float] = field(default_factory=dict)


@dataclass
class PipelineResult:
    loss: float
    pulled: PullResult
    pull_wait_s: float
    push_wait_s: float
    trace: StepTrace


class Pipeline:
    """Hooks a model so that its forward waits per layer and its backward pushes per chunk."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: Layout,
        shards: ShardClients,
        max_inflight_bytes: int,
        timeout_s: float,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        buffers: TravellingBuffers = TravellingBuffers(),
    ) -> None:
        self.model, self.layout, self.shards, self.loss_fn, self.buffers = model, layout, shards, loss_fn, buffers
        self.max_inflight = max_inflight_bytes
        self.timeout_s = timeout_s
        self.params = travelling(model)
        self.grad_flat = torch.zeros(layout.total)
        offsets, start = [], 0
        for p in self.params:
            offsets.append((start, start + p.numel()))
            start += p.numel()
        self.offsets = offsets
        self.param_chunks = [{c.id for c in layout.chunks if c.start < b and a < c.stop} for a, b in offsets]
        self.chunk_params = {c.id: {i for i, ids in enumerate(self.param_chunks) if c.id in ids} for c in layout.chunks}
        index = {id(p): i for i, p in enumerate(self.params)}
        buffer_owners = {name.rpartition(".")[0] for name in buffers.names}
        self._hooks: list[RemovableHandle] = []
        for name, module in model.named_modules():
            own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if own or name in buffer_owners:
                self._hooks.append(module.register_forward_pre_hook(self._before_forward(name, own)))
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready(i)))  # type: ignore[no-untyped-call]  # untyped in torch
        self._step: _StepState | None = None
        self.ahead: tuple[list[int] | None, PendingPull] | None = None  # a pull sent ahead: its versions, itself
        self.loaded: PendingPull | None = None  # the pull the last forward loaded the parameters from

    def close(self) -> None:
        """Unhook the model: the worker leaves this pipeline's loop for another protocol's (a step that failed
        leaves its state behind, which the hooks would otherwise act on in the next loop's passes)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._step = [], None

    def step(
        self,
        batch: Any,
        min_versions: list[int] | None,
        samples: int,
        group: int = 1,
        credit: int = 0,
        ahead: Callable[[list[int]], list[int] | None] | None = None,
    ) -> PipelineResult:
        """Pull, forward, backward and push for one batch, overlapped, `group` final chunks of a shard per PUSH
        within `credit` bytes unacknowledged (0: the credit the pipeline was made with); returns when every push
        is acknowledged (a batch whose loss is not finite: once the pull is in, with nothing pushed).

        With `ahead` (the versions the next step's pull waits for, from this step's shard versions) the next
        pull is sent with the first push, once this step's pull is in: a shard parks it and streams each chunk as
        its round closes, so the next model comes down the link while this gradient still goes up, and the next
        step takes that pull if it asks for the same versions."""
        counted = list(self.shards.staleness)
        sent_ahead, self.ahead = self.ahead, None
        pull = sent_ahead[1] if sent_ahead and sent_ahead[0] == min_versions else self.shards.start_pull(min_versions)
        st = self._step = _StepState(pull, samples, max(1, group), credit or self.max_inflight, ahead_of=ahead)
        self.model.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model, batch)
        self.loaded = pull
        if not bool(torch.isfinite(loss.detach())):
            # No gradient of a non-finite loss is pushed (the shards would refuse it): only the pull is finished,
            # so that its chunks are taken before the next step's pull.
            self.shards.wait([st.pull], self.timeout_s, st.pull.done)
            self._step = None
            return PipelineResult(float(loss.detach()), st.pull.result(), st.pull_wait, 0.0, st.trace)
        torch.autograd.backward(loss)  # Tensor.backward is untyped in torch; this is the function it calls
        st.trace.backward_end = time.perf_counter()
        for cid in sorted(set(self.chunk_params) - st.final):
            self._chunk_final(st, cid, flush=False)
        for shard in sorted(st.ready):
            self._push_group(st, shard)
        self._send_ahead(st)
        start = time.perf_counter()
        self._settle(st)
        if st.ahead is not None:
            self.ahead = (st.ahead_versions, st.ahead)
        st.push_wait += time.perf_counter() - start
        self.shards.staleness = counted
        for worst in st.staleness_per_shard().values():
            staleness.record(self.shards.staleness, worst)
        st.trace.arrived_at = dict(st.pull.arrived_at)
        self._step = None
        return PipelineResult(float(loss.detach()), st.pull.result(), st.pull_wait, st.push_wait, st.trace)

    def _settle(self, st: _StepState) -> None:
        """Wait for every acknowledgement; resend chunks a shard refused only because it did
        not know this worker yet (see ShardClients.push), and only those (`ShardClients.before_resend`)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.shards.wait(
                st.pendings(),
                max(0.0, deadline - time.monotonic()),
                lambda: st.pull.done() and all(p.done() for p in st.pushes),
            )
            refused = [i for i, p in enumerate(st.pushes) if p.refused]
            if not refused:
                return
            if time.monotonic() >= deadline:
                raise RemoteError(ErrorCode.UNKNOWN_SENDER, "a shard does not know this worker")
            self.shards.before_resend([st.ahead] if st.ahead is not None else [])
            for i in refused:
                st.pushes[i] = self.shards.start_push(
                    self.grad_flat,
                    st.pull.versions,
                    st.samples,
                    float("nan"),
                    ids=st.push_ids[i],
                    buffers=self._buffers_for(st, i),
                )

    def _before_forward(self, name: str, own: list[int]) -> Callable[[torch.nn.Module, object], None]:
        def hook(module: torch.nn.Module, args: object) -> None:
            st = self._step
            if st is None:
                return
            needed = set().union(*(self.param_chunks[i] for i in own))
            start = time.perf_counter()
            self.shards.wait(
                st.pendings(),
                self.timeout_s,
                lambda: st.pull.has(needed) and st.pull.buffers_in == st.pull.with_buffers,
            )
            st.pull_wait += time.perf_counter() - start
            if st.pull.with_buffers and not st.buffers_loaded:
                self.buffers.load(self.model, self.shards.buffers)
                st.buffers_loaded = True
            flat = self.shards.flat
            with torch.no_grad():
                for i in own:
                    a, b = self.offsets[i]
                    self.params[i].copy_(flat[a:b].view_as(self.params[i]))
            st.trace.forward_start.setdefault(name, time.perf_counter())

        return hook

    def _grad_ready(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            st = self._step
            if st is None:
                return
            grad = p.grad
            assert grad is not None  # a post-accumulate-grad hook runs once the gradient is in p.grad
            a, b = self.offsets[i]
            self.grad_flat[a:b].copy_(grad.reshape(-1))
            st.done_params.add(i)
            for cid in sorted(self.param_chunks[i]):
                if cid not in st.final and self.chunk_params[cid] <= st.done_params:
                    self._chunk_final(st, cid)

        return hook

    def _chunk_final(self, st: _StepState, cid: int, flush: bool = True) -> None:
        """Chunk `cid`'s gradient is final: it waits with its shard's others until they make a group (`flush`)."""
        st.final.add(cid)
        owner = self.layout.chunks[cid].owner
        st.ready.setdefault(owner, []).append(cid)
        if flush and len(st.ready[owner]) >= st.group:
            self._push_group(st, owner)

    def _send_ahead(self, st: _StepState) -> None:
        """The next step's pull, if the step has one to send ahead and has not asked yet, once its own pull is in
        (the chunks of both land in the same buffer, and backward no longer reads it)."""
        if st.ahead_of is not None and st.pull.done():
            st.ahead_versions, st.ahead_of = st.ahead_of(st.pull.result().shard_versions), None
            if st.ahead_versions is not None:
                st.ahead = self.shards.start_pull(st.ahead_versions)

    def _push_group(self, st: _StepState, shard: int) -> None:
        """Send the final chunks waiting for `shard` in one PUSH, first waiting for acknowledgements if the
        credit is used up (a group larger than the credit goes alone), or if the shard's send queue is full
        (a credit of many small pushes holds more messages than the queue does)."""
        ids = st.ready.pop(shard)
        nbytes = sum(self.layout.chunks[cid].length * 4 for cid in ids)
        start = time.perf_counter()
        credit = max(st.credit, nbytes)
        self.shards.wait(
            st.pendings(),
            self.timeout_s,
            lambda: (
                all(cid in st.pull.versions for cid in ids)
                and st.inflight(self.layout) + nbytes <= credit
                and self.shards.can_push(ids)
            ),
        )
        st.push_wait += time.perf_counter() - start
        for i in set().union(*(self.chunk_params[cid] for cid in ids)) - st.done_params:
            a, b = self.offsets[i]
            self.grad_flat[a:b].zero_()
        if self.buffers and st.buffer_push is None and shard == 0:
            st.buffer_push = len(st.pushes)
        self._send_ahead(st)
        st.pushes.append(
            self.shards.start_push(
                self.grad_flat,
                st.pull.versions,
                st.samples,
                float("nan"),
                ids=ids,
                buffers=self._buffers_for(st, len(st.pushes)),
            )
        )
        st.push_ids.append(ids)
        now = time.perf_counter()
        for cid in ids:
            st.trace.pushed_at[cid] = now

    def _buffers_for(self, st: _StepState, push: int) -> torch.Tensor | None:
        """The model's travelling buffers if push number `push` of step `st` is the one that carries them."""
        return self.buffers.read(self.model) if push == st.buffer_push else None


@dataclass
class _StepState:
    pull: PendingPull
    samples: int
    group: int = 1  # final chunks of one shard per PUSH
    credit: int = 0  # gradient bytes that may be pushed and not yet acknowledged
    done_params: set[int] = field(default_factory=set)
    final: set[int] = field(default_factory=set)  # chunks whose gradient is final (pushed, or waiting in `ready`)
    ready: dict[int, list[int]] = field(default_factory=dict)  # by shard: final chunks not yet pushed
    pushes: list[PendingPush] = field(default_factory=list)
    push_ids: list[list[int]] = field(default_factory=list)
    pull_wait: float = 0.0
    push_wait: float = 0.0
    trace: StepTrace = field(default_factory=StepTrace)
    buffers_loaded: bool = False
    buffer_push: int | None = None  # the index in `pushes` of the push that carries the travelling buffers
    ahead_of: Callable[[list[int]], list[int] | None] | None = None  # the versions of a pull to send ahead
    ahead: PendingPull | None = None  # the next step's pull, sent with the first push of this one
    ahead_versions: list[int] | None = None  # what it asks for

    def pendings(self) -> list[Pending]:
        return [self.pull, *self.pushes, *([self.ahead] if self.ahead is not None else [])]

    def staleness_per_shard(self) -> dict[int, int]:
        """The step's staleness on each shard: the most of its chunks' acknowledgements, as one whole push's
        acknowledgement reports it (the scheduler counts one update per shard per step)."""
        worst: dict[int, int] = {}
        for push in self.pushes:
            for shard, ack in push.acks.items():
                worst[shard] = max(worst.get(shard, 0), ack.staleness)
        return worst

    def inflight(self, layout: Layout) -> int:
        """Bytes pushed and not yet acknowledged."""
        pairs = zip(self.push_ids, self.pushes, strict=True)  # appended together, one list of ids per push
        return sum(layout.chunks[cid].length * 4 for ids, p in pairs if not p.done() for cid in ids)
