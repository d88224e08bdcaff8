"""State beyond parameters: the buffers a training forward changes (BatchNorm's running statistics).

They are part of the model's signature, travel beside the parameters with shard 0,
are averaged there (ps/shared_buffers.py), and are what the evaluator and the
checkpoint (so the export) use. Without them a BatchNorm model evaluates at chance.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from dynabatch.cluster.ports import free_port
from dynabatch.common.net.transport import Connection, RemoteError
from dynabatch.common.tasks.task_check import check_task, load_task
from dynabatch.common.wire.chunking import BUFFERS_ID, TravellingBuffers, flat_params, load_flat
from dynabatch.common.wire.frames import ChunkMeta
from dynabatch.common.wire.messages import Init, Params, Pull, Push, PushAck
from dynabatch.common.wire.model_signature import ModelSignature, ParamSpec, signature_fields, signature_from_fields
from dynabatch.optim import SGD
from dynabatch.ps.shared_buffers import SharedBuffers
from dynabatch.task import Task
from dynabatch.worker.evaluator import evaluate
from hang_guard import hang_guard_s
from harness import Cluster, checkpoint_state, run_job, wait_for

TASKS = Path(__file__).resolve().parent / "tasks"
BN_TASK = f"{TASKS / 'blobs_bn.py'}:task"
NAMES = ("1.running_mean", "1.running_var")
SPECS = (ParamSpec(NAMES[0], (5,), "float32"), ParamSpec(NAMES[1], (5,), "float32"))


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5))


# The shard's rule, directly.


def test_one_worker_keeps_exactly_the_running_statistics_of_single_process_torch() -> None:
    reference, worker = _bn_net(), _bn_net()
    buffers = TravellingBuffers(NAMES)
    shared = SharedBuffers.initial(SPECS, buffers.read(worker))
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randn(16, 6, generator=gen) * 3 + 2
        reference(x)
        buffers.load(worker, shared.sent_to("w0"))  # a pull
        worker(x)
        pushed = buffers.read(worker)
        assert pushed is not None
        shared.take("w0", pushed, 16)  # a push
        assert shared.settle()  # asgd: the push was an update
    for name, value in shared.named().items():
        torch.testing.assert_close(value, reference.get_buffer(name), rtol=0, atol=1e-6)
    assert not torch.equal(shared.named()[NAMES[0]], torch.zeros(5)), "the statistics did move"


def test_an_update_applies_the_sample_weighted_mean_of_the_changes_pushed_since_the_last() -> None:
    shared = SharedBuffers.initial(SPECS, torch.zeros(10))
    base = shared.sent_to("w0")
    shared.sent_to("w1")
    shared.take("w0", base + 1.0, 30)
    shared.take("w1", base + 5.0, 10)
    assert shared.values is base, "a round that has not closed changes nothing"
    assert shared.settle()
    torch.testing.assert_close(shared.values, torch.full((10,), (30 * 1.0 + 10 * 5.0) / 40))
    assert not shared.settle(), "an update with no buffers pushed since the last moves nothing"


def test_a_stale_worker_adds_its_own_change_instead_of_pulling_the_estimate_back() -> None:
    shared = SharedBuffers.initial(SPECS, torch.zeros(10))
    stale = shared.sent_to("slow")
    for _ in range(3):
        shared.take("fast", shared.sent_to("fast") + 1.0, 32)
        shared.settle()
    shared.take("slow", stale + 0.5, 32)  # its statistics moved by 0.5 from the estimate it was sent
    shared.settle()
    torch.testing.assert_close(shared.values, torch.full((10,), 3.5))


def test_a_worker_the_shard_sent_nothing_counts_from_the_current_buffers_and_leavers_are_forgotten() -> None:
    shared = SharedBuffers.initial(SPECS, torch.ones(10))
    shared.take("w9", torch.full((10,), 3.0), 8)  # e.g. the shard restarted since w9's pull
    shared.settle()
    torch.testing.assert_close(shared.values, torch.full((10,), 3.0))
    shared.sent_to("w0")
    shared.sent_to("evaluator")
    shared.forget({"w0", "w1"})
    assert set(shared.sent) == {"w0"}


def test_buffers_being_sent_are_never_written_over() -> None:
    shared = SharedBuffers.initial(SPECS, torch.zeros(10))
    sending = shared.sent_to("w0")
    shared.take("w0", sending + 1.0, 8)
    shared.settle()
    assert torch.equal(sending, torch.zeros(10)) and torch.equal(shared.values, torch.ones(10))


def test_the_checkpoint_form_is_a_state_dict_part_and_refuses_other_buffers() -> None:
    shared = SharedBuffers.initial(SPECS, torch.arange(10.0))
    named = shared.named()
    assert list(named) == list(NAMES) and all(t.shape == (5,) for t in named.values())
    net = _bn_net()
    net.load_state_dict({**net.state_dict(), **named})
    assert torch.equal(net.state_dict()["1.running_var"], torch.arange(5.0, 10.0))
    restored = SharedBuffers.initial(SPECS, None)
    restored.restore(named)
    assert torch.equal(restored.values, shared.values)
    with pytest.raises(ValueError, match="checkpoint holds buffers"):
        restored.restore({NAMES[0]: torch.zeros(5)})


# The signature.


class _Scaled(nn.Module):
    """BatchNorm plus a constant buffer that a forward reads but never changes."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x * self.scale)
        return out


