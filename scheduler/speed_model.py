"""Per-worker step-time model used by the scheduler to size batches.

A worker's step is modelled as ``t(b) = a + c*b``: ``a`` is the part of a step
that does not grow with the batch (pulling and pushing parameters, kernel
launches, Python overhead) and ``c`` the cost of one sample. A single throughput
number is not enough: when fixed costs differ, batches proportional to measured
throughput do not give equal step times, and a throughput measured at one batch
size does not predict the step time at another.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass

import numpy as np

from dynabatch.common.probe import MAX_FIXED_FRACTION, fixed_through

MIN_RELATIVE_SPREAD = 0.05
"""Weighted std/mean of the batch sizes below which the intercept is not fitted.

With (nearly) one batch size in the window, the intercept is an extrapolation
from a single point and the step-time noise alone decides its value."""

MIN_OBSERVATIONS_FOR_INTERCEPT = 3
"""Two points always fit a line exactly; a third is the first that can disagree."""

MAX_INTERCEPT_STDERR = 0.1
"""Largest estimated standard error of the fitted ``a``, as a fraction of the weighted
mean step time, for the fit to count as identifying ``a``.

Spread in the batch sizes is necessary but not sufficient. When the node's speed
changes while old observations at other batch sizes are still in the window, the
slope still comes from the old points and the whole slowdown lands in the
intercept: a worker that got slower per sample would look like one with a large
fixed cost, and its step time at any other batch size would be mispredicted
(and that ``a`` remembered). Such a window fits badly, its residuals are large,
and this test rejects it."""


def _positive_seconds(name: str, value: float) -> float:
    """``value`` as a float; ValueError unless it is finite and > 0."""
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return seconds


@dataclass(frozen=True)
class StepModel:
    """Fitted affine step time ``fixed_s + per_sample_s * batch``."""

    fixed_s: float
    per_sample_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fixed_s) and self.fixed_s >= 0):
            raise ValueError(f"fixed_s must be finite and >= 0, got {self.fixed_s!r}")
        if not (math.isfinite(self.per_sample_s) and self.per_sample_s > 0):
            raise ValueError(f"per_sample_s must be finite and > 0, got {self.per_sample_s!r}")

    def step_seconds(self, batch: int) -> float:
        """Predicted seconds for one step with ``batch`` samples."""
        return self.fixed_s + self.per_sample_s * batch

    def samples_per_s(self, batch: int) -> float:
        """Predicted throughput at ``batch``; it rises with the batch while ``fixed_s > 0``.

        Raises ValueError for ``batch < 1``, where throughput is meaningless.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch!r}")
        return batch / self.step_seconds(batch)


