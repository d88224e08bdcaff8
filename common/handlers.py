"""A receiver's table of handlers by message type, each typed by the body it takes.

A role's loop decodes a message (common/wire.py gives `Message[Any]`) and hands it
to the handler registered for its body's class; a message of any other type is
refused (`unexpected_type`). A handler is registered with its body's class, so it
takes a `Message[Pull]`, not a message whose body it reads back by annotation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from dynabatch.common.error_codes import ErrorCode
from dynabatch.common.wire import B, Message, ProtocolError

Context = TypeVar("Context")


class Handlers(Generic[Context]):
    """Message type -> its handler, called with the message and the `Context` it came in (its connection)."""

    def __init__(self, receiver: str) -> None:
        """`receiver` names the role in the refusal of a type it does not take ("a shard")."""
        self.receiver = receiver
        self._table: dict[type[Any], Callable[[Message[Any], Context], None]] = {}

    def on(self, body: type[B], handler: Callable[[Message[B], Context], None]) -> None:
        """Hand every message whose body is a `body` to `handler`."""
        self._table[body] = handler

    def handle(self, msg: Message[Any], context: Context) -> None:
        """Hand `msg` to its type's handler; ProtocolError (`unexpected_type`) if this receiver takes none."""
        handler = self._table.get(type(msg.body))
        if handler is None:
            raise ProtocolError(ErrorCode.UNEXPECTED_TYPE, f"{self.receiver} does not take {msg.type}", msg.seq)
        handler(msg, context)
