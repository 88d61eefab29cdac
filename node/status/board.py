"""A node's status board: what ``/``, ``/v1/status/board`` and ``/metrics`` show.

``StatusBoard(node)`` adds the routes to the node's server; the trainer calls ``record(step,
loss)`` about once a second. The board's JSON holds what the page draws and nothing more (no
keys beyond peer ids, no credentials): this node, the members it sees with their roles, labs and
reachability, each fragment's owner and versions, the progress history and the totals. It is
cheap whatever a visitor does: the JSON and the metrics are computed at most once per
``max_age_s``, the member list is cut at ``MAX_MEMBERS`` and every string a peer chose (a lab
name, an address, a role) is cut to a few hundred characters before it is sent. The totals sum
every owner's per-sender counts, on the event loop: with 20,000 senders that took ~45 ms (on a
busy 2-core machine), at most once per ``max_age_s``; a cached answer costs under a microsecond.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from node.status.history import History, Point
from node.status.metrics import CONTENT_TYPE, MetricsText
from node.status.page import add_routes
from node.status.totals import GoodputSums, Totals, read_totals

if TYPE_CHECKING:
    from node.dht.membership import Member
    from node.peer import PeerNode

__all__ = ["MAX_MEMBERS", "StatusBoard"]

MAX_MEMBERS = 256  # members listed on the page (the count says how many there are)
MAX_TEXT = 200  # characters of any string another peer chose
MAX_ROLES = 8


def _cut(value: object, limit: int = MAX_TEXT) -> str:
    return str(value)[:limit]


class StatusBoard:
    """Serves one node's status page, its JSON and its metrics (see the module docstring)."""

    def __init__(
        self,
        node: PeerNode,
        *,
        max_age_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.node, self.max_age_s, self.clock, self.wall_clock = node, max_age_s, clock, wall_clock
        self.history = History()
        self._sums = GoodputSums()
        self._totals: tuple[float, Totals] | None = None
        self._json: tuple[float, bytes] | None = None
        self.metrics = MetricsText(self._reading, max_age_s=max_age_s, clock=clock)
        add_routes(
            node.transport.app,
            board=self.board_json,
            metrics=self.metrics.text,
            metrics_type=CONTENT_TYPE,
        )

    def record(self, step: int, loss: float) -> None:
        """One progress point, from the trainer thread (about once a second)."""
        t = self.node.transport
        self.history.record(
            Point(self.wall_clock(), step, float(loss), t.bytes_sent, t.bytes_received)
        )

    @property
    def loss(self) -> float | None:
        last = self.history.last
        return last.loss if last is not None and math.isfinite(last.loss) else None

    def totals(self) -> Totals:
        """The node's totals, read at most once per ``max_age_s``."""
        now = self.clock()
        if self._totals is None or now - self._totals[0] >= self.max_age_s:
            self._totals = (now, read_totals(self.node, self._sums))
        return self._totals[1]

    def _reading(self) -> tuple[Totals, float | None, list[int]]:
        net = self.node.net
        return self.totals(), self.loss, list(net.island.versions) if net is not None else []

    def board_json(self) -> bytes:
        """``board()`` as JSON bytes, rendered at most once per ``max_age_s``."""
        now = self.clock()
        if self._json is None or now - self._json[0] >= self.max_age_s:
            self._json = (now, json.dumps(self.board(), allow_nan=False).encode())
        return self._json[1]

    def board(self) -> dict[str, Any]:
        """What the page draws (see the module docstring)."""
        node = self.node
        members = self._members()
        return {
            "swarm": node.cfg.swarm,
            "peer_id": node.signer.peer_id.hex(),
            "url": node.url,
            "reachable": node.reachable,
            "learning": node.learning,
            "step": node.step,
            "loss": self.loss,
            "members": members[:MAX_MEMBERS],
            "members_total": len(members),
            "fragments": self._fragments(),
            "history": [p.row() for p in self.history.points()],
            "totals": _finite(dataclasses.asdict(self.totals())),
        }

    def _members(self) -> list[dict[str, Any]]:
        node = self.node
        if node.membership is None:
            return []
        suspects, me = node.suspects(), node.signer.peer_id
        listed = sorted(
            node.membership.members.values(), key=lambda m: (m.peer_id != me, m.peer_id)
        )
        return [_member(m, self_=m.peer_id == me, suspect=m.peer_id in suspects) for m in listed]

    def _fragments(self) -> list[dict[str, Any]]:
        node = self.node
        versions = node.net.island.versions if node.net is not None else []
        out = []
        for p in range(len(node.plan.fragments)):
            owner = node.owner_of(p)
            running = node.owners.get(p)
            out.append(
                {
                    "fragment": p,
                    "owner_id": owner[0].hex() if owner else None,
                    "owner_url": _cut(owner[1]) if owner else None,
                    "version": versions[p] if p < len(versions) else None,
                    "owned": running.version if running is not None else None,
                    "epoch": running.epoch if running is not None else None,
                    # senders refused for low standing now, and the lowest scores (issue 47)
                    "standing": running.standing_status(3) if running is not None else None,
                }
            )
        return out


def _member(m: Member, *, self_: bool, suspect: bool) -> dict[str, Any]:
    r = m.record
    return {
        "peer_id": m.peer_id.hex(),
        "lab": _cut(m.lab, 64),
        "url": _cut(r.url),
        "roles": [_cut(role, 16) for role in list(r.roles)[:MAX_ROLES]],
        "reachable": bool(r.reachable),
        "learning": bool(r.learning),
        "step": int(r.step),
        "self": self_,
        "suspect": suspect,
    }


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
