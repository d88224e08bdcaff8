"""The shard's Prometheus series, on its own registry, labelled with the shard's index."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynabatch.common.net.metrics import bad_messages_counter
from dynabatch.common.wire.error_codes import ErrorCode

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)


class ShardMetrics:
    """The shard's series, on its own registry."""

    def __init__(self, registry: CollectorRegistry, shard: str) -> None:
        labels = {"shard": shard}
        self.bad = bad_messages_counter(registry)
        self.version = Gauge(
            "dynabatch_ps_version", "Model version (updates applied) on this shard.", ["shard"], registry=registry
        ).labels(**labels)
        self.updates = Counter(
            "dynabatch_ps_updates", "Updates applied to this shard's parameters.", ["shard"], registry=registry
        ).labels(**labels)
        self.pushes = Counter(
            "dynabatch_ps_pushes", "Gradient pushes accepted, by worker.", ["shard", "worker"], registry=registry
        )
        self.pulls = Counter("dynabatch_ps_pulls", "Parameter pulls served.", ["shard"], registry=registry).labels(
            **labels
        )
        self.bytes_in = Counter(
            "dynabatch_ps_received_bytes", "Tensor bytes received in pushes.", ["shard"], registry=registry
        ).labels(**labels)
        self.bytes_out = Counter(
            "dynabatch_ps_sent_bytes", "Tensor bytes sent in pulls.", ["shard"], registry=registry
        ).labels(**labels)
        self.staleness = Histogram(
            "dynabatch_ps_staleness",
            "Versions between a gradient's base and the shard's model.",
            ["shard"],
            buckets=STALENESS_BUCKETS,
            registry=registry,
        ).labels(**labels)
        self.handle = Histogram(
            "dynabatch_ps_handle_seconds", "Time to handle one message.", ["shard", "type"], registry=registry
        )
        self.live = Gauge(
            "dynabatch_ps_live_workers", "Workers the shard counts as live.", ["shard"], registry=registry
        ).labels(**labels)
        self.serve_rank = Gauge(
            "dynabatch_ps_serve_rank",
            "The order this shard serves each worker's waiting "
            "messages in, as the scheduler ranked it (0 first; ps/serve_order.py).",
            ["shard", "worker"],
            registry=registry,
        )
        self.checkpoints = Counter(
            "dynabatch_ps_checkpoints", "Checkpoints written.", ["shard"], registry=registry
        ).labels(**labels)
        self.replies_dropped = Counter(
            "dynabatch_ps_replies_dropped",
            "Replies dropped: their peer had left too many unread.",
            ["shard"],
            registry=registry,
        ).labels(**labels)
        discarded = Counter(
            "dynabatch_ps_discarded_gradients",
            "Pushes the protocol discarded, by reason: too_stale, computed on too old a model (ssgd, msync, "
            "ringmaster, rennala), or switched, made under the protocol --protocol auto had just switched from; "
            "their workers pulled again.",
            ["shard", "reason"],
            registry=registry,
        )
        # each reason exported from the start, at 0, so that a rate over it is defined before the first discard
        self.discarded = {
            code: discarded.labels(reason=code, **labels) for code in (ErrorCode.TOO_STALE, ErrorCode.SWITCHED)
        }
        self.held = Counter(
            "dynabatch_ps_held_pushes",
            "Pushes held, by worker: it ran ahead of the slowest other "
            "worker before the direction check could vouch for it (--direction-check); nothing "
            "changed and it pulled again.",
            ["shard", "worker"],
            registry=registry,
        )
        self.clipped = Counter(
            "dynabatch_ps_clipped_pushes",
            "Pushes with a chunk clipped to the gradient bound, by worker.",
            ["shard", "worker"],
            registry=registry,
        )
        self.quarantined = Counter(
            "dynabatch_ps_quarantined_workers",
            "Workers quarantined, by reason: norm (pushes "
            "clipped again and again), direction (pushes pointing against most other "
            "workers').",
            ["shard", "reason"],
            registry=registry,
        )
        self.param_norm = Gauge(
            "dynabatch_ps_param_norm",
            "Norm of this shard's parameters (NaN or inf: not finite).",
            ["shard"],
            registry=registry,
        ).labels(**labels)
        self.model_healthy = Gauge(
            "dynabatch_ps_model_healthy",
            "1 while the parameter guard finds this shard's model finite and not exploding, else 0.",
            ["shard"],
            registry=registry,
        ).labels(**labels)
        self.checkpoints_refused = Counter(
            "dynabatch_ps_checkpoints_refused",
            "Checkpoints not written because the model was not healthy.",
            ["shard"],
            registry=registry,
        ).labels(**labels)
        self.rollbacks = Counter(
            "dynabatch_ps_rollbacks", "Rollbacks to the last good checkpoint applied.", ["shard"], registry=registry
        ).labels(**labels)
        self.clock_spread = Gauge(
            "dynabatch_ps_clock_spread",
            "ssp: the widest spread of live workers' clocks (steps) seen so far.",
            ["shard"],
            registry=registry,
        ).labels(**labels)
