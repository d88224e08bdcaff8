"""The wire format: a msgpack envelope frame followed by raw tensor frames.

Frame 0 is a msgpack map `{v, type, job, sender, seq, chunks, ...fields}`;
frames 1..n are the raw little-endian bytes of the tensors that `chunks`
describes, one frame per chunk. Tensors are sent from their own memory and
received as views of the ZeroMQ frames, so a 40 MB gradient is never copied by
the codec.

`decode` validates everything it can without knowing the receiver's state
(types, frame count and lengths, dtypes); a body's fields are checked against
its dataclass's annotations, nested dataclasses, string enums, `X | None`, lists and
maps of them included, and a bad value is refused naming its path
(`STATUS_REPLY.state.workers.w0.batch must be int`). The receiver then checks what only it
knows (chunk ids it owns, finiteness where the protocol needs it) with
`check_chunks` and `check_finite`. Every failure is a `ProtocolError` with a
stable code, so the roles can answer ERROR and count it by reason.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

import msgpack

if typing.TYPE_CHECKING:
    import torch
    from typing_extensions import TypeIs  # typing's own from Python 3.13

from dynabatch.common.wire.error_codes import ErrorCode, sent_code
from dynabatch.common.wire.messages import MESSAGE_TYPES, Error, Init

PROTOCOL_VERSION = 8
SCHEMA_FINGERPRINT = "1000f3edd8b8d289"
"""The digest of the message dataclasses' fields that PROTOCOL_VERSION speaks: a change of the wire's schema is a
change of the protocol, and tests/test_wire_schema.py fails until the version is raised and the new digest
recorded here."""
MAX_CHUNKS = 1 << 16
MAX_CHUNK_ELEMENTS = 1 << 30

# Byte order is part of the format; a big-endian host would have to swap.
assert sys.byteorder == "little", "dynabatch's wire format is little-endian"

# Bytes per element of every dtype that travels. By name, so that a role that only
# routes envelopes (the scheduler) checks them without importing torch (seconds of
# CPU and hundreds of MB per process); torch is imported where a tensor is made or read.
DTYPE_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}

T = TypeVar("T")

ENVELOPE_KEYS = frozenset({"v", "type", "job", "sender", "seq", "chunks"})


@dataclass(frozen=True)
class WireLimits:
    """What a receiver that knows its model's size accepts, checked before the envelope is parsed.

    A receiver without a model passes none and gets the format's own limits
    (MAX_CHUNKS, MAX_CHUNK_ELEMENTS). `max_array` bounds every list in the
    envelope (the chunk entries, PULL ids, INIT's per-parameter lists), so an
    oversized one costs msgpack a length check, not a parse.
    """

    max_chunks: int  # chunk entries, and tensor frames
    max_frame_bytes: int  # one tensor frame
    max_envelope_bytes: int  # frame 0
    max_array: int


class ProtocolError(Exception):
    """A received message that must be rejected; `code` is one of common/wire/error_codes.py's reasons (a plain
    string that is one is taken too, and any other refused with ValueError: a bug at the raise site)."""

    def __init__(self, code: ErrorCode | str, text: str, ref: int = -1) -> None:
        self.code = sent_code(code)
        super().__init__(f"{self.code}: {text}")
        self.text = text
        self.ref = ref

    def __reduce__(self) -> tuple[type[ProtocolError], tuple[str, str, int]]:
        """Pickled by its fields (the default passes the formatted message as `code` and fails to unpickle), so
        that one raised in a process pool (bench/parallel_runs.py) reaches the caller as itself."""
        return type(self), (self.code, self.text, self.ref)

    def to_error(self) -> Error:
        """The ERROR body that answers the offending message."""
        return Error(code=self.code, text=self.text)


@dataclass(frozen=True)
class ChunkMeta:
    """One tensor frame's description in the envelope."""

    id: int
    dtype: str
    shape: tuple[int, ...]
    version: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


class Body(Protocol):
    """A message body: one of common/wire/messages.py's dataclasses, named on the wire by its TYPE."""

    TYPE: ClassVar[str]


