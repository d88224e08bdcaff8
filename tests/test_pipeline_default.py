"""`--pipeline auto` (the default): which workers pipeline their gradient steps, and what the config refuses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dynabatch.common.config import JobConfig, job_from_dict, to_dict
from dynabatch.common.flags import ConfigError


def test_auto_pipelines_a_model_of_several_chunks_only() -> None:
    job = JobConfig()
    assert job.pipeline == "auto"
    assert job.pipelines(chunks=2)
    assert not job.pipelines(chunks=1), "one chunk has nothing to overlap"


@pytest.mark.parametrize("why", ["prefetch", "micro_batch", "clips"])
def test_auto_leaves_the_pipeline_off_where_the_whole_gradient_is_needed_first(why: str) -> None:
    job = JobConfig(prefetch_pull=why == "prefetch")
    job.validate()
    assert not job.pipelines(chunks=8, micro_batch=16 if why == "micro_batch" else 0, clips=why == "clips")


def test_on_and_off_are_obeyed_whatever_the_model() -> None:
    assert JobConfig(pipeline="on").pipelines(chunks=1)
    assert not JobConfig(pipeline="off").pipelines(chunks=8)


def test_the_mode_travels_in_welcome_and_a_bad_one_is_refused() -> None:
    sent = JobConfig(protocol="asgd")  # WELCOME names the protocol in force, never auto
    assert job_from_dict(to_dict(replace(sent, pipeline="off"))).pipeline == "off"
    with pytest.raises(ConfigError, match="pipeline"):
        job_from_dict({**to_dict(sent), "pipeline": "sometimes"})
    with pytest.raises(ConfigError, match="pipeline"):
        job_from_dict({**to_dict(sent), "pipeline": True})
