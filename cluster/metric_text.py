"""A process's /metrics page (Prometheus text format) read as numbers: what the tests and the fuzz ask of it."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` (a counter's with its `_total`) whose labels include `labels`;
    0 if there are none."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def metric_by_label(text: str, name: str, label: str) -> Counter[str]:
    """The samples of counter `name`, summed by the value of their `label`."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] += int(s.value)  # a counter's samples are whole numbers
    return out