B = TypeVar("B", bound=Body)


@dataclass
class Message(Generic[B]):
    """A decoded (or to-be-sent) message: envelope fields, its body (of type `B`: decode gives `Message[Any]`,
    which a receiver's handler table narrows by the body's class, common/wire/handlers.py), tensors."""

    body: B
    chunks: list[ChunkMeta] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    job: str = ""
    sender: str = ""
    seq: int = 0

    @property
    def type(self) -> str:
        return self.body.TYPE


def chunk_meta(chunk_id: int, tensor: torch.Tensor, version: int = 0) -> ChunkMeta:
    """Describe `tensor` for the envelope."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"dtype {tensor.dtype} cannot travel; use one of {sorted(DTYPE_SIZES)}")
    return ChunkMeta(chunk_id, name, tuple(tensor.shape), version)


def encode(msg: Message[Any], tensors: Sequence[torch.Tensor | memoryview] | None = None) -> list[Any]:
    """Frames for `msg`: the packed envelope, then one zero-copy buffer per tensor of `tensors` (default
    `msg.tensors`; a memoryview is taken as the tensor's bytes, as a sender that tracks its loans to ZeroMQ
    lends them: ps/param_buffers.py)."""
    sent = msg.tensors if tensors is None else tensors
    if len(msg.chunks) != len(sent):
        raise ValueError(f"{len(msg.chunks)} chunk entries for {len(sent)} tensors")
    envelope: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "type": msg.body.TYPE,
        "job": msg.job,
        "sender": msg.sender,
        "seq": msg.seq,
        "chunks": [{"id": c.id, "dtype": c.dtype, "shape": list(c.shape), "version": c.version} for c in msg.chunks],
    }
    schema = _schema(type(msg.body))
    for name, _, _ in schema.fields:
        value = getattr(msg.body, name)
        envelope[name] = _plain(value) if schema.nested else value
    frames: list[Any] = [msgpack.packb(envelope, use_bin_type=True)]
    for tensor in sent:
        frames.append(tensor if isinstance(tensor, memoryview) else _tensor_buffer(tensor))
    return frames


def _tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a copy only if it is not contiguous)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def decode(frames: Sequence[Any], limits: WireLimits | None = None) -> Message[Any]:
    """Parse and validate frames into a Message, or raise ProtocolError.

    `frames` are bytes or zmq.Frame objects (as from `recv_multipart(copy=False)`).
    With `limits`, the envelope's size is checked before anything is parsed (it bounds
    the parse's cost), and the tensor frames' count and sizes right after the envelope,
    so that the refusal can name the offending message's seq: a worker whose model is
    larger than the shard's gets its answer, not a timeout.
    """
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED, "empty message")
    if limits is not None:
        _check_envelope_size(frames, limits)
    raw = _frame_bytes(frames[0])
    max_array = limits.max_array if limits is not None else MAX_CHUNKS * 4
    try:
        envelope = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_array_len=max_array, max_map_len=1 << 12)
    except ValueError as exc:
        if "max_array_len" in str(exc):
            raise ProtocolError(
                ErrorCode.BAD_CHUNK, f"a list in the envelope is longer than {max_array} entries"
            ) from None
        raise ProtocolError(ErrorCode.MALFORMED, f"envelope is not msgpack: {type(exc).__name__}") from None
    except Exception as exc:  # msgpack raises a zoo of types for garbage
        raise ProtocolError(ErrorCode.MALFORMED, f"envelope is not msgpack: {type(exc).__name__}") from None
    if not isinstance(envelope, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "envelope is not a map")
    seq = envelope.get("seq")
    ref = seq if _is_int(seq) else -1
    if limits is not None and envelope.get("type") != Init.TYPE:  # an INIT is judged by its signature first
        _check_frame_sizes(frames, limits, ref)
    version = envelope.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION, f"protocol version {version!r} not supported (this is {PROTOCOL_VERSION})", ref
        )
    for key, kind in (("type", str), ("job", str), ("sender", str), ("seq", int), ("chunks", list)):
        if key not in envelope:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"envelope lacks '{key}'", ref)
        if not isinstance(envelope[key], kind) or isinstance(envelope[key], bool):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"envelope '{key}' must be {kind.__name__}", ref)
    cls = MESSAGE_TYPES.get(envelope["type"])
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {envelope['type']!r}", ref)
    body = _decode_body(cls, envelope, ref)
    chunks = _decode_chunks(envelope["chunks"], ref, limits.max_chunks if limits is not None else MAX_CHUNKS)
    if len(frames) - 1 != len(chunks):
        raise ProtocolError(
            ErrorCode.FRAME_COUNT, f"{len(chunks)} chunks declared but {len(frames) - 1} tensor frames sent", ref
        )
    tensors = [_frame_tensor(frame, meta, ref) for frame, meta in zip(frames[1:], chunks, strict=True)]
    return Message(body, chunks, tensors, envelope["job"], envelope["sender"], envelope["seq"])


def _check_envelope_size(frames: Sequence[Any], limits: WireLimits) -> None:
    """Refuse an envelope larger than `limits` allow, before parsing it."""
    if _frame_size(frames[0]) > limits.max_envelope_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"an envelope of {_frame_size(frames[0])} bytes exceeds this receiver's {limits.max_envelope_bytes}",
        )


def _check_frame_sizes(frames: Sequence[Any], limits: WireLimits, ref: int) -> None:
    """Refuse more tensor frames than the receiver's chunks, or one larger than its largest chunk
    (before any tensor is built)."""
    if len(frames) - 1 > limits.max_chunks:
        raise ProtocolError(
            ErrorCode.BAD_CHUNK, f"{len(frames) - 1} tensor frames exceed this receiver's {limits.max_chunks}", ref
        )
    for i, frame in enumerate(frames[1:]):
        if _frame_size(frame) > limits.max_frame_bytes:
            raise ProtocolError(
                ErrorCode.BAD_CHUNK,
                f"tensor frame {i} of {_frame_size(frame)} bytes exceeds this "
                f"receiver's largest chunk ({limits.max_frame_bytes} bytes): a model of another size",
                ref,
            )


def _frame_size(frame: Any) -> int:
    return len(frame) if isinstance(frame, (bytes, bytearray)) else memoryview(frame).nbytes


def _frame_bytes(frame: Any) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes


def _frame_tensor(frame: Any, meta: ChunkMeta, ref: int) -> torch.Tensor:
    buf = frame if isinstance(frame, (bytes, bytearray, memoryview)) else frame.buffer
    size = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if size != meta.nbytes:
        raise ProtocolError(
            ErrorCode.FRAME_LENGTH, f"chunk {meta.id}: frame has {size} bytes, shape needs {meta.nbytes}", ref
        )
    import torch

    dtype = getattr(torch, meta.dtype)
    if meta.numel == 0:
        return torch.empty(meta.shape, dtype=dtype)
    with warnings.catch_warnings():
        # Received frames are read-only; the tensor is a view the roles never write to.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype).view(meta.shape)


def _decode_chunks(entries: list[Any], ref: int, max_chunks: int) -> list[ChunkMeta]:
    if len(entries) > max_chunks:
        raise ProtocolError(ErrorCode.BAD_CHUNK, f"{len(entries)} chunks exceed the limit {max_chunks}", ref)
    chunks = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ProtocolError(ErrorCode.BAD_CHUNK, f"chunk entry {i} is not a map", ref)
        cid, dtype, shape, ver = (entry.get(k) for k in ("id", "dtype", "shape", "version"))
        if not _is_int(cid) or cid < 0:
            raise ProtocolError(ErrorCode.BAD_CHUNK, f"chunk entry {i}: id must be a non-negative int", ref)
        if dtype not in DTYPE_SIZES:
            raise ProtocolError(
                ErrorCode.BAD_CHUNK, f"chunk {cid}: dtype {dtype!r} not one of {sorted(DTYPE_SIZES)}", ref
            )
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape) or len(shape) > 8:
            raise ProtocolError(ErrorCode.BAD_CHUNK, f"chunk {cid}: shape must be a list of non-negative ints", ref)
        if math.prod(shape) > MAX_CHUNK_ELEMENTS:
            raise ProtocolError(ErrorCode.BAD_CHUNK, f"chunk {cid}: {math.prod(shape)} elements exceed the limit", ref)
        if ver is None:
            ver = 0
        if not _is_int(ver) or ver < 0:
            raise ProtocolError(ErrorCode.BAD_CHUNK, f"chunk {cid}: version must be a non-negative int", ref)
        chunks.append(ChunkMeta(cid, dtype, tuple(shape), ver))
    return chunks


class _BadValue(Exception):
    """A value that does not fit its annotation; `path` grows (innermost first) as it propagates out."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text
        self.path: list[str] = []

    def describe(self, root: str) -> str:
        where = root
        for part in reversed(self.path):
            where += part if part.startswith("[") else f".{part}"
        return f"{where} {self.text}"


