"""`make image-test`: the built image runs a job as separate containers, as a cluster would run it.

Scheduler, shard, two workers and the evaluator each in a container of their own from IMAGE
(read-only root, a tmpfs /tmp, no capabilities, no privilege escalation, uid 10001, each
mounting only its role's CURVE key files), on the host's network bound to 127.0.0.1. Checks,
in order, failing with the containers' logs:

1. the job trains: the scheduler counts samples and the evaluator reports an accuracy above chance;
2. a user's worker image, built FROM IMAGE with k8s/README.md's recipe (its Dockerfile block,
   verbatim), installs the user's library, runs as uid 10001 and joins the running job;
3. the scheduler's container, killed (SIGKILL) and started again on the same state volume,
   resumes the job (its log says so) at the count it had, less at most what the job trains
   between two of its saves (at the rate measured before the kill), and the samples go on from
   there; the job's accuracy (STATUS) is printed before the kill and at the first evaluation
   after the restart, which must be above chance too.

Before anything, the engine must start a container of IMAGE (scripts/container-engine.sh: a
missing step of docs/operators.md's "The image without a registry" is named in one line).
Every container and the user image are removed at the end, whatever happened.

    python scripts/image_test.py --image localhost/dynabatch:0.1.0 [--engine podman|docker]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.server
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dynabatch.cluster.launcher import keys_per_role
from dynabatch.cluster.metric_text import metric_sum
from dynabatch.common.net.curve import CurveKeys
from dynabatch.common.net.transport import Connection, RemoteError, open_context
from dynabatch.common.wire.messages import JobStatus, StatusReply, StatusRequest
from dynabatch.scheduler.server import SAVE_EVERY_S

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_IMAGE = "localhost/dynabatch:0.1.0"  # the Makefile's IMAGE, the manifests' and the recipe's FROM
RECIPE_SECTION = "## Your own model"
UID = 10001
JOB = ["--dataset", "fashion-mnist", "--model", "mlp", "--epochs", "1000", "--eval-interval-s", "2"]
CURVE_DIR = "/etc/dynabatch/curve"
WAIT_S = 240.0  # a container's start (torch import, data) on a loaded machine
USER_LIBRARY = "usertasklib"
USER_TASK = f'''"""A user's task: the job's own model, with a library that only the user's image has."""
import {USER_LIBRARY}
from dynabatch.common.tasks.builtin_tasks import builtin_task

assert {USER_LIBRARY}.MARK == "installed"
task = builtin_task("fashion-mnist", "mlp")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def recipe() -> str:
    """The Dockerfile block of k8s/README.md's "Your own model", verbatim."""
    text = (ROOT / "k8s" / "README.md").read_text()
    section = text[text.index(RECIPE_SECTION) :]
    block = re.search(r"```dockerfile\n(.*?)```", section, re.S)
    assert block is not None, f"k8s/README.md's {RECIPE_SECTION!r} has no dockerfile block"
    return block.group(1)


def library_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel of the user's library, so the recipe's `pip install` has something real to write."""
    name, version = USER_LIBRARY, "1.0"
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b'MARK = "installed"\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: image_test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = (
        "".join(
            f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}\n"
            for path, data in files.items()
        )
        + f"{dist}/RECORD,,\n"
    )
    wheel = folder / name / f"{name}-{version}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in {**files, f"{dist}/RECORD": record.encode()}.items():
            z.writestr(path, data)
    return wheel


class Check:
    """The engine, the containers this run started (all removed by `close`) and their logs for a failure."""

    def __init__(self, engine: str, image: str, work: Path) -> None:
        self.engine, self.image, self.work = engine, image, work
        self.prefix = f"dbit-{os.getpid()}-{secrets.token_hex(2)}"
        self.containers: list[str] = []
        self.images: list[str] = []

    def run(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([self.engine, *args], capture_output=True, text=True, timeout=900)
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{self.engine} {' '.join(args[:3])} ... exited {done.returncode}:\n"
                f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        return done.stdout

    def start(self, name: str, args: list[str], mounts: dict[str, str], image: str = "") -> str:
        """A detached container NAME of IMAGE running `dynabatch ARGS`, as the Kubernetes manifests run it."""
        container = f"{self.prefix}-{name}"
        volumes = [f"--volume={src}:{dst}" for src, dst in mounts.items()]
        self.run(
            "run",
            "--detach",
            "--name",
            container,
            "--network",
            "host",
            "--read-only",
            "--tmpfs",
            "/tmp:rw,size=512m",
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
            "--env",
            "HOME=/tmp",
            "--env",
            "MPLCONFIGDIR=/tmp/matplotlib",
            *volumes,
            image or self.image,
            *args,
        )
        self.containers.append(container)
        return container

    def logs(self, name: str) -> str:
        done = subprocess.run([self.engine, "logs", f"{self.prefix}-{name}"], capture_output=True, text=True)
        return done.stdout + done.stderr

    def kill(self, name: str) -> None:
        container = f"{self.prefix}-{name}"
        self.run("kill", container)
        self.run("rm", "--force", container)
        self.containers.remove(container)

    def report(self) -> str:
        return "".join(
            f"\n--- {c} ---\n" + "\n".join(self.logs(c.removeprefix(self.prefix + "-")).splitlines()[-20:])
            for c in self.containers
        )

    def wait(self, what: str, predicate: Callable[[], object], timeout_s: float = WAIT_S) -> object:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(1.0)
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}{self.report()}")

    def close(self) -> None:
        for container in self.containers:
            subprocess.run([self.engine, "rm", "--force", container], capture_output=True)
        for image in self.images:
            subprocess.run([self.engine, "rmi", "--force", image], capture_output=True)


def metric(port: int, name: str) -> float:
    """A series of the process serving /metrics on 127.0.0.1:PORT; 0 while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return metric_sum(r.read().decode(), name)
    except OSError:
        return 0.0