def test_the_check_finds_the_floating_buffers_a_training_forward_changes_and_only_those() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    sig, _, _ = check_task(Task(model=_Scaled, train_data=lambda: data), seed=0)
    assert sig.buffers == (
        ParamSpec("net.1.running_mean", (3,), "float32"),
        ParamSpec("net.1.running_var", (3,), "float32"),
    )
    assert "net.1.num_batches_tracked" not in sig.buffer_names and "scale" not in sig.buffer_names
    plain, _, _ = check_task(load_task(f"{TASKS / 'blobs.py'}:task"), seed=0)
    assert plain.buffers == () and plain.buffer_total == 0


def test_a_signature_whose_buffers_differ_names_the_first_differing_buffer() -> None:
    sig, _, _ = check_task(load_task(BN_TASK), seed=0)
    assert sig.buffer_names == NAMES and sig.buffer_total == 64
    narrower = replace(sig, buffers=(sig.buffers[0], ParamSpec("1.running_var", (16,), "float32")))
    assert sig.difference(narrower) == (
        "buffer 1 is 1.running_var [32] float32 here but 1.running_var [16] float32 in the job"
    )
    assert sig.difference(replace(sig, buffers=())) == (
        "2 travelling buffers here, 0 in the job (first unmatched: 1.running_mean)"
    )
    assert sig.difference(sig) is None


def test_buffers_travel_in_inits_fields_which_stay_optional_for_older_peers() -> None:
    sig, _, _ = check_task(load_task(BN_TASK), seed=0)
    fields = signature_fields(sig)
    assert signature_from_fields(**fields) == sig
    older = {k: v for k, v in fields.items() if not k.startswith("buffer_")}
    assert signature_from_fields(**older) == ModelSignature(sig.params, sig.train_size)
    with pytest.raises(ValueError, match="buffer 1.running_mean: dtype 'int64'"):
        signature_from_fields(**{**fields, "buffer_dtypes": ["int64", "float32"]})
    with pytest.raises(ValueError, match="2 buffer names, 1 shapes"):
        signature_from_fields(**{**fields, "buffer_shapes": [[32]]})


# A shard on the wire.


def _bn_model() -> tuple[ModelSignature, Init, torch.Tensor, torch.Tensor | None]:
    """The blobs_bn task's model as a worker offers it: signature, INIT, flat parameters, flat buffers."""
    task = load_task(BN_TASK)
    sig, _, _ = check_task(task, seed=0)
    model = task.build_model(0)
    return sig, Init(**signature_fields(sig)), flat_params(model), TravellingBuffers(sig.buffer_names).read(model)


