"""What a process may call itself (`--name`, HELLO.name): the name STATUS, the console and the plots show.

A name arrives on the wire from any peer, so it is bounded and printable: one
name of megabytes, or one with control characters, would reach every STATUS
reply and every terminal that prints it.
"""

from __future__ import annotations

MAX_NAME_CHARS = 128


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a process, or None ("" is allowed: the scheduler names it by its id)."""
    if len(name) > MAX_NAME_CHARS:
        return f"name {name[:32]!r}... is longer than {MAX_NAME_CHARS} characters"
    if not name.isprintable() or name != name.strip():
        return f"name {name!r} must be printable, without surrounding spaces"
    return None
