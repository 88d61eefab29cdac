"""Prometheus metrics (``GET /metrics``): ``atoll_*`` families read from a node's ``PeerStatus``.

Each node has its own ``CollectorRegistry`` (several nodes may run in one process, in tests)
holding one custom collector: a scrape reads one ``PeerStatus`` snapshot (its ``Totals`` come
from the counters the node already keeps, see ``node.status.snapshot``) instead of the code
incrementing a second set. The text is rendered at most once per ``max_age_s``; a scrape in
between gets the same bytes.

Families (counters end in ``_total`` on the wire):
  atoll_bytes_sent, atoll_bytes_received          bytes over HTTP, both directions
  atoll_direct_bodies                             large bodies read straight off their socket
  atoll_inner_steps, atoll_tokens_trained         the island's work
  atoll_stalled_steps                             steps that waited on the network side
  atoll_learner_contributions{outcome}            this island's contributions: sent, accepted,
                                                  refused, undelivered
  atoll_contributions_accepted                    merged by this node's owners
  atoll_contributions_late                        ... of which came after their round closed
  atoll_contributions_refused{reason}             refused by this node's owners, by reason
  atoll_contributions_dropped                     dropped from a failed merge
  atoll_contributions_bounded{bound}              merged with a bound that bit
  atoll_versions_published                        global versions this node's owners published
  atoll_merge_seconds (summary: _count, _sum)     time from a round's close to its publication
  atoll_remote_errors{error}                      requests refused (a peer's bad bytes)
  atoll_version_jumps_refused                     versions refused as impossible
  atoll_loss (gauge)                              the island's training loss (EMA)
  atoll_goodput, atoll_members, atoll_suspected_members, atoll_fragments_owned,
  atoll_fragment_version{fragment}                gauges
  atoll_senders_refused_for_standing{fragment}    gauge: sender keys refused for low standing now
  atoll_sender_standing_lowest{fragment}          gauge: the lowest standing score per fragment owned
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeAlias

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from node.status.cache import Cached
from node.status.snapshot import PeerStatus

__all__ = ["CONTENT_TYPE", "MetricsText", "Reading", "StatusCollector", "families"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
Reading: TypeAlias = tuple[PeerStatus, float | None]  # a snapshot and the training loss (EMA)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"atoll_{name}", doc, value=value)


def _labelled(
    name: str, doc: str, label: str, values: dict[str, int], *, gauge: bool = False
) -> Metric:
    family: CounterMetricFamily | GaugeMetricFamily = (
        GaugeMetricFamily(f"atoll_{name}", doc, labels=[label])
        if gauge
        else CounterMetricFamily(f"atoll_{name}", doc, labels=[label])
    )
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"atoll_{name}", doc, value=value)


def families(status: PeerStatus, *, loss: float | None) -> Iterator[Metric]:
    """Every ``atoll_*`` family for one snapshot and the island's training ``loss``."""
    t, versions = status.totals, status.versions
    i, o = t.island, t.owners
    yield _counter(
        "bytes_sent", "Bytes this node sent over HTTP (requests and replies).", t.bytes_sent
    )
    yield _counter("bytes_received", "Bytes this node received over HTTP.", t.bytes_received)
    yield _counter(
        "direct_bodies",
        "Large bodies (requests and replies) read straight off their socket.",
        t.direct_bodies,
    )
    yield _counter("inner_steps", "Inner optimizer steps of this node's island.", i.inner_steps)
    yield _counter("tokens_trained", "Tokens this node's island trained on.", i.tokens_trained)
    yield _counter(
        "stalled_steps", "Island steps that waited on the network side.", i.stalled_steps
    )
    yield _labelled(
        "learner_contributions",
        "This island's contributions, by outcome at their owner.",
        "outcome",
        i.contributions,
    )
    yield _counter(
        "learner_resyncs", "Times this island took every fragment whole from its owners.", i.resyncs
    )
    yield _counter(
        "contributions_accepted",
        "Contributions this node's owners merged into a version.",
        o.merged,
    )
    yield _counter(
        "contributions_late",
        "Merged contributions that arrived after their base's round "
        "closed (carried to the next round, discounted).",
        o.late,
    )
    yield _labelled(
        "contributions_refused",
        "Contributions this node's owners refused, by reason (closed and stale: late ones).",
        "reason",
        o.refused,
    )
    yield _counter(
        "contributions_dropped", "Contributions dropped from a merge that failed.", o.dropped
    )
    yield _labelled(
        "contributions_bounded", "Merged contributions a merge bound bit.", "bound", o.bounded
    )
    yield _counter(
        "versions_published",
        "Global fragment versions this node's owners published.",
        o.versions_published,
    )
    merge = SummaryMetricFamily(
        "atoll_merge_seconds",
        "Time from a round's close to its version's "
        "publication (aggregate, outer step, replica handoff, seal).",
        count_value=o.versions_published,
        sum_value=o.merge_seconds,
    )
    yield merge
    yield _labelled(
        "remote_errors", "Requests this node refused, by error.", "error", t.remote_errors
    )
    yield _counter(
        "version_jumps_refused",
        "Versions refused as above what an owner can have reached.",
        i.version_jumps,
    )
    if loss is not None:
        yield _gauge("loss", "The island's training loss (exponential moving average).", loss)
    if i.goodput is not None:
        yield _gauge(
            "goodput",
            "Accepted share of contributions times computing share of step time.",
            i.goodput,
        )
    yield _gauge("members", "Swarm members this node sees.", t.members)
    yield _gauge("suspected_members", "Members that refused this node's connections.", t.suspects)
    yield _gauge("fragments_owned", "Fragments this node owns now.", o.fragments_owned)
    yield _labelled(
        "senders_refused_for_standing",
        "Sender keys whose standing is below the threshold "
        "now (their contributions are refused), per fragment owned.",
        "fragment",
        o.senders_refused,
        gauge=True,
    )
    lowest = GaugeMetricFamily(
        "atoll_sender_standing_lowest",
        "The lowest sender standing score per "
        "fragment owned (0: neutral; below the threshold: refused).",
        labels=["fragment"],
    )
    for p, score in o.lowest_standing.items():
        lowest.add_metric([p], score)
    yield lowest
    yield _labelled(
        "fragment_version",
        "The global version this island holds, per fragment.",
        "fragment",
        {str(p): v for p, v in enumerate(versions)},
        gauge=True,
    )


class StatusCollector(Collector):
    """Yields ``families`` of ``read()`` at each collection."""

    def __init__(self, read: Callable[[], Reading]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        status, loss = self.read()
        yield from families(status, loss=loss)


class MetricsText:
    """A node's registry and its exposition text, rendered at most once per ``max_age_s``."""

    def __init__(
        self,
        read: Callable[[], Reading],
        *,
        max_age_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(read))
        self._text = Cached(self._render, max_age_s=max_age_s, clock=clock)

    def _render(self) -> bytes:
        return generate_latest(self.registry)

    @property
    def clock(self) -> Callable[[], float]:
        return self._text.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._text.clock = clock

    @property
    def renders(self) -> int:
        """Times the text was rendered."""
        return self._text.computed

    def text(self) -> bytes:
        return self._text.get()
