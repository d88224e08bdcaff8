"""A receiver's table of handlers by message type, each typed by the body it takes.

A role's loop decodes a message (common/wire/frames.py gives `Message[Any]`) and hands it
to the handler registered for its body's class, which answers with a reply body
(or None); a message of any other type is refused (`unexpected_type`). A handler is
registered with its body's class, so it takes a `Message[Pull]`, not a message whose
body it reads back by annotation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from dynabatch.common.wire.error_codes import ErrorCode
from dynabatch.common.wire.frames import B, Message, ProtocolError

Context = TypeVar("Context")
Reply = TypeVar("Reply")


class Handlers(Generic[Context, Reply]):
    """Message type -> its handler, called with the message and the `Context` it came in (its connection), which
    answers with a `Reply`."""

    def __init__(self, receiver: str) -> None:
        """`receiver` names the role in the refusal of a type it does not take ("a shard")."""
        self.receiver = receiver
        self._table: dict[type[Any], Callable[[Message[Any], Context], Reply]] = {}

    def on(self, body: type[B], handler: Callable[[Message[B], Context], Reply]) -> None:
        """Hand every message whose body is a `body` to `handler`."""
        self._table[body] = handler

    def handle(self, msg: Message[Any], context: Context) -> Reply:
        """`msg`'s type's handler's answer; ProtocolError (`unexpected_type`) if this receiver takes none."""
        handler = self._table.get(type(msg.body))
        if handler is None:
            raise ProtocolError(ErrorCode.UNEXPECTED_TYPE, f"{self.receiver} does not take {msg.type}", msg.seq)
        return handler(msg, context)