def _pull(conn: Connection, buffers: bool = True) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """(parameters, their version, buffers or None) from a one-chunk shard."""
    reply = conn.request(Pull(buffers=buffers), 10)
    assert isinstance(reply.body, Params), reply.body
    got = {meta.id: (meta, t.clone()) for meta, t in zip(reply.chunks, reply.tensors, strict=True)}
    meta, params = got.pop(0)
    return params, meta.version, got.pop(BUFFERS_ID)[1] if BUFFERS_ID in got else None


def _push(
    conn: Connection, params: torch.Tensor, version: int, buffers: torch.Tensor | None, samples: int = 32
) -> PushAck:
    metas = [ChunkMeta(0, "float32", (params.numel(),), version)]
    tensors = [torch.zeros_like(params)]
    if buffers is not None:
        metas.append(ChunkMeta(BUFFERS_ID, "float32", (buffers.numel(),), 0))
        tensors.append(buffers)
    ack = conn.request(Push(samples=samples), 10, metas, tensors).body
    assert isinstance(ack, PushAck), ack
    return ack


@pytest.fixture(scope="module")
def bn_shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Connection, Path, torch.Tensor | None]]:
    tmp = tmp_path_factory.mktemp("bn_shard")
    c = Cluster(tmp, ["--epochs", "1000", "--liveness-timeout-s", "60", "--global-batch", "64"])
    try:
        c.scheduler()
        c.shard(0, None, "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-interval-s", "3600")
        sig, init, flat, buffers = _bn_model()
        _, welcome = c.join_as_worker(model=(init, flat, buffers))
        yield c.client(welcome.shards[0], sender=welcome.id), tmp / "ckpt" / "shard-0.pt", buffers
    finally:
        c.stop()


@pytest.mark.slow
def test_a_pull_that_asks_gets_the_buffers_and_a_push_moves_them(
    bn_shard: tuple[Connection, Path, torch.Tensor | None],
) -> None:
    conn, _, initial = bn_shard
    params, version, held = _pull(conn)
    assert held is not None and held.numel() == 64
    assert _pull(conn, buffers=False)[2] is None, "a pull that does not ask gets no buffers"
    moved = held + torch.linspace(0.5, 1.0, 64)
    assert _push(conn, params, version, moved).version == version + 1
    _, after_version, after = _pull(conn)
    assert after_version == version + 1
    torch.testing.assert_close(after, moved)  # asgd, one worker: its statistics become the job's


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad, code",
    [
        (lambda b: b[:10], "bad_shape"),
        (lambda b: torch.full_like(b, math.nan), "non_finite"),
    ],
    ids=["wrong length", "NaN"],
)
def test_a_bad_buffer_entry_is_refused_and_changes_nothing(
    bn_shard: tuple[Connection, Path, torch.Tensor | None], bad: Callable[[torch.Tensor], torch.Tensor], code: str
) -> None:
    conn, _, _ = bn_shard
    params, version, held = _pull(conn)
    assert held is not None
    with pytest.raises(RemoteError) as refused:
        _push(conn, params, version, bad(held))
    assert refused.value.code == code
    params_after, version_after, held_after = _pull(conn)
    assert held_after is not None
    assert version_after == version and torch.equal(params_after, params) and torch.equal(held_after, held)


@pytest.mark.slow
def test_a_worker_whose_buffers_differ_is_refused_naming_the_buffer_and_the_checkpoint_keeps_them(
    bn_shard: tuple[Connection, Path, torch.Tensor | None],
) -> None:
    conn, ckpt, initial = bn_shard
    sig, init, _, _ = _bn_model()
    other = Init(**signature_fields(replace(sig, buffers=(sig.buffers[0], replace(sig.buffers[1], shape=(16,))))))
    with pytest.raises(RemoteError) as refused:
        conn.request(other, 10)
    assert refused.value.code == "signature"
    assert "buffer 1 is 1.running_var [16] float32 here but 1.running_var [32] float32" in refused.value.text
    state = checkpoint_state(ckpt)  # written right after the first INIT
    assert list(state["buffers"]) == list(NAMES)
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in state["buffers"].values()]), initial)


