"""What a node shows of itself: the status page at ``/``, its JSON and Prometheus ``/metrics``."""

from node.status.board import StatusBoard
from node.status.history import History, Point
from node.status.totals import Totals, read_totals

__all__ = ["History", "Point", "StatusBoard", "Totals", "read_totals"]
