"""What a node shows of itself: the status page at ``/``, its JSON and Prometheus ``/metrics``,
all read from one ``PeerStatus`` snapshot."""

from node.status.board import StatusBoard, StatusSource
from node.status.cache import Cached
from node.status.history import History, Point
from node.status.snapshot import PeerStatus
from node.status.totals import Totals

__all__ = [
    "Cached",
    "History",
    "PeerStatus",
    "Point",
    "StatusBoard",
    "StatusSource",
    "Totals",
]
