"""ZeroMQ CURVE keys: make them (`dynabatch keys`), load them, and guard server sockets.

A job has two keypairs, written by `zmq.auth.create_certificates` into one flat
folder (a Kubernetes Secret made with `--from-file=keys/` holds exactly that):

| file | holds | read by |
| --- | --- | --- |
| `server.key` | the servers' public key | workers, evaluators |
| `server.key_secret` | the servers' public and secret key | scheduler, shards |
| `client.key` | the clients' public key (the only key servers admit) | scheduler, shards |
| `client.key_secret` | the clients' public and secret key | shards, workers, evaluators |

`dynabatch run` reads all four, since it hands the folder to every process it
starts. Each process reads only its own files (KEYS_BY_ROLE), so a pod or machine
can be given just those: a worker node never holds the server secret and so cannot
pose as a server, and the scheduler, which connects nowhere, holds no client secret.

Every server (scheduler, shard) encrypts with the server secret and admits, through
a ZAP handler, only peers that prove they hold the client secret.

The ZAP handler admits exactly the key in `client.key`, not every `*.key` in the
folder (which `configure_curve(location=...)` would do, `server.key` included):
the allow list is then what the table says, whatever else lies in the folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from dynabatch.common.flags import ConfigError, opt

KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
KEYS_BY_ROLE: dict[str, tuple[str, ...]] = {
    "scheduler": ("server.key_secret", "client.key"),  # binds only
    "ps": ("server.key_secret", "client.key", "client.key_secret"),  # binds, and connects to the scheduler
    "worker": ("server.key", "client.key_secret"),  # connects only (evaluators too)
    "run": KEY_FILES,  # starts all of the above with the same folder
}
# Handshake failures a server counts as refused peers, by the reason label they get.
REFUSALS = {
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
        "", "folder with the ZeroMQ CURVE keys made by `dynabatch keys` (empty: no encryption, any peer admitted)"
    )


@dataclass(frozen=True)
class CurveKeys:
    """The job's keys as raw z85 bytes; each secret is loaded only where it is used."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes | None  # where a socket connects
    server_secret: bytes | None  # where a socket binds

    @classmethod
    def load(cls, folder: str, role: str) -> CurveKeys:
        """Read the files KEYS_BY_ROLE lists for `role`; CurveKeyError names a missing or bad one."""
        base = Path(folder)
        files = KEYS_BY_ROLE[role]
        server_file = "server.key_secret" if "server.key_secret" in files else "server.key"
        server_public, server_secret = _read(base / server_file, server_file.endswith("_secret"))
        client_public = client_secret = None
        if "client.key_secret" in files:
            client_public, client_secret = _read(base / "client.key_secret", True)
        if "client.key" in files:
            admitted, _ = _read(base / "client.key", False)
            if client_public is not None and admitted != client_public:
                raise CurveKeyError(f"{base / 'client.key'} and {base / 'client.key_secret'} are not one keypair")
            client_public = admitted
        return cls(server_public, client_public, client_secret, server_secret)


def _read(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveKeyError(f"{path} is missing (`dynabatch keys --out {path.parent}` makes a job's keys)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read {path}: {exc}") from None
    if secret and secret_key is None:
        raise CurveKeyError(f"{path} holds no secret key")
    return public, secret_key


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE client: it talks only to a server holding the server secret.

    Must run before the socket connects.
    """
    if keys.client_secret is None:
        raise CurveKeyError("this process connects a socket but loaded no client.key_secret")
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE server (before it binds); who may connect is the ZAP handler's call."""
    if keys.server_secret is None:
        raise CurveKeyError("this process binds a socket but loaded no server.key_secret")
    sock.curve_server = True
    sock.curve_publickey = keys.server_public
    sock.curve_secretkey = keys.server_secret


class AdmitClientKey:
    """ZAP credentials provider: admits the one client public key of the job."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """The context's ZAP handler (a daemon thread): every CURVE server socket of `ctx` asks it."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", AdmitClientKey(keys.client_public))
    return auth


def watch_refusals(sock: zmq.Socket, on_refused: Callable[[str], None]) -> threading.Thread:
    """Call `on_refused(reason)` for every peer whose handshake with `sock` fails.

    Counting happens on the socket's monitor events rather than in the ZAP handler:
    ZAP is consulted only after a client has proven it knows the server's public key,
    so a client without CURVE or with the wrong server key (the usual misconfigured
    or foreign peer) fails before ZAP and would never be counted there. The monitor
    sees every failed handshake, whichever stage refused it.
    """
    mask = 0
    for event in REFUSALS:
        mask |= event
    monitor = sock.get_monitor_socket(mask)

    def run() -> None:
        while True:
            try:
                event = recv_monitor_message(monitor)
            except zmq.ZMQError:  # context terminated: the process is ending
                return
            reason = REFUSALS.get(event["event"])
            if reason is not None:
                on_refused(reason)

    thread = threading.Thread(target=run, name="curve-monitor", daemon=True)
    thread.start()
    return thread


def create_keys(out: Path, force: bool) -> list[Path]:
    """Write a server and a client keypair into `out`; refuses to replace keys unless `force`."""
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = [out / name for name in KEY_FILES]
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(map(str, existing))} already exist (--force replaces them, "
                              "and every process must then get the new keys)")
    for name in ("server", "client"):
        for p in (out / f"{name}.key", out / f"{name}.key_secret"):
            p.unlink(missing_ok=True)
        zmq.auth.create_certificates(str(out), name)
    for p in paths:
        os.chmod(p, 0o600 if p.name.endswith("_secret") else 0o644)
    return paths


def main(argv: Sequence[str]) -> int:
    """`dynabatch keys --out DIR [--force]`."""
    parser = argparse.ArgumentParser(prog="dynabatch keys", description="Make a job's ZeroMQ CURVE keys.")
    parser.add_argument("--out", required=True, help="folder to write server.key[_secret] and client.key[_secret] into")
    parser.add_argument("--force", action="store_true", help="replace keys that are already there")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        paths = create_keys(out, args.force)
    except FileExistsError as exc:
        print(f"dynabatch keys: {exc}", file=sys.stderr)
        return 2
    print("wrote " + " ".join(str(p) for p in paths))
    print(f"""
Every process reads the folder given by --curve-dir (or DYNABATCH_CURVE_DIR):
  on one machine:  dynabatch run --curve-dir {out}
  across machines: a machine running only workers needs server.key and
                   client.key_secret; the scheduler server.key_secret and
                   client.key; a shard those two and client.key_secret
  on Kubernetes:   kubectl -n dynabatch create secret generic dynabatch-curve --from-file={out}
                   (the manifests mount each pod only the files its role reads)
Keep the *_secret files secret: whoever has client.key_secret can join the job.""")
    return 0