_Convert = Callable[[Any], Any]


@dataclass(frozen=True)
class _Schema:
    """How to check and build one dataclass, compiled once from its annotations.

    `fields` holds (name, converter, required); `nested` says whether a field can
    hold dataclasses, which encoding must turn into maps (flat bodies, the hot
    ones, are sent as they are).
    """

    fields: tuple[tuple[str, _Convert, bool], ...]
    nested: bool


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        schema = _SCHEMAS[cls] = _Schema(
            tuple(
                (
                    f.name,
                    _converter(hints[f.name]),
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                )
                for f in fields
            ),
            any(_holds_dataclass(hints[f.name]) for f in fields),
        )
    return schema


def _decode_body(cls: type[Any], envelope: Mapping[str, Any], ref: int) -> Any:
    try:
        return _build(cls, envelope)
    except _BadValue as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, exc.describe(cls.TYPE), ref) from None


def decode_map(cls: type[T], data: Any, where: str) -> T:
    """`data` (a map, as msgpack or JSON decodes one) as dataclass `cls`, checked as a message body is.

    For a message's parts kept outside a message (a run's timeline.json holds
    STATUS snapshots); `where` names the data in the ProtocolError.
    """
    try:
        return cast(T, _dataclass(cls)(data))
    except _BadValue as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, exc.describe(where)) from None


