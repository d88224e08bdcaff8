"""ZeroMQ CURVE keys: make them (`dynabatch keys`), load them, and guard server sockets.

A job has one server keypair and one client keypair per client role, written by
`zmq.auth.create_certificates` into one flat folder (a Kubernetes Secret made with
`--from-file=keys/` holds exactly that):

| file | holds | read by |
| --- | --- | --- |
| `server.key` | the servers' public key | workers, evaluators |
| `server.key_secret` | the servers' public and secret key | scheduler, shards |
| `shard.key` / `shard.key_secret` | the shards' client key (they register with the scheduler) | scheduler / shards |
| `worker.key` / `worker.key_secret` | the workers' client key | scheduler, shards / workers |
| `evaluator.key` / `evaluator.key_secret` | the evaluators' client key | scheduler, shards / evaluators |

`dynabatch keys --name worker=gpu-a` adds `worker-gpu-a.key[_secret]`, a key of one
machine: its pod or machine is given that secret as `worker.key_secret`, the
servers admit every `ROLE-NAME.key` in their folder under the role ROLE, and
removing the public file revokes that one machine. `dynabatch run` reads every
file, since it hands the folder to every process it starts. Each process reads only
its own files (KEYS_BY_ROLE), so a worker node never holds the server secret (it
cannot pose as a server) nor another role's client secret (it cannot register a
shard or report an evaluation).

Every server (scheduler, shard) encrypts with the server secret and admits, through
a ZAP handler, only the client keys of the roles it serves: the scheduler every
role, a shard only workers and evaluators. The handler names the key's file as the
connection's ZAP user id (ZeroMQ's "User-Id" message property), so a server knows
the role behind every message (`key_role`) and refuses what that role may not send.
It admits exactly those files, not every `*.key` in the folder (which
`configure_curve(location=...)` would do, `server.key` included).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from dynabatch.common.flags import ConfigError, FlagParser, opt


class KeyRole(StrEnum):
    """A client keypair's role: the key a connection authenticated with, which decides what it may send."""

    SHARD = "shard"
    WORKER = "worker"
    EVALUATOR = "evaluator"


CLIENT_ROLES = tuple(KeyRole)  # one client keypair each
# Which client roles each server role admits (a shard is never a shard's client).
ADMITS: dict[str, tuple[KeyRole, ...]] = {
    "scheduler": CLIENT_ROLES,
    "ps": (KeyRole.WORKER, KeyRole.EVALUATOR),
    "run": CLIENT_ROLES,
}
# The client key each process connects with (`dynabatch run` only reads STATUS: any role's key would do).
CONNECTS_AS = {"ps": KeyRole.SHARD, "worker": KeyRole.WORKER, "evaluator": KeyRole.EVALUATOR, "run": KeyRole.EVALUATOR}
KEY_FILES = ("server.key", "server.key_secret") + tuple(f"{r}.key{s}" for r in CLIENT_ROLES for s in ("", "_secret"))
KEYS_BY_ROLE: dict[str, tuple[str, ...]] = {
    "scheduler": ("server.key_secret", "shard.key", "worker.key", "evaluator.key"),  # binds only
    # binds, and connects to the scheduler
    "ps": ("server.key_secret", "worker.key", "evaluator.key", "shard.key_secret"),
    "worker": ("server.key", "worker.key_secret"),  # connects only
    "evaluator": ("server.key", "evaluator.key_secret"),  # `dynabatch worker --evaluator`: connects only
    "run": KEY_FILES,  # starts all of the above with the same folder
}
NAMED_KEY = re.compile(r"^(shard|worker|evaluator)-([A-Za-z0-9][A-Za-z0-9_.-]{0,62})\.key$")
# Handshake failures a server counts as refused peers, by the reason label they get.
REFUSALS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",  # right server key, client key not admitted by ZAP
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",  # no CURVE, wrong server key, or not ZMTP at all
    # The peer hung up mid-handshake: a client without CURVE that saw the mismatch
    # first and closed before this side read its greeting lands here, not in "protocol".
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "other",
}


