"""A node's status board: what ``/``, ``/v1/status/board`` and ``/metrics`` show.

``StatusBoard(reader)`` adds the routes to the node's server (``reader``: a ``StatusSource``, the
peer's ``node.peer.status.PeerReader``); the trainer calls ``record(step, loss)`` about once a
second and ``record_validation(step, loss)`` at each evaluation on the held-out set (a recipe's
validation set, which the merge checks use too). Everything shown comes from one ``PeerStatus``
snapshot the reader builds and the board's own progress history. The board's JSON holds what the
page draws and nothing more (no keys beyond peer ids, no credentials): this node, the members it
sees with their roles, labs and reachability, each fragment's owner and versions, the progress and
validation histories and the totals. It is cheap whatever a visitor does: the snapshot, the JSON
and the metrics are each computed at most once per ``max_age_s`` (``Cached``), and the snapshot
holds at most ``MAX_MEMBERS`` members with every string a peer chose cut short. The totals sum
every owner's per-sender counts, on the event loop: with 20,000 senders that took ~45 ms (on a busy
2-core machine), at most once per ``max_age_s``; a cached answer costs under a microsecond.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aiohttp import web

from node.status.cache import Cached
from node.status.history import History, Point
from node.status.metrics import CONTENT_TYPE, MetricsText, Reading
from node.status.page import add_routes
from node.status.snapshot import (
    MAX_MEMBERS,
    MAX_TEXT,
    FragmentStatus,
    MemberStatus,
    PeerStatus,
)
from node.status.totals import Totals

__all__ = ["MAX_MEMBERS", "MAX_TEXT", "StatusBoard", "StatusSource", "board_of"]


class StatusSource(Protocol):
    """What a board reads: the snapshot, the byte counters (from any thread) and the server's
    application its routes go on (``node.peer.status.PeerReader`` for a peer)."""

    @property
    def app(self) -> web.Application: ...

    def status(self) -> PeerStatus: ...

    def traffic(self) -> tuple[int, int]: ...


class StatusBoard:
    """Serves one node's status page, its JSON and its metrics (see the module docstring)."""

    def __init__(
        self,
        reader: StatusSource,
        *,
        max_age_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.reader = reader
        self.max_age_s, self.clock, self.wall_clock = max_age_s, clock, wall_clock
        self.history = History()
        self.validation = History()  # held-out loss at each evaluation, bounded the same way
        self._status = Cached(self.reader.status, max_age_s=max_age_s, clock=self._now)
        self._json = Cached(self._render_json, max_age_s=max_age_s, clock=self._now)
        self.metrics = MetricsText(self._reading, max_age_s=max_age_s, clock=clock)

        async def board_body() -> bytes:
            return self.board_json()

        async def metrics_body() -> bytes:
            return self.metrics.text()

        add_routes(
            self.reader.app, board=board_body, metrics=metrics_body, metrics_type=CONTENT_TYPE
        )

    def _now(self) -> float:
        return self.clock()  # read each time: a test may swap ``clock`` after construction

    def record(self, step: int, loss: float) -> None:
        """One progress point, from the trainer thread (about once a second)."""
        self.history.record(self._point(step, loss))

    def record_validation(self, step: int, loss: float) -> None:
        """The held-out loss of the model at inner ``step``, from the trainer thread."""
        self.validation.record(self._point(step, loss))

    def _point(self, step: int, loss: float) -> Point:
        sent, received = self.reader.traffic()
        return Point(self.wall_clock(), step, float(loss), sent, received)

    @property
    def loss(self) -> float | None:
        last = self.history.last
        return last.loss if last is not None and math.isfinite(last.loss) else None

    def status(self) -> PeerStatus:
        """The node's snapshot, read at most once per ``max_age_s``."""
        return self._status.get()

    def totals(self) -> Totals:
        """The node's totals, read at most once per ``max_age_s``."""
        return self.status().totals

    def _reading(self) -> Reading:
        return self.status(), self.loss

    def board_json(self) -> bytes:
        """``board()`` as JSON bytes, rendered at most once per ``max_age_s``."""
        return self._json.get()

    def _render_json(self) -> bytes:
        return json.dumps(self.board(), allow_nan=False).encode()

    def board(self) -> dict[str, Any]:
        """What the page draws (see the module docstring)."""
        return board_of(
            self.status(),
            self.history.points(),
            loss=self.loss,
            validation=self.validation.points(),
        )


def board_of(
    status: PeerStatus,
    history: Sequence[Point],
    *,
    loss: float | None,
    validation: Sequence[Point] = (),
) -> dict[str, Any]:
    """The page's JSON for one snapshot, the progress ``history``, the training ``loss`` and the
    held-out loss at each evaluation (``validation``, rows ``[step, loss]``)."""
    return {
        "swarm": status.swarm,
        "peer_id": status.peer_id,
        "url": status.url,
        "reachable": status.reachable,
        "learning": status.learning,
        "step": status.step,
        "loss": loss,
        "members": [_member(m) for m in status.members],
        "members_total": status.members_total,
        "fragments": [_fragment(f) for f in status.fragments],
        "history": [p.row() for p in history],
        "validation": [[p.step, p.loss] for p in validation if math.isfinite(p.loss)],
        "totals": _finite(dataclasses.asdict(status.totals)),
    }


def _member(m: MemberStatus) -> dict[str, Any]:
    return {
        "peer_id": m.peer_id,
        "lab": m.lab,
        "url": m.url,
        "roles": list(m.roles),
        "reachable": m.reachable,
        "learning": m.learning,
        "step": m.step,
        "self": m.is_self,
        "suspect": m.suspect,
    }


def _fragment(f: FragmentStatus) -> dict[str, Any]:
    return {
        "fragment": f.fragment,
        "owner_id": f.owner_id,
        "owner_url": f.owner_url,
        "version": f.version,
        "owned": f.owned,
        "epoch": f.epoch,
        "standing": f.standing,
    }


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
