"""The replicas' metrics as one Prometheus page (`/metrics` of `kvrag serve --ray-serve`).

Each replica posts its own page (server/metrics.py) and the chunks it holds to a board, a small Ray actor, when Serve
asks it for its routing stats; the front reads the board and serves every replica's samples with a `replica` label
(sum or average them in PromQL), plus how many replicas report and what each holds. A replica that stopped
reporting for STALE_S is left out.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

STALE_S = 30.0


class MetricsBoard:
    """A Ray actor: replica -> (when it reported, its metrics page, how many chunks it holds)."""

    def __init__(self):
        self.reports: dict[str, tuple[float, str, int]] = {}

    def put(self, replica: str, page: str, held: int) -> None:
        self.reports[replica] = (time.time(), page, held)

    def fresh(self) -> dict[str, tuple[float, str, int]]:
        now = time.time()
        return {r: report for r, report in self.reports.items() if now - report[0] < STALE_S}


def federated_page(reports: dict[str, tuple[float, str, int]]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Federated(reports))
    return generate_latest(registry)


class _Federated:
    def __init__(self, reports: dict[str, tuple[float, str, int]]):
        self.reports = reports

    def collect(self):
        yield GaugeMetricFamily("kvrag_cluster_replicas", "Engine replicas reporting", value=len(self.reports))
        held = GaugeMetricFamily("kvrag_replica_held_chunks", "Chunks a replica's memory tiers hold, as it last "
                                 "reported them to the router (bounded)", labels=["replica"])
        for replica, (_, _, n) in sorted(self.reports.items()):
            held.add_metric([replica], n)
        yield held
        merged: dict[str, Metric] = {}
        for replica, (_, page, _) in sorted(self.reports.items()):
            for family in text_string_to_metric_families(page):
                out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp)
        yield from merged.values()
