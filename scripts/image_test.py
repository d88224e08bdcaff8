"""`make image-test`: the built image runs a job as separate containers, as a cluster would run it.

Scheduler, shard, two workers and the evaluator each in a container of their own from IMAGE
(read-only root, a tmpfs /tmp, no capabilities, no privilege escalation, uid 10001, each
mounting only its role's CURVE key files), on the host's network bound to 127.0.0.1. Checks,
in order, failing with the containers' logs:

1. the job trains: the scheduler counts samples and the evaluator reports an accuracy above chance;
2. a user's worker image, built FROM IMAGE with k8s/README.md's recipe (its Dockerfile block,
   verbatim), installs the user's library, runs as uid 10001 and joins the running job;
3. the scheduler's container, killed (SIGKILL) and started again on the same state volume,
   resumes the job (its log says so) and the job's samples go on from where they were.

Every container and the user image are removed at the end, whatever happened.

    python scripts/image_test.py --image dynabatch:0.1.0 [--engine podman|docker]
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

ROOT = Path(__file__).resolve().parents[1]
RECIPE_SECTION = "## Your own model"
UID = 10001
JOB = ["--dataset", "fashion-mnist", "--model", "mlp", "--epochs", "1000", "--eval-interval-s", "2"]
CURVE_DIR = "/etc/dynabatch/curve"
WAIT_S = 240.0  # a container's start (torch import, data) on a loaded machine
USER_LIBRARY = "usertasklib"
USER_TASK = f'''"""A user's task: the job's own model, with a library that only the user's image has."""
import {USER_LIBRARY}
from dynabatch.common.builtin_tasks import builtin_task

assert {USER_LIBRARY}.MARK == "installed"
task = builtin_task("fashion-mnist", "mlp")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe() -> str:
    """The Dockerfile block of k8s/README.md's "Your own model", verbatim."""
    text = (ROOT / "k8s" / "README.md").read_text()
    section = text[text.index(RECIPE_SECTION):]
    block = re.search(r"```dockerfile\n(.*?)```", section, re.S)
    assert block is not None, f"k8s/README.md's {RECIPE_SECTION!r} has no dockerfile block"
    return block.group(1)


