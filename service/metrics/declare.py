"""`Declare`: how every rlfeed metric family is made, on one private registry.

One place decides the shape every family has: at most one label, from a small fixed set
or `rank`, and each label value known up front made at once, so that dashboards and
alerts see zeros rather than missing series until something is counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_Family = TypeVar("_Family", Counter, Gauge)


class Declare:
    """Makes metric families on `registry`, in the order they are declared (the order
    /metrics lists them in)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def counter(
        self, name: str, doc: str, label: str | None = None, values: Iterable[str] = ()
    ) -> Counter:
        """A counter (prometheus_client appends `_total`), labelled by `label` if given, with
        a zero series for each of `values`."""
        return self._with_values(Counter(name, doc, _labels(label), registry=self.registry), values)

    def gauge(
        self, name: str, doc: str, label: str | None = None, values: Iterable[str] = ()
    ) -> Gauge:
        """A gauge, labelled by `label` if given, with a series for each of `values`."""
        return self._with_values(Gauge(name, doc, _labels(label), registry=self.registry), values)

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, buckets=buckets, registry=self.registry)

    @staticmethod
    def _with_values(family: _Family, values: Iterable[str]) -> _Family:
        for value in values:
            family.labels(value)
        return family


def _labels(label: str | None) -> tuple[str, ...]:
    return (label,) if label else ()
