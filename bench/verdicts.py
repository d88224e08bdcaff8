"""Our targets and the papers' claims, each decided from the measured figures by a rule fixed here.

Every rule is written down before the numbers come in (a tolerance of one
accuracy point, medians over seeds with a mark never reached counting as
never, "sooner" only by more than the evaluation interval), so a verdict cannot be
argued into agreement afterwards. A claim whose configurations were not run in this
mode says so instead of guessing.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

ACC_TOLERANCE = 0.01  # "accuracy kept": within one percentage point
SPEED_TOLERANCE = 0.95  # "speed-up kept": at least 95% of the other's samples/s
TARGET_FRACTION = 0.90
TARGET_DDP_RATIO = 0.80


@dataclass
class Verdict:
    """One line of the report: what is claimed, what we measured, and whether they agree."""

    claim: str
    measured: str
    holds: bool | None  # None: not measured in this mode

    @property
    def word(self) -> str:
        return {True: "yes", False: "no", None: "not measured"}[self.holds]


def _runs(runs: list[dict[str, Any]], protocol: str, policy: str) -> list[dict[str, Any]]:
    return [r for r in runs if r["protocol"] == protocol and r["policy"] == policy and r["final_test_acc"] is not None]


def median_time_to(runs: list[dict[str, Any]], mark: str) -> float:
    """Median over seeds of the time to `mark`; a seed that never reached it counts as infinitely late."""
    return statistics.median([r["time_to"].get(mark) or math.inf for r in runs])


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def _fmt_t(t: float) -> str:
    return "not reached" if math.isinf(t) else f"{t:.0f} s"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def loss_text(x: float, places: int = 4) -> str:
    """A training loss as a table shows it: a diverged run's (1e35, say) in powers of ten, not 36 digits."""
    return f"{x:.{places}f}" if abs(x) < 1e4 else f"{x:.2e}"


def versus(
    runs: list[dict[str, Any]], ours: tuple[str, str], theirs: tuple[str, str], name: str, other: str
) -> list[Verdict]:
    """Final loss, final accuracy and speed of `ours` against `theirs` (DBS-SGD's three claims)."""
    a, b = _runs(runs, *ours), _runs(runs, *theirs)
    if not a or not b:
        return [
            Verdict(f"{name} beats {other} on {what}", "configuration not run in this mode", None)
            for what in ("final training loss", "final test accuracy", "speed")
        ]
    loss_a, loss_b = _mean(a, "final_train_loss"), _mean(b, "final_train_loss")
    acc_a, acc_b = _mean(a, "final_test_acc"), _mean(b, "final_test_acc")
    sps_a, sps_b = _mean(a, "samples_per_s"), _mean(b, "samples_per_s")
    return [
        Verdict(
            f"{name} reaches a lower training loss than {other} at equal time",
            f"{loss_text(loss_a)} vs {loss_text(loss_b)}",
            loss_a < loss_b,
        ),
        Verdict(
            f"{name} reaches a higher test accuracy than {other} at equal time",
            f"{_pct(acc_a)} vs {_pct(acc_b)}",
            acc_a > acc_b,
        ),
        Verdict(
            f"{name} keeps {other}'s speed-up (samples/s at least {SPEED_TOLERANCE:.0%} of it)",
            f"{sps_a:.0f} vs {sps_b:.0f} samples/s ({sps_a / sps_b:.2f}x)",
            sps_a >= SPEED_TOLERANCE * sps_b,
        ),
    ]