def _build(cls: type, data: Mapping[str, Any]) -> Any:
    """An instance of dataclass `cls` from a decoded map: required fields present, every value of its type."""
    values = {}
    for name, convert, required in _schema(cls).fields:
        if name not in data:
            if required:
                raise _BadValue(f"lacks required field '{name}'")
            continue
        try:
            values[name] = convert(data[name])
        except _BadValue as exc:
            exc.path.append(name)
            raise
    return cls(**values)


def _is_int(value: Any) -> TypeIs[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _converter(hint: Any) -> _Convert:
    """A function that checks a msgpack-decoded value against `hint` and returns it as the field holds it.

    Ints become floats where a float is declared; maps become dataclasses.
    An annotation that cannot travel is a TypeError when the class is first used.
    """
    name = _type_name(hint)
    origin = typing.get_origin(hint)
    if hint is Any:
        return _identity
    if hint is int:
        return _scalar(_is_int, name)
    if hint is float:
        return _to_float
    if hint in (str, bool, list, dict):
        return _scalar(lambda v: isinstance(v, hint), name)
    if origin in (typing.Union, types.UnionType):
        return _optional(hint, name)
    if origin is list:
        (item,) = typing.get_args(hint)
        return _list_of(_converter(item), item in (int, str, bool, Any), name)
    if origin is dict:
        key, item = typing.get_args(hint)
        return _dict_of(_converter(key), _type_name(key), _converter(item), name)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint)
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return _member_of(hint)
    raise TypeError(f"unsupported annotation {hint!r} in a message dataclass")


def _identity(value: Any) -> Any:
    return value