def job_status(conn: Connection) -> JobStatus | None:
    """The scheduler's STATUS, or None while it does not answer."""
    try:
        reply = conn.request(StatusRequest(), timeout_s=2.0)
    except (TimeoutError, RemoteError):
        return None
    return reply.body.state if isinstance(reply.body, StatusReply) else None


def accuracy(status: JobStatus) -> str:
    """`84.1% (model v812, epoch 3.20)`: the latest evaluation STATUS holds, with the job's epoch now."""
    acc = "no evaluation" if status.test_acc is None else f"{100 * status.test_acc:.1f}%"
    return f"{acc} (model v{status.eval_version}, epoch {status.epoch:.2f})"


def engine_ready(engine: str, image: str) -> str | None:
    """Why `engine` cannot run IMAGE's containers here (scripts/container-engine.sh's one line), or None."""
    done = subprocess.run(
        [
            "bash",
            "-c",
            'source "$0" && engine_ready image-test "$1" "$2"',
            str(ROOT / "scripts" / "container-engine.sh"),
            engine,
            image,
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode == 0:
        return None
    if done.returncode == 2:
        return f"image-test: {image} is not here: make image (or --image NAME)"
    return done.stderr.strip() or f"image-test: {engine} is not ready (exit {done.returncode})"


def writable_by_the_image_user(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    os.chown(folder, UID, UID)
    return str(folder)


def role_keys(work: Path) -> dict[str, str]:
    """`dynabatch keys`, then a folder per role holding only its files, readable by the image's user."""
    keys = work / "keys"
    subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", "keys", "--out", str(keys)], check=True, capture_output=True
    )
    folders = keys_per_role(str(keys), work)
    for folder in folders.values():
        for path in [Path(folder), *Path(folder).iterdir()]:
            os.chown(path, UID, UID)
    return folders


def build_user_image(check: Check, work: Path) -> str:
    """The user's worker image from k8s/README.md's recipe; its requirements come from a local index."""
    context = work / "user-image"
    index = work / "index"
    context.mkdir()
    wheel = library_wheel(index)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any) -> None:
            super().__init__(*a, directory=str(index))

        def log_message(self, *a: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (index / USER_LIBRARY / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
        (context / "my_task.py").write_text(USER_TASK)
        (context / "requirements.txt").write_text(
            f"--index-url http://127.0.0.1:{server.server_address[1]}/\n--trusted-host 127.0.0.1\n{USER_LIBRARY}==1.0\n"
        )
        dockerfile = recipe().replace(f"FROM {DEFAULT_IMAGE}", f"FROM {check.image}")
        (context / "Dockerfile").write_text(dockerfile)
        tag = f"localhost/{check.prefix}-user:test"
        extra = ["--pull=never"] if check.engine == "podman" else []
        check.run("build", "--network", "host", *extra, "-t", tag, str(context))
        check.images.append(tag)
    finally:
        server.shutdown()
    user = check.run("image", "inspect", "--format", "{{.Config.User}}", tag).strip()
    assert user == f"{UID}:{UID}", f"the user's image runs as {user!r}, not {UID}"
    return tag


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default=DEFAULT_IMAGE)
    p.add_argument(
        "--engine", default=os.environ.get("CONTAINER_ENGINE") or ("podman" if shutil.which("podman") else "docker")
    )
    args = p.parse_args(argv)
    if os.environ.get("CONTAINERS_CONF"):  # podman reads it from other directories too
        os.environ["CONTAINERS_CONF"] = str(Path(os.environ["CONTAINERS_CONF"]).resolve())
    problem = engine_ready(args.engine, args.image)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="image-test-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        check = Check(args.engine, args.image, work)
        ctx = None
        try:
            keys = role_keys(work)
            state = writable_by_the_image_user(work / "state")
            checkpoints = writable_by_the_image_user(work / "checkpoints")
            ctx = open_context(CurveKeys.load(str(work / "keys"), "run"))  # STATUS, as `dynabatch run` asks it
            control, data = free_port(), free_port()
            ports = {name: free_port() for name in ("scheduler", "ps", "worker-1", "worker-2", "evaluator", "user")}
            scheduler_endpoint = f"tcp://127.0.0.1:{control}"

            def flags(name: str) -> list[str]:
                return ["--curve-dir", CURVE_DIR, "--metrics-host", "127.0.0.1", "--metrics-port", str(ports[name])]

            def start_scheduler() -> None:
                check.start(
                    "scheduler",
                    [
                        "scheduler",
                        "--bind",
                        scheduler_endpoint,
                        "--state-dir",
                        "/var/lib/dynabatch/state",
                        *JOB,
                        *flags("scheduler"),
                    ],
                    {keys["scheduler"]: f"{CURVE_DIR}:ro", state: "/var/lib/dynabatch/state"},
                )

            start_scheduler()
            check.start(
                "ps",
                [
                    "ps",
                    "--scheduler",
                    scheduler_endpoint,
                    "--bind",
                    f"tcp://127.0.0.1:{data}",
                    "--checkpoint-dir",
                    "/var/lib/dynabatch/checkpoints",
                    *flags("ps"),
                ],
                {keys["ps"]: f"{CURVE_DIR}:ro", checkpoints: "/var/lib/dynabatch/checkpoints"},
            )
            for name in ("worker-1", "worker-2"):
                check.start(
                    name,
                    ["worker", "--scheduler", scheduler_endpoint, "--name", name, *flags(name)],
                    {keys["worker"]: f"{CURVE_DIR}:ro"},
                )
            check.start(
                "evaluator",
                ["worker", "--evaluator", "--scheduler", scheduler_endpoint, *flags("evaluator")],
                {keys["evaluator"]: f"{CURVE_DIR}:ro"},
            )

            # 1. The job trains.
            check.wait(
                "both workers to train",
                lambda: all(metric(ports[w], "dynabatch_worker_steps_total") > 0 for w in ("worker-1", "worker-2")),
            )
            check.wait(
                "an accuracy above chance", lambda: metric(ports["scheduler"], "dynabatch_job_test_accuracy") > 0.5
            )
            print(f"image-test: the job trains ({time.monotonic() - started:.0f}s)", flush=True)

            # 2. A user's worker image, built with the documented recipe, joins the running job.
            user_image = build_user_image(check, work)
            check.start(
                "user",
                ["worker", "--scheduler", scheduler_endpoint, "--name", "user", *flags("user")],
                {keys["worker"]: f"{CURVE_DIR}:ro"},
                image=user_image,
            )
            check.wait("the user's worker to train", lambda: metric(ports["user"], "dynabatch_worker_steps_total") > 0)
            check.wait(
                "three live workers", lambda: metric(ports["scheduler"], "dynabatch_scheduler_live_workers") == 3
            )
            print(f"image-test: the user's image joins ({time.monotonic() - started:.0f}s)", flush=True)

            # 3. The scheduler's container, killed and started again on its state volume, resumes the job.
            status = Connection(ctx, scheduler_endpoint, "dynabatch", "image-test")
            first = check.wait("STATUS", lambda: job_status(status))
            assert isinstance(first, JobStatus)
            before = check.wait(
                "two save intervals of training",
                lambda: (s := job_status(status)) and s.t - first.t >= 2 * SAVE_EVERY_S and s,
            )
            assert isinstance(before, JobStatus)
            rate = (before.samples - first.samples) / max(1e-9, before.t - first.t)
            check.kill("scheduler")
            print(
                f"image-test: scheduler killed at {before.samples} samples ({rate:.0f}/s); job accuracy "
                f"{accuracy(before)}",
                flush=True,
            )
            start_scheduler()
            check.wait("the restarted scheduler to resume the job", lambda: "resumed job" in check.logs("scheduler"))
            resumed = check.wait("the resumed scheduler's STATUS", lambda: job_status(status))
            assert isinstance(resumed, JobStatus)
            # Its saved progress, not zero: at most the samples of one save interval (a save may run one
            # interval late on a loaded machine) are lost and trained again.
            lost_at_most = rate * 2 * SAVE_EVERY_S
            assert resumed.samples >= before.samples - lost_at_most, (
                f"resumed at {resumed.samples} samples, {before.samples} before the kill, "
                f"more than {lost_at_most:.0f} lost{check.report()}"
            )
            check.wait(
                "the job to go on past where it stood",
                lambda: metric(ports["scheduler"], "dynabatch_job_samples") > before.samples,
            )
            after = check.wait(
                "an evaluation after the restart",
                lambda: (s := job_status(status)) and (s.eval_version or 0) > (resumed.eval_version or 0) and s,
            )
            assert isinstance(after, JobStatus) and after.test_acc is not None and after.test_acc > 0.5, (
                f"after the restart: {accuracy(after) if isinstance(after, JobStatus) else after}{check.report()}"
            )
            print(
                f"image-test: the restarted scheduler resumes at {resumed.samples} of {before.samples} samples "
                f"(at most {lost_at_most:.0f} may be lost); job accuracy {accuracy(after)} "
                f"({time.monotonic() - started:.0f}s)",
                flush=True,
            )
        finally:
            check.close()
            if ctx is not None:
                ctx.destroy(linger=0)
    print(f"image-test: passed in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