@pytest.mark.slow
def test_a_restarted_shard_serves_the_buffers_it_checkpointed(tmp_path: Path) -> None:
    c = Cluster(tmp_path, ["--epochs", "1000", "--liveness-timeout-s", "60"])
    port = free_port()
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval-s", "3600"]
    try:
        c.scheduler()
        shard = c.shard(0, port, *ckpt)
        _, init, flat, buffers = _bn_model()
        _, welcome = c.join_as_worker(model=(init, flat, buffers))
        conn = c.client(welcome.shards[0], sender=welcome.id)
        params, version, held = _pull(conn)
        assert held is not None
        _push(conn, params, version, held + 2.0)
        _, _, before = _pull(conn)
        shard.proc.send_signal(signal.SIGTERM)
        assert shard.proc.wait(hang_guard_s(20)) == 0
        c.shard(0, port, *ckpt)

        def pulled() -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
            try:
                return _pull(conn)
            except TimeoutError:
                return None

        torch.testing.assert_close(wait_for("the restarted shard to serve", pulled, 60)[2], before)
    finally:
        c.stop()


# End to end.


def _trained_accuracy_in_one_process(epochs: int, batch: int) -> float:
    """blobs_bn trained by plain torch in this process with the task's SGD: the reference."""
    task = load_task(BN_TASK)
    assert isinstance(task.optimizer, SGD) and task.eval_data is not None
    model, data = task.build_model(0), task.train_data()
    opt = torch.optim.SGD(model.parameters(), lr=task.optimizer.lr, momentum=task.optimizer.momentum)
    gen = torch.Generator().manual_seed(0)
    for _ in range(epochs * len(data) // batch):
        opt.zero_grad()
        batch_data = task.collate_fn()([data[i] for i in torch.randint(0, len(data), (batch,), generator=gen)])
        torch.autograd.backward(task.loss_fn()(model, batch_data))
        opt.step()
    return evaluate(task, model, task.eval_data(), torch.device("cpu"))["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ["--task", BN_TASK, "--protocol", "asgd"],
        # local's workers step with the job's SGD (the task's optimizer would be refused): the task's settings as flags
        ["--task", BN_TASK.replace(":task", ":job_sgd"), "--protocol", "local", "--lr", "0.1", "--momentum", "0.5"],
        ["--task", BN_TASK, "--protocol", "ssgd", "--pipeline", "on"],
    ],
    ids=["asgd", "local", "ssgd-pipelined"],
)
def test_a_batchnorm_model_evaluates_with_the_jobs_statistics_not_the_factorys(
    tmp_path: Path, flags: list[str]
) -> None:
    run, _ = run_job(
        tmp_path,
        "r",
        "--workers",
        "2",
        "--slowdowns",
        "1",
        "2",
        "--epochs",
        "3",
        "--global-batch",
        "64",
        "--eval-interval-s",
        "2",
        *flags,
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and summary["final_eval"], summary
    reported = summary["final_metrics"]["accuracy"]
    reference = _trained_accuracy_in_one_process(epochs=3, batch=64)
    assert reported >= 0.9 and reported >= reference - 0.03, (reported, reference)

    task = load_task(BN_TASK)
    state = checkpoint_state(run / "checkpoints" / "shard-0.pt")
    trained = torch.cat([state["params"][cid] for cid in sorted(state["params"])])
    with_job_statistics, factory_fresh = task.build_model(0), task.build_model(0)
    for model in (with_job_statistics, factory_fresh):
        load_flat(model, trained)
    with_job_statistics.load_state_dict({**with_job_statistics.state_dict(), **state["buffers"]})
    assert task.eval_data is not None
    cpu, test = torch.device("cpu"), task.eval_data()
    assert evaluate(task, with_job_statistics, test, cpu)["accuracy"] == pytest.approx(reported, abs=0.005)
    fresh = evaluate(task, factory_fresh, test, cpu)["accuracy"]
    assert fresh < 0.4, f"the trained parameters with the factory's statistics evaluate to {fresh}, not chance"
