"""Every reason a dynabatch process refuses a message: the `code` of ERROR, one enum shared by every role.

A code is a stable label: it travels in ERROR (as its plain string; an ErrorCode is
a str), it names the `dynabatch_bad_messages_total` and `dynabatch_worker_errors_total`
series, and the receiver of an ERROR branches on it. Each member says when it is sent
and what its receiver does. `ProtocolError` (common/wire/frames.py) takes only these codes;
an ERROR that arrives may carry any string (`RemoteError.code`), which matches no
member and is handled as a failed request.

How every receiver of a refusal behaves unless its code says otherwise: the refusing
process counts it (`dynabatch_bad_messages_total{role,code}`), logs it at a bounded
rate, changes nothing and answers ERROR; a worker's step that gets it fails, is not
counted, and is tried again after waiting up to one heartbeat for a new assignment;
a HELLO that gets it ends the process's registration for good (it exits, saying why).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """The reason an ERROR gives (see the module's docstring for what a receiver does by default)."""

    # -- The envelope and its frames (common/wire/frames.py): a peer with a bug, or not a dynabatch peer at all.
    # Frame 0 is empty, not msgpack, or not a map.
    MALFORMED = "malformed"
    # The envelope's protocol version is not this process's: mixed dynabatch versions in one job.
    VERSION = "version"
    # The envelope names a message type that does not exist.
    UNKNOWN_TYPE = "unknown_type"
    # A known type this receiver does not take (a PUSH to the scheduler), or, in a worker, a shard's answer of the
    # wrong type (raised locally as RemoteError: the step fails and is retried).
    UNEXPECTED_TYPE = "unexpected_type"
    # Frame 0 is larger than this receiver accepts for its model (WireLimits).
    TOO_LARGE = "too_large"
    # The envelope declares a different number of chunks than it has tensor frames.
    FRAME_COUNT = "frame_count"
    # A tensor frame's byte length differs from what its declared dtype and shape need.
    FRAME_LENGTH = "frame_length"
    # A field missing, of the wrong type, or beyond what its sender was assigned: the envelope's keys, a body's
    # fields, INIT's signature, optimizer and schedule, PUSH.samples and versions, HELLO's and HEARTBEAT's
    # fields, EVAL.version. A worker whose INIT gets it stops with a TaskError naming the field.
    BAD_FIELD = "bad_field"
    # The chunk entries are malformed, too many, repeated or of the wrong dtype, or a message lacks the chunks it
    # must carry; in a worker, a shard answered with chunks it was not asked for (raised locally).
    BAD_CHUNK = "bad_chunk"
    # A chunk's element count differs from the receiver's layout for that id.
    BAD_SHAPE = "bad_shape"
    # A chunk id this shard does not hold.
    UNKNOWN_CHUNK = "unknown_chunk"
    # A tensor holds NaN or Inf: nothing of it is applied.
    NON_FINITE = "non_finite"

    # -- Who is speaking (CURVE key, connection, membership).
    # The connection's key is of a role that may not send this (a worker's key sending a shard's HELLO).
    BAD_ROLE = "bad_role"
    # The named sender registered from another connection, or may not send this (EVAL from a non-evaluator).
    # The scheduler link takes it as being forgotten: the process registers again under a new id.
    BAD_SENDER = "bad_sender"
    # The sender is not registered (the scheduler restarted or dropped it) or not a live worker of this shard
    # (it may just be joining). The scheduler does not log it. The link registers again; a worker resends a
    # refused PUSH to that shard alone until its request timeout, as the shard learns members from the scheduler.
    UNKNOWN_SENDER = "unknown_sender"
    # The envelope names another job: a process pointed at the wrong scheduler or shard.
    WRONG_JOB = "wrong_job"
    # A process whose pushes kept exceeding the gradient-norm bound (--gradient-bound): the shard refuses its
    # pushes, the scheduler its HELLO.
    QUARANTINED = "quarantined"

    # -- Registration (HELLO to the scheduler).
    # A worker's HELLO before every shard has registered. Retried: the job is still starting (scheduler_link).
    NOT_READY = "not_ready"
    # A shard asked for a slot a live shard holds (a restarted shard before its old self is declared dead).
    # Retried.
    SLOT_TAKEN = "slot_taken"
    # One source sent more HELLOs than the scheduler admits in a burst (scheduler/hello_rate.py). Retried.
    HELLO_RATE = "hello_rate"
    # Every shard slot is taken.
    NO_SLOT = "no_slot"
    # The job admits no more workers and evaluators (--max-workers).
    FULL = "full"
    # The job reached its target and is stopping: a process registering again ends instead.
    JOB_OVER = "job_over"

    # -- A shard's model and protocol.
    # A PULL or PUSH before any worker sent this shard the model (INIT).
    NOT_INITIALIZED = "not_initialized"
    # INIT's model differs from the job's (the text names the first difference); the worker stops with a TaskError.
    SIGNATURE = "signature"
    # ssgd: the worker already pushed this chunk in this round. It pulls the next round's model before trying
    # again (worker/gradient_steps.py, RoundLoop).
    BAD_STATE = "bad_state"
    # Too many answers to this connection wait unread, or too many of its pulls are parked.
    BUSY = "busy"
    # A PUSH seq this connection already used (or older than the shard remembers): a retry is a new request.
    REPLAY = "replay"
    # A PUSH computed on a version the job rolled back; in a worker also raised locally when the scheduler
    # announces a rollback during a step. The worker pulls the model again.
    ROLLED_BACK = "rolled_back"
    # A gradient computed on too old a model, discarded by the protocol (ssgd, msync, ringmaster, rennala): nothing
    # changed.
    # Not an error to the worker: counted as discarded, and it pulls and computes again at once, without waiting.
    TOO_STALE = "too_stale"
    # A push from a worker the direction check cannot vouch for yet, too far ahead of the slowest other worker
    # (ps/gradient_direction.py): nothing changed but its direction's score. Handled as TOO_STALE: the worker
    # counts the step as discarded and pulls and computes again at once.
    HELD = "held"
    # A push computed under another update protocol than the shard's (`--protocol auto` switched it while the step
    # was on its way): nothing changed, and it is no strike against the worker. Handled as TOO_STALE: the worker
    # counts the step as discarded and pulls and computes again, under the protocol its next assignment names.
    SWITCHED = "switched"
    # The receiver's handler failed (a bug): it costs that one message, logged with its traceback.
    INTERNAL = "internal"

    # -- Never sent: a worker's own labels for a step that failed without a shard's ERROR.
    # The link to a shard dropped before it answered (it stopped or restarted): the step fails now, not at the
    # timeout, and is retried.
    SHARD_LOST = "shard_lost"
    # No answer within --request-timeout-s: the step fails and is retried.
    TIMEOUT = "timeout"


LOCAL_ONLY = frozenset({ErrorCode.SHARD_LOST, ErrorCode.TIMEOUT})  # labels of a worker's failures, never on the wire


def sent_code(code: str) -> ErrorCode:
    """`code` as the ErrorCode a ProtocolError sends; ValueError for a code that is not one (a bug at the
    raise site: add the code here, with when it is sent and what its receiver does)."""
    try:
        member = ErrorCode(code)
    except ValueError:
        raise ValueError(f"{code!r} is not an ErrorCode (common/wire/error_codes.py)") from None
    if member in LOCAL_ONLY:
        raise ValueError(f"{code!r} labels a worker's own failure and is never sent in an ERROR")
    return member