class CurveKeyError(ConfigError):
    """A key file that is missing or unreadable, named by its path."""


@dataclass
class CurveOptions:
    """Whether and with which keys this process encrypts and authenticates its sockets."""

    curve_dir: str = opt(
        "",
        "folder with the ZeroMQ CURVE keys made by `dynabatch keys` (empty: no encryption, any peer admitted)",
        topic="security",
    )


def key_role(user_id: str | None) -> KeyRole | None:
    """The client role of a connection's ZAP user id (`worker-gpu-a` -> `worker`); None without CURVE. The ZAP
    handler admits only files named for a KeyRole, so every user id has one."""
    return KeyRole(user_id.split("-", 1)[0]) if user_id else None


@dataclass(frozen=True)
class CurveKeys:
    """The job's keys as raw z85 bytes; each secret is loaded only where it is used.

    `admitted` maps every client public key a server admits to its user id (the
    key file's name without `.key`); it is empty where the process binds nothing.
    """

    server_public: bytes
    client_public: bytes | None  # where a socket connects
    client_secret: bytes | None
    server_secret: bytes | None  # where a socket binds
    admitted: dict[bytes, str] = field(default_factory=dict)

    @classmethod
    def load(cls, folder: str, role: str) -> CurveKeys:
        """Read the files KEYS_BY_ROLE lists for `role` (and, for a server, every named key of a role it
        admits); CurveKeyError names a missing or bad one."""
        base = Path(folder)
        files = KEYS_BY_ROLE[role]
        for name in files:  # `run` reads few of them itself, but hands the folder to roles that read each
            if not (base / name).is_file():
                raise CurveKeyError(_missing(base / name))
        server_file = "server.key_secret" if "server.key_secret" in files else "server.key"
        server_public, server_secret = _read(base / server_file, server_file.endswith("_secret"))
        client_public = client_secret = None
        own = f"{CONNECTS_AS[role]}.key_secret" if role in CONNECTS_AS else None
        if own is not None and own in files:
            client_public, client_secret = _read(base / own, True)
        admitted: dict[bytes, str] = {}
        if server_secret is not None:
            for client_role in ADMITS[role]:
                public, _ = _read(base / f"{client_role}.key", False)
                admitted[public] = client_role
            for path in sorted(base.iterdir()):
                named = NAMED_KEY.match(path.name)
                if named and named.group(1) in ADMITS[role]:
                    public, _ = _read(path, False)
                    admitted.setdefault(public, path.name[: -len(".key")])
        return cls(server_public, client_public, client_secret, server_secret, admitted)


def _missing(path: Path) -> str:
    return f"{path} is missing (`dynabatch keys --out {path.parent}` makes a job's keys)"