def library_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel of the user's library, so the recipe's `pip install` has something real to write."""
    name, version = USER_LIBRARY, "1.0"
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": b'MARK = "installed"\n',
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: image_test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{dist}/RECORD,,\n"
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
            raise RuntimeError(f"{self.engine} {' '.join(args[:3])} ... exited {done.returncode}:\n"
                               f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done.stdout

    def start(self, name: str, args: list[str], mounts: dict[str, str], image: str = "") -> str:
        """A detached container NAME of IMAGE running `dynabatch ARGS`, as the Kubernetes manifests run it."""
        container = f"{self.prefix}-{name}"
        volumes = [f"--volume={src}:{dst}" for src, dst in mounts.items()]
        self.run("run", "--detach", "--name", container, "--network", "host", "--read-only",
                 "--tmpfs", "/tmp:rw,size=512m", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                 "--env", "HOME=/tmp", "--env", "MPLCONFIGDIR=/tmp/matplotlib", *volumes, image or self.image, *args)
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
        return "".join(f"\n--- {c} ---\n" + "\n".join(self.logs(c.removeprefix(self.prefix + "-")).splitlines()[-20:])
                       for c in self.containers)

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


def writable_by_the_image_user(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    os.chown(folder, UID, UID)
    return str(folder)


def role_keys(work: Path) -> dict[str, str]:
    """`dynabatch keys`, then a folder per role holding only its files, readable by the image's user."""
    keys = work / "keys"
    subprocess.run([sys.executable, "-m", "dynabatch.cli.main", "keys", "--out", str(keys)], check=True,
                   capture_output=True)
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
            f"--index-url http://127.0.0.1:{server.server_address[1]}/\n--trusted-host 127.0.0.1\n"
            f"{USER_LIBRARY}==1.0\n")
        dockerfile = recipe().replace("FROM dynabatch:0.1.0", f"FROM {check.image}")
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
    p.add_argument("--image", default="dynabatch:0.1.0")
    p.add_argument("--engine", default=os.environ.get("CONTAINER_ENGINE") or
                   ("podman" if shutil.which("podman") else "docker"))
    args = p.parse_args(argv)
    if shutil.which(args.engine) is None:
        print(f"image-test: {args.engine} is not installed", file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="image-test-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        check = Check(args.engine, args.image, work)
        try:
            keys = role_keys(work)
            state = writable_by_the_image_user(work / "state")
            checkpoints = writable_by_the_image_user(work / "checkpoints")
            control, data = free_port(), free_port()
            ports = {name: free_port() for name in ("scheduler", "ps", "worker-1", "worker-2", "evaluator", "user")}
            scheduler_endpoint = f"tcp://127.0.0.1:{control}"

            def flags(name: str) -> list[str]:
                return ["--curve-dir", CURVE_DIR, "--metrics-host", "127.0.0.1", "--metrics-port", str(ports[name])]

            def start_scheduler() -> None:
                check.start("scheduler", ["scheduler", "--bind", scheduler_endpoint, "--state-dir",
                                          "/var/lib/dynabatch/state", *JOB, *flags("scheduler")],
                            {keys["scheduler"]: f"{CURVE_DIR}:ro", state: "/var/lib/dynabatch/state"})

            start_scheduler()
            check.start("ps", ["ps", "--scheduler", scheduler_endpoint, "--bind", f"tcp://127.0.0.1:{data}",
                               "--checkpoint-dir", "/var/lib/dynabatch/checkpoints", *flags("ps")],
                        {keys["ps"]: f"{CURVE_DIR}:ro", checkpoints: "/var/lib/dynabatch/checkpoints"})
            for name in ("worker-1", "worker-2"):
                check.start(name, ["worker", "--scheduler", scheduler_endpoint, "--name", name, *flags(name)],
                            {keys["worker"]: f"{CURVE_DIR}:ro"})
            check.start("evaluator", ["worker", "--evaluator", "--scheduler", scheduler_endpoint,
                                      *flags("evaluator")], {keys["evaluator"]: f"{CURVE_DIR}:ro"})

            # 1. The job trains.
            check.wait("both workers to train", lambda: all(metric(ports[w], "dynabatch_worker_steps_total") > 0
                                                             for w in ("worker-1", "worker-2")))
            check.wait("an accuracy above chance", lambda: metric(ports["scheduler"], "dynabatch_job_test_accuracy")
                       > 0.5)
            print(f"image-test: the job trains ({time.monotonic() - started:.0f}s)", flush=True)

            # 2. A user's worker image, built with the documented recipe, joins the running job.
            user_image = build_user_image(check, work)
            check.start("user", ["worker", "--scheduler", scheduler_endpoint, "--name", "user", *flags("user")],
                        {keys["worker"]: f"{CURVE_DIR}:ro"}, image=user_image)
            check.wait("the user's worker to train", lambda: metric(ports["user"], "dynabatch_worker_steps_total") > 0)
            check.wait("three live workers",
                       lambda: metric(ports["scheduler"], "dynabatch_scheduler_live_workers") == 3)
            print(f"image-test: the user's image joins ({time.monotonic() - started:.0f}s)", flush=True)

            # 3. The scheduler's container, killed and started again on its state volume, resumes the job.
            before = metric(ports["scheduler"], "dynabatch_job_samples")
            check.kill("scheduler")
            start_scheduler()
            check.wait("the restarted scheduler to resume the job", lambda: "resumed job" in check.logs("scheduler"))
            # Its saved progress (saved every second), not zero: the job did not start again.
            resumed = check.wait("the job's samples after the restart",
                                 lambda: metric(ports["scheduler"], "dynabatch_job_samples"))
            check.wait("the job to go on past where it stood",
                       lambda: metric(ports["scheduler"], "dynabatch_job_samples") > before)
            print(f"image-test: the restarted scheduler resumes at {resumed:.0f} of {before:.0f} samples "
                  f"({time.monotonic() - started:.0f}s)", flush=True)
        finally:
            check.close()
    print(f"image-test: passed in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
