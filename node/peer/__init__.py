"""One peer of a swarm, composed (``PeerNode``): its presence in the swarm, the fragments it
owns and their handoffs, version serving, and the learner's network side."""

from __future__ import annotations

from node.peer.node import NodeOptions, PeerNode, emit

__all__ = ["NodeOptions", "PeerNode", "emit"]