def communication_claims(runs: list[dict[str, Any]], policy: str) -> list[Verdict]:
    """The multi-step delay method against SSGD and local SGD: fewer bytes, accuracy kept, no waiting."""
    msd, ssgd, local = _runs(runs, "msd", policy), _runs(runs, "ssgd", policy), _runs(runs, "local", policy)
    out = []
    if msd and ssgd:
        bps_m, bps_s = _mean(msd, "bytes_per_sample"), _mean(ssgd, "bytes_per_sample")
        acc_m, acc_s = _mean(msd, "final_test_acc"), _mean(ssgd, "final_test_acc")
        out += [
            Verdict(
                f"multi-step delay moves fewer bytes per sample than SSGD ({policy} batches)",
                f"{bps_m:,.0f} vs {bps_s:,.0f} bytes/sample ({bps_s / bps_m:.1f}x fewer)",
                bps_m < bps_s,
            ),
            Verdict(
                f"multi-step delay keeps SSGD's accuracy at equal time (within {ACC_TOLERANCE:.0%} points)",
                f"{_pct(acc_m)} vs {_pct(acc_s)}",
                acc_m >= acc_s - ACC_TOLERANCE,
            ),
        ]
    else:
        out.append(Verdict("multi-step delay against SSGD", "configuration not run in this mode", None))
    if msd and local:
        sps_m, sps_l = _mean(msd, "samples_per_s"), _mean(local, "samples_per_s")
        acc_m, acc_l = _mean(msd, "final_test_acc"), _mean(local, "final_test_acc")
        faster = f"multi-step delay trains faster than local SGD by not waiting for the average ({policy} batches)"
        as_good = f"multi-step delay keeps local SGD's accuracy at equal time (within {ACC_TOLERANCE:.0%} points)"
        out += [
            Verdict(faster, f"{sps_m:.0f} vs {sps_l:.0f} samples/s ({sps_m / sps_l:.2f}x)", sps_m > sps_l),
            Verdict(as_good, f"{_pct(acc_m)} vs {_pct(acc_l)}", acc_m >= acc_l - ACC_TOLERANCE),
        ]
    else:
        out.append(Verdict("multi-step delay against local SGD", "configuration not run in this mode", None))
    return out


def sooner(
    runs: list[dict[str, Any]],
    ours: tuple[str, str],
    theirs: tuple[str, str],
    name: str,
    other: str,
    mark: str,
    eval_interval_s: float,
) -> Verdict:
    """`ours` reaches `mark` sooner than `theirs`: medians over seeds, and a lead within one evaluation is a tie."""
    a, b = _runs(runs, *ours), _runs(runs, *theirs)
    claim = f"{name} reaches {float(mark):.0%} sooner than {other} (median over seeds)"
    if not a or not b:
        return Verdict(claim, "configuration not run in this mode", None)
    t_a, t_b = median_time_to(a, mark), median_time_to(b, mark)
    return Verdict(claim, f"{_fmt_t(t_a)} vs {_fmt_t(t_b)}", not math.isinf(t_a) and t_a + eval_interval_s < t_b)


def lb_bsp_claims(runs: list[dict[str, Any]], eval_interval_s: float, mark: str = "0.85") -> list[Verdict]:
    """LB-BSP: sizing batches to speed removes the straggler wait of synchronous SGD."""
    dyn, fixed = _runs(runs, "ssgd", "dynamic"), _runs(runs, "ssgd", "fixed")
    if not dyn or not fixed:
        return [Verdict("LB-BSP (ssgd+dynamic) is faster than ssgd+fixed", "configuration not run in this mode", None)]
    sps_d, sps_f = _mean(dyn, "samples_per_s"), _mean(fixed, "samples_per_s")
    return [
        Verdict(
            "LB-BSP (ssgd+dynamic) processes more samples/s than ssgd+fixed",
            f"{sps_d:.0f} vs {sps_f:.0f} ({sps_d / sps_f:.2f}x)",
            sps_d > sps_f,
        ),
        sooner(runs, ("ssgd", "dynamic"), ("ssgd", "fixed"), "LB-BSP", "ssgd+fixed", mark, eval_interval_s),
    ]


def paper_claims(runs: list[dict[str, Any]], eval_interval_s: float, mark: str = "0.85") -> list[Verdict]:
    """Every claim of the papers we implement, from the heterogeneous runs; time to target is judged at `mark`."""
    return (
        versus(runs, ("asgd", "dynamic"), ("asgd", "fixed"), "DBS-SGD", "ASGD")
        + versus(runs, ("asgd", "dynamic"), ("softsync", "fixed"), "DBS-SGD", "n-softsync")
        + versus(runs, ("asgd", "dynamic"), ("ssp", "fixed"), "DBS-SGD", "SSP")
        + lb_bsp_claims(runs, eval_interval_s, mark)
        + communication_claims(runs, "dynamic")
    )