def _to_float(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _BadValue("must be float")


def _scalar(fits: Callable[[Any], bool], name: str) -> _Convert:
    def convert(value: Any) -> Any:
        if fits(value):
            return value
        raise _BadValue(f"must be {name}")

    return convert


def _optional(hint: Any, name: str) -> _Convert:
    """`X | None` (or Optional[X]); other unions would need a rule for which member a map is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) != 1 or len(typing.get_args(hint)) != 2:
        raise TypeError(f"unsupported annotation {hint!r} in a message dataclass: only X | None")
    inner = _converter(args[0])

    def convert(value: Any) -> Any:
        if value is None:
            return None
        try:
            return inner(value)
        except _BadValue as exc:
            if not exc.path:
                exc.text = f"must be {name}"
            raise

    return convert


def _list_of(item: _Convert, kept_as_decoded: bool, name: str) -> _Convert:
    """With `kept_as_decoded` (ints, strings) a valid list is returned as it is, not rebuilt."""

    def convert(value: Any) -> Any:
        if not isinstance(value, list):
            raise _BadValue(f"must be {name}")
        out = value if kept_as_decoded else []
        for i, v in enumerate(value):
            try:
                converted = item(v)
            except _BadValue as exc:
                exc.path.append(f"[{i}]")
                raise
            if not kept_as_decoded:
                out.append(converted)
        return out

    return convert


def _dict_of(key: _Convert, key_name: str, item: _Convert, name: str) -> _Convert:
    def convert(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _BadValue(f"must be {name}")
        out = {}
        for k, v in value.items():
            try:
                key(k)
            except _BadValue:
                raise _BadValue(f"has key {k!r}; keys must be {key_name}") from None
            try:
                out[k] = item(v)
            except _BadValue as exc:
                exc.path.append(str(k))
                raise
        return out

    return convert


def _member_of(cls: type[enum.StrEnum]) -> _Convert:
    """A string enum travels as its value; any other string is refused naming the values it may take."""
    values = [member.value for member in cls]

    def convert(value: Any) -> Any:
        if isinstance(value, str) and value in values:
            return cls(value)
        raise _BadValue(f"must be one of {', '.join(values)}")

    return convert


def _dataclass(cls: type) -> _Convert:
    def convert(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _BadValue(f"must be a map ({cls.__name__})")
        return _build(cls, value)

    return convert


def _holds_dataclass(hint: Any) -> bool:
    return dataclasses.is_dataclass(hint) or any(_holds_dataclass(a) for a in typing.get_args(hint))


def _plain(value: Any) -> Any:
    """Dataclasses as maps, all the way down (dataclasses.asdict without its deep copy of every leaf)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_chunks(msg: Message[Any], known: Mapping[int, int], dtype: str = "float32") -> None:
    """Reject chunks this receiver does not own, of the wrong dtype, or of the wrong size.

    `known` maps each chunk id the receiver holds to its number of elements.
    """
    seen: set[int] = set()
    for meta in msg.chunks:
        if meta.id not in known:
            raise ProtocolError(ErrorCode.UNKNOWN_CHUNK, f"chunk {meta.id} is not held here", msg.seq)
        if meta.id in seen:
            raise ProtocolError(ErrorCode.BAD_CHUNK, f"chunk {meta.id} appears twice", msg.seq)
        seen.add(meta.id)
        if meta.dtype != dtype:
            raise ProtocolError(ErrorCode.BAD_CHUNK, f"chunk {meta.id}: dtype {meta.dtype}, expected {dtype}", msg.seq)
        if meta.numel != known[meta.id]:
            raise ProtocolError(
                ErrorCode.BAD_SHAPE, f"chunk {meta.id}: {meta.numel} elements, expected {known[meta.id]}", msg.seq
            )


def check_finite(msg: Message[Any]) -> None:
    """Reject NaN or Inf anywhere in the tensors.

    A finite sum proves every element finite (NaN and Inf propagate through a sum),
    and one reduction is ten times cheaper than an elementwise test; only a
    non-finite sum (overflow included) falls back to the exact check.
    """
    import torch

    for meta, tensor in zip(msg.chunks, msg.tensors, strict=True):
        if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())):
            continue
        if not bool(torch.isfinite(tensor).all()):
            raise ProtocolError(ErrorCode.NON_FINITE, f"chunk {meta.id} holds NaN or Inf", msg.seq)