class SpeedModel:
    """Sliding-window, exponentially forgetting fit of one worker's ``StepModel``.

    Observation ``k`` steps old has weight ``forgetting**k``. The window bounds
    memory and cost; the forgetting is what makes the model follow a node whose
    speed changes (another job lands on it): with the default 0.7, the five
    newest steps carry 83% of the weight, so a slowdown shows within about five
    steps, at the price of a noisier estimate than an unweighted window would give.

    The intercept ``a`` is only identifiable when the batch size varies within
    the window and the points there lie close to one line. The scheduler changes
    batch sizes rarely (hysteresis), so most of the time the window holds a single
    batch size. Then the last identified ``a`` is kept and only ``c`` is refitted,
    through the weighted mean point: the prediction at the current batch stays
    exact, and the knowledge of the fixed cost, learnt when the batch last moved,
    is not lost. Before any ``a`` has been identified, ``a = 0`` (a proportional
    model).

    The compute time a worker reports beside each step (``observe``'s ``compute_s``)
    gives the per-sample compute cost directly (``compute_fit``), with no fit: a
    worker whose step is mostly transfers has its compute cost known from its first
    step, where ``c`` above includes the transfers until the batch has moved enough
    for the fit to identify ``a``.
    """

    def __init__(
        self,
        window: int = 16,
        forgetting: float = 0.7,
        prior_samples_per_s: float | None = None,
        prior_fixed_s: float = 0.0,
        probe_batch: int = 0,
    ) -> None:
        """``prior_samples_per_s`` is the standalone speed a worker measures before
        joining; it gives the worker a sensible first batch before any step is seen.
        ``prior_fixed_s`` is the fixed cost its probe of two batch sizes found (0: none): the intercept ``a``
        until the window identifies one, so that a fixed split, whose batch never varies, still sees it.
        ``probe_batch`` is the probe's (larger) batch, at which it measured ``prior_samples_per_s`` (0: not
        known): with it ``compute_curve`` takes from the probe the fraction of its step that is fixed, not the
        seconds (see there).
        """
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        if prior_samples_per_s is not None and not (math.isfinite(prior_samples_per_s) and prior_samples_per_s > 0):
            raise ValueError(f"prior_samples_per_s must be finite and > 0, got {prior_samples_per_s!r}")
        self._window: deque[tuple[int, float]] = deque(maxlen=window)
        self._compute: deque[tuple[int, float]] = deque(maxlen=window)  # (batch, compute seconds) where reported
        self._overhead: deque[float] = deque(maxlen=window)  # seconds of each such step spent not computing
        self._forgetting = forgetting
        self._prior = prior_samples_per_s
        if not (math.isfinite(prior_fixed_s) and prior_fixed_s >= 0):
            raise ValueError(f"prior_fixed_s must be finite and >= 0, got {prior_fixed_s!r}")
        self._fixed_s: float | None = prior_fixed_s or None
        self._probe_fixed_s = prior_fixed_s
        self._probe_batch = probe_batch
        self._model: StepModel | None = None
        self._prior_model: StepModel | None = None  # the model `restart` predicts until new steps are seen

    @property
    def observations(self) -> int:
        """Number of observations currently in the window."""
        return len(self._window)

    def window(self) -> list[tuple[int, float]]:
        """The (batch, seconds) steps in the window, oldest first: observing them again rebuilds this model."""
        return list(self._window)

    def observe(self, batch: int, seconds: float, compute_s: float | None = None) -> None:
        """Record one step of ``batch`` samples that took ``seconds``, ``compute_s`` of them computing
        (None: the worker did not say).

        Raises ValueError for a batch that is not a positive integer or a time that
        is not finite and positive, rather than skipping it silently: the caller
        validates heartbeats and should count and report a bad one, and a model
        that quietly ignored input would hide that bug.
        """
        try:
            b = operator.index(batch)
        except TypeError:
            raise ValueError(f"batch must be an integer, got {batch!r}") from None
        if b < 1:
            raise ValueError(f"batch must be >= 1, got {b}")
        t = _positive_seconds("seconds", seconds)
        compute = None if compute_s is None else _positive_seconds("compute_s", compute_s)
        self._window.append((b, t))
        if compute is not None:
            self._compute.append((b, compute))
            self._overhead.append(max(0.0, t - compute))
        self._model = self._refit()

    def fit(self) -> StepModel | None:
        """Current model: fitted from the window, else from the prior, else None."""
        if self._model is not None:
            return self._model
        if self._prior_model is not None:
            return self._prior_model
        if self._prior is not None:
            return StepModel(0.0, 1.0 / self._prior)
        return None

    def compute_fit(self) -> StepModel | None:
        """The compute-only model ``StepModel(0, c)``: ``c`` is the window's reported compute seconds per sample,
        weighted as the step fit weighs its steps (the newest most), else ``fit()``'s ``c``; None without ``fit()``.

        A ratio of sums, not a fit: it needs no spread of batch sizes, so it holds from the first step reported.
        A fixed part of the compute itself (kernel launches) stays in ``c``, which makes ``1/c`` the worker's
        compute throughput at the batches it ran. The step fit's ``c`` is the fallback for a worker that reports
        no compute time (an older one), and for the steps restored from a saved job, which kept none.
        """
        step = self.fit()
        if not self._compute:
            return None if step is None else StepModel(0.0, step.per_sample_s)
        data = np.asarray(self._compute, dtype=float)
        w = self._recency_weights(len(data))
        return StepModel(0.0, float(w @ data[:, 1]) / float(w @ data[:, 0]))

    def overhead_fit(self) -> StepModel | None:
        """A step model whose fixed part is known from the first step: ``a`` the steps' weighted mean time spent
        not computing (pulls, pushes, what the worker reports besides compute) plus the compute's own fixed part
        from the start-up probe, ``c`` the rest of the compute per sample (both as ``compute_curve``); ``fit()``
        itself where no compute time was reported.

        Both pass through the window's steps, so they predict the current batch's step alike; they differ in how
        much of it they call fixed. ``fit()``'s intercept is not used here even once the batch has varied: on a
        loaded machine it is identified only now and then, and noisily, and a fixed part that jumps between it and
        this one moves the efficient policy's knee (a constant times ``a/c``) and the batch with it, which varies
        the batch again: a control loop on noise. The probe's two sizes, measured once, keep ``a`` steady.
        """
        step, curve, overhead = self.fit(), self.compute_curve(), self.overhead_s()
        if overhead is None or step is None or curve is None:
            return step
        return StepModel(overhead + curve.fixed_s, curve.per_sample_s)

    def overhead_s(self) -> float | None:
        """The seconds of a step spent not computing (pulls, pushes), weighted as the step fit weighs its steps;
        None where the worker reported no compute time."""
        if not self._overhead:
            return None
        w = self._recency_weights(len(self._overhead))
        return float(w @ np.asarray(self._overhead, dtype=float)) / float(w.sum())

    def compute_curve(self) -> StepModel | None:
        """The worker's compute alone as a curve: the fixed part its start-up probe found (``probe_fixed_s``,
        capped at MAX_FIXED_FRACTION of the compute at the batches it ran), the rest of its reported compute per
        sample; None where it reported no compute time. What `--protocol auto` predicts each protocol with, the
        transfers apart (scheduler/measured_cluster.py)."""
        if not self._compute:
            return None
        data = np.asarray(self._compute, dtype=float)
        w = self._recency_weights(len(data))
        batch, seconds = float(w @ data[:, 0]) / float(w.sum()), float(w @ data[:, 1]) / float(w.sum())
        return self._curve_through(batch, seconds)

    def probe_curve(self) -> StepModel | None:
        """The compute curve the start-up probe alone gives: ``compute_curve``'s through the probe's own step (its
        fixed seconds, capped, the rest per sample); None without a probe of a known batch. What auto chooses on
        before a worker's first step: the probe ran under the start-up of the job's other processes, so it is a
        floor on the worker's speed."""
        if not (self._probe_batch and self._prior):
            return None
        return self._curve_through(self._probe_batch, self._probe_batch / self._prior)

    def _curve_through(self, batch: float, seconds: float) -> StepModel:
        """The compute curve through a step of ``batch`` samples that computed for ``seconds``: the probe's fixed
        part (``probe_fixed_s``) capped at MAX_FIXED_FRACTION of it, the rest per sample."""
        fixed = min(self.probe_fixed_s(batch, seconds), MAX_FIXED_FRACTION * seconds)
        return StepModel(fixed, (seconds - fixed) / batch)

    def restart(self, transfers_ratio: float) -> None:
        """Measure anew under another protocol, whose reported step holds `transfers_ratio` times the transfers of
        the running one's (a gradient step's pull and push against local SGD's one round over its H steps: 1/H).

        The steps in the window were taken under the old protocol, and their time not computing (transfers, which
        every asgd step holds and local SGD pays once a round) is no measure of the new one's: fitted on them, the
        new protocol's split gives a worker whose transfers dominate (a fast GPU) too small a share. So the step
        and overhead windows start empty, and until the new protocol's steps fill them the model is the worker's
        compute curve with the old steps' time not computing scaled by `transfers_ratio` as its fixed cost. The
        compute window stays: a sample's compute does not depend on the protocol. A worker that reports no compute
        time cannot be split so and keeps its model."""
        compute, overhead = self.compute_curve(), self.overhead_s()
        if compute is None or overhead is None:
            return
        fixed = compute.fixed_s + overhead * transfers_ratio
        self._window.clear()
        self._overhead.clear()
        self._fixed_s = fixed or None
        self._model = None
        self._prior_model = StepModel(fixed, compute.per_sample_s)

    def probe_fixed_s(self, batch: float, seconds: float) -> float:
        """The compute's fixed seconds a step of ``batch`` samples that computed for ``seconds`` has, by the probe
        (common/probe.py `fixed_through`, which says why its fraction and not its seconds); the probe's fixed
        seconds as they are where its batch is not known. It also keeps ``a/c`` (the efficient policy's knee,
        scheduler/efficient_batches.py) where the probe put it whatever the steps' noise does."""
        if not (self._probe_batch and self._prior):
            return self._probe_fixed_s
        return fixed_through(batch, seconds, self._probe_batch, self._prior, self._probe_fixed_s)

    def _recency_weights(self, n: int) -> np.ndarray:
        """The weights of a window's ``n`` entries, oldest first: the newest weighs 1, each older one ``forgetting``
        times the next, so every fit and mean of this model forgets alike."""
        return self._forgetting ** np.arange(n - 1, -1, -1, dtype=float)

    def _refit(self) -> StepModel:
        """Refit after each observation, so that an intercept identified while
        batches varied is remembered even if nobody called ``fit`` at that time."""
        data = np.asarray(self._window, dtype=float)
        b, t = data[:, 0], data[:, 1]
        w = self._recency_weights(len(b))
        w /= w.sum()
        mean_b = float(w @ b)
        mean_t = float(w @ t)
        a_max = MAX_FIXED_FRACTION * mean_t

        intercept = self._wls_intercept(b, t, w, mean_b, mean_t)
        if intercept is not None:
            self._fixed_s = min(max(intercept, 0.0), a_max)
            a = self._fixed_s
        else:
            a = min(self._fixed_s or 0.0, a_max)
        return StepModel(a, (mean_t - a) / mean_b)

    @staticmethod
    def _wls_intercept(b: np.ndarray, t: np.ndarray, w: np.ndarray, mean_b: float, mean_t: float) -> float | None:
        """Weighted least-squares intercept, or None when the window does not identify it:
        too few points, batches too alike, a non-positive or non-finite slope, or an
        intercept too uncertain (see ``MAX_INTERCEPT_STDERR``)."""
        if len(b) < MIN_OBSERVATIONS_FOR_INTERCEPT:
            return None
        db = b - mean_b
        var_b = float(w @ (db * db))
        if math.sqrt(var_b) < MIN_RELATIVE_SPREAD * mean_b:
            return None
        slope = float(w @ (db * (t - mean_t))) / var_b
        if not (math.isfinite(slope) and slope > 0):
            return None
        intercept = mean_t - slope * mean_b
        n_eff = 1.0 / float(w @ w)
        if n_eff <= 2:
            return None
        resid = t - intercept - slope * b
        noise_var = float(w @ (resid * resid)) * n_eff / (n_eff - 2)
        intercept_coef = w * (1.0 - mean_b * db / var_b)
        stderr = math.sqrt(noise_var * float(intercept_coef @ intercept_coef))
        if stderr > MAX_INTERCEPT_STDERR * mean_t:
            return None
        return intercept
