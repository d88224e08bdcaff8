"""What one peer may cost the shard, derived from the size of the model it holds.

Until the shard holds a model only the wire format's own limits apply. Once it
does, an honest message is bounded by the model: at most one entry (and one
tensor frame) per chunk of this shard plus the travelling buffers' entry
(`BUFFERS_ID`), no frame larger than the largest of them, every list no longer
than the model's chunk or parameter count (or a small floor, for an optimizer's
or schedule's lists), and an envelope no larger than such lists can fill. A
message beyond that is refused before it is parsed (wire.WireLimits), so 65,536
empty chunk entries cost a length check, not a second of CPU.

Replies are bounded per peer too: at most `MAX_PARKED_PER_PEER` pulls wait on one
connection (a further one that would wait is refused `busy`: the honest worker
never has more than one pull per shard in flight, so only a peer that does not
read its answers gets there), and at most `backlog_limit` replies wait for a peer
whose ZeroMQ queue is full (ps/outbox.py); beyond that its pulls are refused and
its replies dropped, so replies never read cannot pin old versions of the model
in the shard's memory.
"""

from __future__ import annotations

from dynabatch.common.wire.frames import WireLimits

MAX_PARKED_PER_PEER = 4
ENVELOPE_BASE_BYTES = 64 << 10  # envelope keys, a body's scalars, an optimizer's and a schedule's specs
ENVELOPE_BYTES_PER_ENTRY = 256  # one chunk entry, or one parameter's name, shape and dtype in an INIT
MIN_ARRAY = 1024  # lists of an optimizer's or a schedule's spec (milestones), whatever the model's size
UNMODELLED_BACKLOG = 64  # replies that may wait for one peer before the shard holds a model (errors, INIT's acks)


def wire_limits(chunk_lengths: list[int], buffer_total: int, params: int, buffers: int) -> WireLimits:
    """Limits for a shard holding chunks of `chunk_lengths` float32 values (and `buffer_total` travelling
    buffer values, on shard 0) of a model of `params` parameters and `buffers` buffers."""
    entries = len(chunk_lengths) + 1
    longest = max(entries, params, buffers)
    return WireLimits(
        max_chunks=entries,
        max_frame_bytes=4 * max([*chunk_lengths, buffer_total]),
        max_envelope_bytes=ENVELOPE_BASE_BYTES + ENVELOPE_BYTES_PER_ENTRY * longest,
        max_array=max(MIN_ARRAY, longest),
    )


def backlog_limit(chunks: int) -> int:
    """Replies that may wait for one peer (ps/outbox.py): one per chunk for the pulls it may have
    parked, one being answered, and its acks."""
    return (chunks + 1) * (MAX_PARKED_PER_PEER + 2)