def _read(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveKeyError(_missing(path))
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read {path}: {exc}") from None
    if secret and secret_key is None:
        raise CurveKeyError(f"{path} holds no secret key")
    return public, secret_key


def secure_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make `sock` a CURVE client: it talks only to a server holding the server secret.

    Must run before the socket connects.
    """
    if keys.client_secret is None:
        raise CurveKeyError("this process connects a socket but loaded no client secret key")
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def secure_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make `sock` a CURVE server (before it binds); who may connect is the ZAP handler's call."""
    if keys.server_secret is None:
        raise CurveKeyError("this process binds a socket but loaded no server.key_secret")
    sock.curve_server = True
    sock.curve_publickey = keys.server_public
    sock.curve_secretkey = keys.server_secret


class AdmitClientKeys:
    """ZAP credentials provider: admits the client public keys of the roles this server serves."""

    def __init__(self, admitted: dict[bytes, str]) -> None:
        self.admitted = admitted

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.admitted


class RoleAuthenticator(ThreadAuthenticator):
    """The ZAP handler, naming each admitted connection by its key's file (`worker`, `worker-gpu-a`)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], admitted: dict[bytes, str]) -> None:
        super().__init__(ctx)
        self.admitted = admitted

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.admitted[z85.encode(client_public_key)]


def start_authenticator(ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> ThreadAuthenticator:
    """The context's ZAP handler (a daemon thread): every CURVE server socket of `ctx` asks it."""
    auth = RoleAuthenticator(ctx, keys.admitted)
    auth.start()
    auth.configure_curve_callback("*", AdmitClientKeys(keys.admitted))
    return auth


def key_name(spec: str) -> str:
    """`ROLE=NAME` (a `--name` of `dynabatch keys`) -> the key's file stem `ROLE-NAME`; ValueError if malformed."""
    role, _, name = spec.partition("=")
    stem = f"{role}-{name}"
    if not NAMED_KEY.match(stem + ".key"):
        raise ValueError(
            f"--name {spec!r}: expected ROLE=NAME with ROLE one of {', '.join(CLIENT_ROLES)} and NAME "
            "of letters, digits, '.', '_' or '-'"
        )
    return stem


def create_keys(out: Path, force: bool, names: Sequence[str] = ()) -> list[Path]:
    """Write the server keypair, one client keypair per role and one per `names` stem (`worker-gpu-a`) into
    `out`; refuses to replace keys unless `force`."""
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    stems = ["server", *CLIENT_ROLES, *names]
    paths = [out / f"{stem}.key{suffix}" for stem in stems for suffix in ("", "_secret")]
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(
            f"{', '.join(map(str, existing))} already exist (--force replaces them, "
            "and every process must then get the new keys)"
        )
    for stem in stems:
        for p in (out / f"{stem}.key", out / f"{stem}.key_secret"):
            p.unlink(missing_ok=True)
        zmq.auth.create_certificates(str(out), stem)
    for p in paths:
        os.chmod(p, 0o600 if p.name.endswith("_secret") else 0o644)
    return paths


def main(argv: Sequence[str]) -> int:
    """`dynabatch keys --out DIR [--name ROLE=NAME ...] [--force]`."""
    parser = FlagParser("dynabatch keys", "Make a job's ZeroMQ CURVE keys.")
    keys = parser.topic_groups["security"]
    keys.add_argument(
        "--out",
        required=True,
        help="folder to write server.key[_secret] and one "
        "ROLE.key[_secret] per client role (shard, worker, evaluator) into",
    )
    keys.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="ROLE=NAME",
        help="also a keypair of one machine, ROLE-NAME.key[_secret] (repeatable); give that machine "
        "its secret file as ROLE.key_secret",
    )
    keys.add_argument("--force", action="store_true", help="replace keys that are already there")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        stems = [key_name(spec) for spec in args.name]
    except ValueError as exc:
        parser.error(str(exc))
    try:
        paths = create_keys(out, args.force, stems)
    except FileExistsError as exc:
        print(f"dynabatch keys: {exc}", file=sys.stderr)
        return 2
    print("wrote " + " ".join(str(p) for p in paths))
    print(f"""
Every process reads the folder given by --curve-dir (or DYNABATCH_CURVE_DIR):
  on one machine:  dynabatch run --curve-dir {out}
  across machines: the scheduler needs server.key_secret, shard.key, worker.key
                   and evaluator.key; a shard server.key_secret, worker.key,
                   evaluator.key and shard.key_secret; a worker server.key and
                   worker.key_secret; an evaluator server.key and evaluator.key_secret
                   (a machine with a key of its own gets ROLE-NAME.key_secret as
                   ROLE.key_secret; the servers admit ROLE-NAME.key beside theirs)
  on Kubernetes:   kubectl -n dynabatch create secret generic dynabatch-curve --from-file={out}
                   (the manifests mount each pod only the files its role reads)
Keep the *_secret files secret: whoever has ROLE.key_secret can join the job as ROLE.""")
    return 0