def time_to_target_claims(runs: list[dict[str, Any]], eval_interval_s: float, mark: str) -> list[Verdict]:
    """The claims beyond LB-BSP's that are about time to accuracy, for studies long enough to reach `mark`."""
    dbs, msd = ("asgd", "dynamic"), ("msd", "dynamic")
    return [
        sooner(runs, dbs, ("asgd", "fixed"), "DBS-SGD", "ASGD", mark, eval_interval_s),
        sooner(runs, dbs, ("softsync", "fixed"), "DBS-SGD", "n-softsync", mark, eval_interval_s),
        sooner(runs, msd, ("ssgd", "dynamic"), "multi-step delay", "SSGD (dynamic batches)", mark, eval_interval_s),
        sooner(
            runs, msd, ("local", "dynamic"), "multi-step delay", "local SGD (dynamic batches)", mark, eval_interval_s
        ),
    ]


def targets(runs: list[dict[str, Any]], ddp: dict[str, Any] | None, eval_interval_s: float) -> list[Verdict]:
    """Our own targets, each with the measured figure and the margin it was met or missed by."""
    out = []
    dbs, ssgd = _runs(runs, "asgd", "dynamic"), _runs(runs, "ssgd", "fixed")
    if dbs:
        frac, probe = _mean(dbs, "fraction_of_compute"), _mean(dbs, "fraction_of_standalone")
        out.append(
            Verdict(
                f"DBS-SGD keeps at least {TARGET_FRACTION:.0%} of the workers' summed standalone speed",
                f"{frac:.0%} of the compute-only speed ({_margin(frac - TARGET_FRACTION)}); "
                f"{probe:.0%} of the start-up probes",
                frac >= TARGET_FRACTION,
            )
        )
    else:
        out.append(
            Verdict(
                f"DBS-SGD keeps at least {TARGET_FRACTION:.0%} of the workers' summed standalone speed",
                "not run in this mode",
                None,
            )
        )
    if ssgd:
        frac = _mean(ssgd, "fraction_of_compute")
        pace = statistics.fmean(len(r["slowdowns"]) * r["slowest_compute"] / r["sum_compute"] for r in ssgd)
        out.append(
            Verdict(
                "ssgd+fixed keeps only the slowest worker's pace (the baseline DBS-SGD must beat)",
                f"{frac:.0%} of the compute-only speed; the slowest worker's pace is {pace:.0%}",
                frac <= pace * 1.1,
            )
        )
    for other in (("asgd", "fixed"), ("ssgd", "fixed")):
        theirs = _runs(runs, *other)
        name = f"DBS-SGD reaches 88% sooner than {other[0]}+{other[1]} (median over seeds)"
        if not dbs or not theirs:
            out.append(Verdict(name, "not run in this mode", None))
            continue
        t_d, t_o = median_time_to(dbs, "0.88"), median_time_to(theirs, "0.88")
        # Accuracy is only known at evaluations, so a lead shorter than their interval is a tie.
        holds = not math.isinf(t_d) and t_d + eval_interval_s < t_o
        gap = ""
        if not (math.isinf(t_d) or math.isinf(t_o)):
            gap = f"; {t_o - t_d:+.1f} s" + (
                f", within the {eval_interval_s:g} s evaluation interval: a tie"
                if abs(t_o - t_d) <= eval_interval_s
                else ""
            )
        out.append(Verdict(name, f"{_fmt_t(t_d)} vs {_fmt_t(t_o)}{gap}", holds))
    ratio = ddp.get("speed_ratio") if ddp else None
    out.append(
        Verdict(
            f"synchronous steps at least {TARGET_DDP_RATIO:.1f}x the speed of DDP/gloo",
            "not measured" if ratio is None else f"{ratio:.2f}x ({_margin(ratio - TARGET_DDP_RATIO, '')})",
            None if ratio is None else ratio >= TARGET_DDP_RATIO,
        )
    )
    return out


def _margin(delta: float, unit: str = " points") -> str:
    if unit == " points":
        return f"met by {100 * delta:.0f} points" if delta >= 0 else f"missed by {-100 * delta:.0f} points"
    return f"met by {delta:.2f}" if delta >= 0 else f"missed by {-delta:.2f}"
