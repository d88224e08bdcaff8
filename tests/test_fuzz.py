"""The fuzz suite at CI size: a live job takes every attack issue 11 reported, then thousands of malformed and lying
messages, Byzantine gradients and replayed pushes from a worker of the fuzzer's own among them, and trains as if it
had none.

`PYTHONPATH=tests python -m fuzz --messages 100000` runs the same at full size.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fuzz.attacks import ATTACKS
from fuzz.byzantine import GRADIENTS, REPLAYS
from fuzz.messages import CATEGORIES, LIES
from fuzz.run import ACCURACY_POINTS, FuzzSettings, fuzz

pytestmark = pytest.mark.slow

# The worker's gradients cost more to build, send and check than the other kinds (at full size the fuzz sent 324 to 791
# a second with them, 1,178 without): 1,500 instead of 2,000 keep the fuzz's own seconds about as they were; the
# worker's enlistment adds about 3.5 s.
MESSAGES = 1500
# The fuzzer's worker enlists before the attacks, and from then on every round waits for it: the job cannot end
# under the fuzz, however long the attacks take beside a second copy of the suite (under two suites the
# 65,536-entry push once took 65 to 76 s, and another time 8.9 s while a job that raced the attacks ended first).
# It must only outlive the fuzzer's learning and enlisting, which wait on the job's own progress (its workers'
# steps, the model's versions), not on the clock: the fuzz ended at epoch 0.71 to 0.90 (eight runs alone,
# 2026-11-27). The length is for the accuracy comparison: at 5 epochs six runs ended 0.1 to 0.3 points from the
# clean twin, and the seventh 1.0 point below it (91.7% against 92.7%), at the bound; at 3 up to 0.9 apart. Its
# workers idle three times their compute (--slowdown 4): the job lasts longer for the same CPU.
EPOCHS = 10
SLOWDOWN = 4.0


def test_a_live_job_refuses_every_fuzzed_message_and_trains_as_a_clean_one(tmp_path: Path) -> None:
    seed = random.randrange(1 << 16)
    print(
        f"fuzz seed {seed}: `PYTHONPATH=tests python -m fuzz --messages {MESSAGES} --epochs {EPOCHS} "
        f"--slowdown {SLOWDOWN:g} --seed {seed}` replays it"
    )
    report = fuzz(FuzzSettings(messages=MESSAGES, epochs=EPOCHS, seed=seed, slowdown=SLOWDOWN), tmp_path, print)
    assert report.live_throughout, (
        f"the job ended before the fuzz did (at epoch {report.epoch_at_end} of "
        f"{EPOCHS}): the messages did not meet a live job"
    )
    assert report.messages == MESSAGES and set(report.sent) == set(CATEGORIES)
    assert sum(report.sent[c] for c in LIES) >= 0.4 * MESSAGES, "about half of them are well-formed lies"
    assert not report.exited, f"processes exited: {report.exited}"
    assert [a.name for a in report.attacks] == [a.name for a in ATTACKS]
    for attack in report.attacks:
        assert attack.ok, attack
        assert attack.sent and (
            sum(attack.refused.values()) + len(attack.admitted) == attack.sent or attack.bound_bytes
        ), attack
    assert not report.accepted, f"accepted: {report.accepted}"
    assert not report.unanswered_kinds, f"lies that got no refusal: {report.unanswered_kinds}"
    assert not report.non_finite, report.non_finite
    assert set(report.byzantine) == {*GRADIENTS, *REPLAYS}, f"the worker's kinds answered: {report.byzantine}"
    assert not report.byzantine_wrong, (report.byzantine_wrong, report.byzantine)
    assert not report.honest_failed, f"steps of the job's own workers failed: {report.honest_failed}"
    assert report.member_counted["pushes"] > 0, "every round waited for the fuzzer's worker: some of its pushes count"
    taken = sum(got.get("taken", 0) for got in report.byzantine.values())  # bounded, not refused
    assert sum(report.refused.values()) + taken >= 0.95 * MESSAGES, report.refused
    for code, n in report.refused.items():
        assert report.counted.get(code, 0) >= n, f"{code}: {n} refused but {report.counted.get(code, 0)} counted"
    assert report.fuzzed_acc is not None and report.clean_acc is not None
    assert abs(report.fuzzed_acc - report.clean_acc) * 100 <= ACCURACY_POINTS, (report.fuzzed_acc, report.clean_acc)
