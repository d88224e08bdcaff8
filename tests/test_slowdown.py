import pytest

from dynabatch.common.slowdown import Slowdown


def test_constant_factor() -> None:
    s = Slowdown.parse("4")
    assert s.factor(0) == 4.0 and s.factor(1e6) == 4.0
    assert Slowdown.parse("2.5x").factor(3) == 2.5


def test_schedule_switches_at_the_given_seconds() -> None:
    s = Slowdown.parse("1x,4x@60s,1x@120s")
    assert [s.factor(t) for t in (0, 59.9, 60, 119, 120, 500)] == [1, 1, 4, 4, 1, 1]


def test_schedule_starting_later_is_normal_speed_before() -> None:
    s = Slowdown.parse("3x@10s")
    assert s.factor(5) == 1.0 and s.factor(10) == 3.0


@pytest.mark.parametrize("bad", ["", "fast", "0.5", "2x,3x", "2x@10s,3x@5s", "2x@-1s", "1x,,2x@3s"])
def test_bad_schedules_are_refused_with_the_text(bad: str) -> None:
    with pytest.raises(ValueError, match="slowdown"):
        Slowdown.parse(bad)


@pytest.mark.parametrize(
    "text, label",
    [
        ("1", "1x"),
        ("2.5x", "2.5x"),
        ("1x,4x@60s,1x@120s", "1x,4x@60s,1x@120s"),
        ("3x@10s", "1x,3x@10s"),
        ("2:0.05", "2x:0.05s"),
    ],
)
def test_the_label_is_the_schedule_as_parse_reads_it(text: str, label: str) -> None:
    assert Slowdown.parse(text).label() == label
    assert Slowdown.parse(label) == Slowdown.parse(text)


def test_a_fixed_part_idles_its_seconds_after_every_step_beside_the_factor() -> None:
    s = Slowdown.parse("2:0.05,3x:0.1s@60s")
    assert s.factor(0) == 2.0 and s.fixed_s(0) == 0.05 and s.fixed_s(60) == 0.1
    assert s.idle_s(0, 0.2) == pytest.approx(0.2 + 0.05)  # (2-1) x 0.2 CPU seconds + 0.05
    assert s.idle_s(61, 0.2) == pytest.approx(0.4 + 0.1)
    assert Slowdown.parse("1:0.02").idle_s(5, 1.0) == pytest.approx(0.02)
    assert Slowdown.parse("4").idle_s(0, 0.1) == pytest.approx(0.3) and Slowdown.parse("4").fixed_s(0) == 0.0


@pytest.mark.parametrize("bad", ["2:", "2:-1", ":0.1", "2:0.1:0.2"])
def test_bad_fixed_parts_are_refused_with_the_text(bad: str) -> None:
    with pytest.raises(ValueError, match="slowdown"):
        Slowdown.parse(bad)
