"""A change of the wire's schema is a change of the protocol.

The message dataclasses of common/wire/messages.py are the schema: a field added,
removed, renamed, retyped or given another default changes what a peer of the
other version sends or understands. So the schema's digest is recorded beside
PROTOCOL_VERSION (common/wire/frames.py's SCHEMA_FINGERPRINT), and a change to it fails
here until the version is raised and the new digest recorded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing
from collections.abc import Mapping

from dynabatch.common.wire.frames import PROTOCOL_VERSION, SCHEMA_FINGERPRINT
from dynabatch.common.wire.messages import MESSAGE_TYPES, WorkerHeartbeat


def _dataclasses_in(hint: object) -> list[type]:
    """The dataclasses an annotation names, at any depth (`dict[str, WorkerStatus]` names WorkerStatus)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return [hint]
    return [cls for arg in typing.get_args(hint) for cls in _dataclasses_in(arg)]


def _default(f: dataclasses.Field[object]) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return f"{getattr(f.default_factory, '__name__', f.default_factory)}()"
    return "required"


def schema_lines(types: Mapping[str, type]) -> list[str]:
    """One line per field of every message type and every dataclass inside one: the type's wire name (or, for a
    nested one, its class name), the field's name, annotation and default."""
    lines: list[str] = []
    seen: set[type] = set()
    todo = [(name, cls) for name, cls in sorted(types.items())]
    while todo:
        name, cls = todo.pop(0)
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            lines.append(f"{name}.{f.name}: {f.type} = {_default(f)}")
            todo.extend((nested.__name__, nested) for nested in _dataclasses_in(hints[f.name]))
    return lines


def fingerprint(types: Mapping[str, type]) -> str:
    return hashlib.sha256("\n".join(schema_lines(types)).encode()).hexdigest()[:16]


def test_the_schema_is_the_one_its_protocol_version_recorded() -> None:
    now = fingerprint(MESSAGE_TYPES)
    assert now == SCHEMA_FINGERPRINT, (
        f"the message dataclasses' fields changed (digest {now}; protocol version {PROTOCOL_VERSION} recorded "
        f"{SCHEMA_FINGERPRINT}): a change of the wire's schema is a change of the protocol. Raise PROTOCOL_VERSION "
        f'in common/wire/frames.py and record SCHEMA_FINGERPRINT = "{now}" beside it'
    )


def test_the_digest_sees_a_field_added_a_type_changed_and_a_default_changed() -> None:
    @dataclasses.dataclass
    class Added(WorkerHeartbeat):
        extra: int = 0

    @dataclasses.dataclass
    class Retyped:
        TYPE: typing.ClassVar[str] = "HEARTBEAT"
        steps: float = 0

    @dataclasses.dataclass
    class Defaulted:
        TYPE: typing.ClassVar[str] = "HEARTBEAT"
        steps: int = 1

    base = {"HEARTBEAT": WorkerHeartbeat}
    digests = {fingerprint(base)} | {fingerprint({"HEARTBEAT": cls}) for cls in (Added, Retyped, Defaulted)}
    assert len(digests) == 4
    assert fingerprint(MESSAGE_TYPES) != fingerprint({k: v for k, v in MESSAGE_TYPES.items() if k != "PULL"})
