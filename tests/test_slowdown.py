import pytest

from dynabatch.common.slowdown import Slowdown


def test_constant_factor():
    s = Slowdown.parse("4")
    assert s.factor(0) == 4.0 and s.factor(1e6) == 4.0
    assert Slowdown.parse("2.5x").factor(3) == 2.5


def test_schedule_switches_at_the_given_seconds():
    s = Slowdown.parse("1x,4x@60s,1x@120s")
    assert [s.factor(t) for t in (0, 59.9, 60, 119, 120, 500)] == [1, 1, 4, 4, 1, 1]


def test_schedule_starting_later_is_normal_speed_before():
    s = Slowdown.parse("3x@10s")
    assert s.factor(5) == 1.0 and s.factor(10) == 3.0


@pytest.mark.parametrize("bad", ["", "fast", "0.5", "2x,3x", "2x@10s,3x@5s", "2x@-1s", "1x,,2x@3s"])
def test_bad_schedules_are_refused_with_the_text(bad):
    with pytest.raises(ValueError, match="slowdown"):
        Slowdown.parse(bad)


@pytest.mark.parametrize("text, label", [("1", "1x"), ("2.5x", "2.5x"), ("1x,4x@60s,1x@120s", "1x,4x@60s,1x@120s"),
                                         ("3x@10s", "1x,3x@10s")])
def test_the_label_is_the_schedule_as_parse_reads_it(text, label):
    assert Slowdown.parse(text).label() == label
    assert Slowdown.parse(label) == Slowdown.parse(text)
