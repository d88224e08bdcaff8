"""The protocol table: every spec names a shard rule and a worker loop that exist, and no role
compares a protocol's name (the spec is the one place a protocol is described)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dynabatch.common.config import ConfigError, JobConfig
from dynabatch.common.protocols import GRADIENT, DELTA, PROTOCOLS, SPECS, protocol_spec
from dynabatch.ps.protocol_rules import RULES
from dynabatch.worker.loops import LOOPS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", PROTOCOLS)
def test_every_spec_names_a_shard_rule_and_a_worker_loop_that_exist(name):
    spec = protocol_spec(name)
    assert spec.shard_rule in RULES and spec.worker_loop in LOOPS
    assert spec.push_kind in (GRADIENT, DELTA)
    assert spec.local_steps == (spec.push_kind == DELTA), "local steps are what make a delta"
    JobConfig(protocol=name).validate()


def test_every_rule_and_loop_serves_some_protocol():
    assert {s.shard_rule for s in SPECS.values()} == set(RULES)
    assert {s.worker_loop for s in SPECS.values()} == set(LOOPS)


def test_an_unknown_protocol_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown protocol 'bsp'.*asgd"):
        protocol_spec("bsp")
    with pytest.raises(ConfigError, match="--protocol"):
        JobConfig(protocol="bsp").validate()


def test_no_role_compares_a_protocols_name():
    """`protocol ==`, `protocol in (...)` or a protocol's name as a string literal outside the table
    (a rule's or loop's `NAME`, which the table refers to, and the flag's default excepted)."""
    names = "|".join(PROTOCOLS)
    compared = re.compile(rf"protocol\s*(==|!=|\bin\b|\bnot in\b)|[\"']({names})[\"']")
    offenders = []
    for folder in ("common", "ps", "worker", "scheduler", "cluster", "cli"):
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name == "protocols.py":
                continue
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if compared.search(code) and not code.strip().startswith("NAME = ") and "opt(" not in code:
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("name", PROTOCOLS)
def test_prefetch_pull_is_taken_only_where_the_spec_allows_it(name):
    """A pull before the worker's own push adds staleness: only protocols that take it may be asked for it."""
    job = JobConfig(protocol=name, prefetch_pull=True)
    if SPECS[name].may_prefetch_pull:
        job.validate()
        with pytest.raises(ConfigError, match="choose one"):
            JobConfig(protocol=name, prefetch_pull=True, pipeline="on").validate()
    else:
        with pytest.raises(ConfigError, match=f"--prefetch-pull: protocol {name} "):
            job.validate()


def test_push_behind_needs_prefetch_pull():
    with pytest.raises(ConfigError, match="--push-behind needs --prefetch-pull"):
        JobConfig(protocol="asgd", push_behind=True).validate()
    JobConfig(protocol="asgd", push_behind=True, prefetch_pull=True).validate()
