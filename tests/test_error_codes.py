"""The reasons of ERROR are one enum (common/wire/error_codes.py): every code raised in the tree is a member, every
member says when it is sent, ProtocolError takes nothing else, and receivers branch on members, not strings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dynabatch.common.net.scheduler_link import RETRYABLE
from dynabatch.common.wire.error_codes import LOCAL_ONLY, ErrorCode
from dynabatch.common.wire.frames import Message, ProtocolError, decode, encode
from dynabatch.common.wire.messages import Error

REPO = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("api", "common", "ps", "worker", "scheduler", "cluster", "cli", "bench")
RAISERS = ("ProtocolError", "RemoteError", "Error")  # each takes the code first, or as `code=`


def _sources() -> list[tuple[Path, ast.AST]]:
    return [
        (path, ast.parse(path.read_text(), filename=str(path)))
        for folder in CODE_FOLDERS
        for path in sorted((REPO / folder).glob("*.py"))
    ]


def _called(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")


def _literal_codes(node: ast.Call) -> list[str]:
    code = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "code"), None)
    return [code.value] if isinstance(code, ast.Constant) and isinstance(code.value, str) else []


def test_every_code_the_tree_names_is_a_member() -> None:
    """Raise sites still written as strings (a StrEnum keeps them working until they are converted) and every
    `ErrorCode.NAME` (a misspelt one fails only when its path runs, which for a refusal may be rare)."""
    literal, attributes = [], []
    for path, tree in _sources():
        for node in ast.walk(tree):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and _called(node) in RAISERS:
                literal += [(code, where) for code in _literal_codes(node)]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ErrorCode":
                attributes.append((node.attr, where))
    assert len(literal) + len(attributes) > 50, "the scan finds the codes the tree raises"
    unknown = sorted(where for code, where in literal if code not in set(ErrorCode))
    unknown += sorted(where for name, where in attributes if name not in ErrorCode.__members__)
    assert not unknown, f"codes that are not ErrorCode members: {unknown}"


def test_the_converted_folders_raise_members_not_strings() -> None:
    """ps/, worker/ and scheduler/ join `converted` once their raise sites are converted (one mechanical pass)."""
    converted = ("api", "common", "cluster", "cli", "ps", "worker", "scheduler")
    found = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path, tree in _sources()
        if path.parent.name in converted
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _called(node) in RAISERS and _literal_codes(node)
    ]
    assert not found, f"a code written as a string (use ErrorCode) at {found}"


def _is_code(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "code") or (
        isinstance(node, ast.Attribute) and node.attr == "code"
    )


def _is_string(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_string(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_no_branch_compares_a_code_with_a_string() -> None:
    """A receiver's decision names a member, so that renaming or dropping a code cannot leave a dead branch."""
    found = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(
            _is_code(a) and _is_string(b) or _is_string(a) and _is_code(b)
            for a, b in zip([node.left, *node.comparators], node.comparators, strict=False)
        )
    ]
    assert not found, f"code compared with a string literal at {found}"


def test_each_member_is_documented_and_unique() -> None:
    source = (REPO / "common" / "wire" / "error_codes.py").read_text().splitlines()
    undocumented = []
    for member in ErrorCode:
        line = next(i for i, text in enumerate(source) if text.strip() == f'{member.name} = "{member.value}"')
        above = source[line - 1].strip()
        if not above.startswith("#") or above.startswith("# --"):
            undocumented.append(member.name)
    assert not undocumented, f"members without a comment saying when they are sent: {undocumented}"
    assert len(ErrorCode.__members__) == len(ErrorCode), "two members share a value (an alias)"
    assert all(member.value == member.name.lower() for member in ErrorCode)


def test_protocol_error_refuses_a_code_that_is_not_a_member() -> None:
    with pytest.raises(ValueError, match="'bad_feild' is not an ErrorCode"):
        ProtocolError("bad_feild", "a typo at a raise site")
    for local in LOCAL_ONLY:
        with pytest.raises(ValueError, match="never sent"):
            ProtocolError(local, "a worker's own label")


def test_a_code_travels_as_its_plain_string_and_a_received_one_matches_its_member() -> None:
    """A plain string that is a code is taken (the raise sites not yet converted), and the ERROR it answers
    with decodes, on the other side, to a string that the receivers' branches match."""
    error = ProtocolError("not_ready", "2 of 3 shards registered", ref=7)
    assert error.code is ErrorCode.NOT_READY and str(error) == "not_ready: 2 of 3 shards registered"
    received = decode(encode(Message(error.to_error(), job="j", sender="scheduler", seq=7))).body
    assert isinstance(received, Error) and type(received.code) is str and received.code == "not_ready"
    assert received.code in RETRYABLE and received.code == ErrorCode.NOT_READY
