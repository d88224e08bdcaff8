"""A receiver's handler table (common/wire/handlers.py): each message goes to its type's handler, with its context, and
the handler's answer comes back; a type without a handler is refused, naming the receiver, and calls nothing."""

from __future__ import annotations

import pytest

from dynabatch.common.wire.frames import Message, ProtocolError
from dynabatch.common.wire.handlers import Handlers
from dynabatch.common.wire.messages import Bye, Pull, Push


def test_each_message_reaches_its_types_handler_and_its_answer_comes_back() -> None:
    def pull(msg: Message[Pull], ctx: str) -> str:
        return f"pull {msg.body.ids} from {ctx}"

    def push(msg: Message[Push], ctx: str) -> str:
        return f"push of {msg.body.samples} from {ctx}"

    handlers = Handlers[str, str]("a shard")
    handlers.on(Pull, pull)
    handlers.on(Push, push)
    assert handlers.handle(Message(Pull(ids=[3, 4])), "conn-a") == "pull [3, 4] from conn-a"
    assert handlers.handle(Message(Push(samples=32)), "conn-b") == "push of 32 from conn-b"


def test_a_type_without_a_handler_is_refused_naming_the_receiver_and_calls_nothing() -> None:
    called: list[object] = []
    handlers = Handlers[str, None]("a shard")
    handlers.on(Pull, lambda msg, ctx: called.append(msg))
    with pytest.raises(ProtocolError, match="a shard does not take BYE") as info:
        handlers.handle(Message(Bye(), seq=7), "conn")
    assert info.value.code == "unexpected_type" and info.value.ref == 7 and not called
