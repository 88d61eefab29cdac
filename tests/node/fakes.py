"""In-memory stand-ins for node/ unit tests: a fake clock and a transport without sockets.

``MemoryTransport`` implements the part of ``node.wire.transport.Transport`` that a learner
uses (``request`` and ``pool.give``) by calling ``MemoryOwnerPeer`` objects registered under a
base URL. ``MemoryOwnerPeer`` answers like a peer's owner side: ``POST /v1/rpc`` opens the sealed
request (signature and replay checked), refuses non-members, hands a ``Contribution`` to the
fragment's ``FragmentOwner`` and seals the Ack; ``GET /v1/fragments/p/next`` and ``/final``
return the owner's sealed versions.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import torch
from torch import nn

from node.diloco.owner import Declined, FragmentOwner, OwnerClocks, OwnerConfig, OwnerStart
from node.diloco.spread import DECLINED_STATUS, VERSION_HEADER
from node.diloco.validation import OwnerValidation
from node.wire.transport import LinkDropped, Transport
from protocol.diloco.compression import compress
from protocol.diloco.fragments import FragmentPlan, plan_fragments
from protocol.diloco.merge import MergeConfig
from protocol.diloco.outer import OuterConfig
from protocol.errors import NotAuthorized, RemoteProtocolError
from protocol.wire.codec import encode
from protocol.wire.messages import Contribution, Message
from protocol.wire.signing import ReplayWindow, Signer, open_sealed, seal

SWARM = "unit"


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def signer(n: int) -> Signer:
    return Signer.from_seed(bytes([n]) * 32)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def tiny_plan(model: nn.Module, fragments: int = 2) -> FragmentPlan:
    return plan_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], fragments)


def shapes_of(model: nn.Module, plan: FragmentPlan) -> list[list[tuple[int, ...]]]:
    named = dict(model.named_parameters())
    return [[tuple(named[n].shape) for n in f.names] for f in plan.fragments]


def flat_of(model: nn.Module, plan: FragmentPlan, p: int) -> torch.Tensor:
    named = dict(model.named_parameters())
    return torch.cat([named[n].detach().reshape(-1) for n in plan.fragments[p].names]).float()


def make_owner(
    plan: FragmentPlan,
    shapes: Sequence[Sequence[tuple[int, ...]]],
    p: int,
    initial: torch.Tensor,
    clock: FakeClock,
    *,
    who: Signer | None = None,
    version: int = 0,
    event_log: Path | None = None,
    update_codec: str | None = None,
    validation: OwnerValidation | None = None,
    **merge: object,
) -> FragmentOwner:
    cfg = MergeConfig(**{"quorum": 1, "gamma": 0.5, "tau": 2.0, **merge})  # type: ignore[arg-type]
    return FragmentOwner(
        OwnerConfig(
            swarm=SWARM,
            fragment=plan.fragments[p],
            shapes=tuple(shapes[p]),
            merge=cfg,
            outer=OuterConfig(lr=1.0, momentum=0.0),
            event_log=event_log,
            update_codec=update_codec,
        ),
        OwnerStart(
            theta=initial,
            version=version,
        ),
        signer=who or signer(1),
        clocks=OwnerClocks(clock),
        validation=validation,
    )


def contribution(
    delta: torch.Tensor,
    shapes: Sequence[tuple[int, ...]],
    *,
    fragment: int = 0,
    base_version: int = 0,
    tokens: int = 64,
    steps: int = 4,
    step_time: float = 1.0,
    codec: str = "none",
    owner: FragmentOwner | None = None,
    base_digest: bytes | None = None,
) -> Contribution:
    """A contribution carrying ``delta`` (flat fp32) cut to ``shapes``, compressed with ``codec``,
    measured against ``owner``'s state at ``base_version`` (or the state named by ``base_digest``)."""
    if base_digest is None:
        known = owner.digests.get(base_version) if owner is not None else None
        base_digest = next(iter(known)) if known else bytes(32)
    tensors, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        tensors.append(compress(delta[offset : offset + n].view(shape), codec)[0])
        offset += n
    return Contribution(
        swarm=SWARM,
        fragment=fragment,
        base_version=base_version,
        base_digest=base_digest,
        tokens=tokens,
        steps=steps,
        step_time=step_time,
        sender_step=steps,
        tensors=tuple(tensors),
    )


def sealed_bytes(msg: Message, who: Signer) -> bytes:
    return seal(encode(msg), who, now=time.time(), nonce=os.urandom(16)).tobytes()


class Tasks:
    """Stands in for the node's task group: runs what it is given and keeps it."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Future[None]] = []

    def create_task(self, coro):  # type: ignore[no-untyped-def]
        self.tasks.append(asyncio.ensure_future(coro))
        return self.tasks[-1]

    async def done(self) -> None:
        await asyncio.gather(*self.tasks)

    async def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class _Pool:
    def __init__(self) -> None:
        self.given = 0

    def give(self, buf: bytearray) -> None:
        self.given += 1


@dataclass
class MemoryOwnerPeer:
    """A peer's owner side, in memory (see the module docstring)."""

    who: Signer
    owners: dict[int, FragmentOwner]
    members: set[bytes] = field(default_factory=set)
    ack_signer: Signer | None = None  # sign Acks with another key (an impostor)
    asker: bytes | None = None  # who signs the GETs (node.peer.serving reads the admitted signer)
    replay: ReplayWindow = field(default_factory=ReplayWindow)
    requests: int = 0

    async def handle(
        self, method: str, path: str, query: dict[str, str], body: bytes
    ) -> tuple[int, bytes] | tuple[int, bytes, dict[str, str]]:
        self.requests += 1
        if method == "POST" and path == "/v1/rpc":
            try:
                opened = open_sealed(
                    memoryview(body), now=time.time(), replay=self.replay, max_size=1 << 24
                )
                if opened.peer_id not in self.members:
                    raise NotAuthorized(
                        f"peer {opened.peer_id.hex()[:8]} is not a member of this swarm"
                    )
                msg = opened.message
                assert isinstance(msg, Contribution)
                ack = await self.owners[msg.fragment].contribute(opened.peer_id, msg)
            except RemoteProtocolError as exc:
                return exc.status, json.dumps(
                    {"error": type(exc).__name__, "reason": exc.reason}
                ).encode()
            return 200, sealed_bytes(ack, self.ack_signer or self.who)
        parts = path.strip("/").split("/")
        if method == "GET" and parts[:2] == ["v1", "fragments"] and len(parts) == 4:
            owner = self.owners[int(parts[2])]
            after, wait = int(query.get("after", "-1")), float(query.get("wait", "0"))
            sealed = (
                owner.declare_final()
                if parts[3] == "final"  # an idle owner's latest is final
                else await owner.wait_after(after, wait, asker=self.asker)
                if parts[3] == "next"
                else None
            )
            if isinstance(sealed, Declined):  # as node.peer.serving
                return DECLINED_STATUS, b"", {VERSION_HEADER: str(sealed.base)}
            if sealed is not None and query.get("update") == "1":  # as node.peer.serving
                named = bytes.fromhex(query.get("digest", ""))
                if (
                    parts[3] == "final"
                    and owner.version == after
                    and named in owner.digests.get(after, set())
                ):
                    return 304, b""  # the learner holds the final version already
                sealed = owner.sealed_after(after, update_ok=True)
            return (204, b"") if sealed is None else (200, sealed.tobytes())
        return 404, b"not found"


class MemoryTransport:
    """``request``, ``reply`` and ``pool`` of ``Transport``, routed to in-memory peers by base URL."""

    def __init__(self) -> None:
        self.peers: dict[str, MemoryOwnerPeer] = {}
        self.pool = _Pool()
        self.down: set[str] = set()  # base URLs whose link drops every request
        self.bytes_sent = 0

    def add(self, base: str, peer: MemoryOwnerPeer) -> None:
        self.peers[base] = peer

    async def request(
        self,
        method: str,
        url: str,
        *,
        chunks: Iterable[memoryview | bytes] = (),
        size: int | None = None,
        timeout_s: float = 30.0,
        max_reply: int | None = None,
        kind: str = "",
    ) -> tuple[int, bytearray, int, dict[str, str]]:
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        if base in self.down or base not in self.peers:
            raise LinkDropped(f"emulated link to {base} dropped the request")
        body = b"".join(bytes(c) for c in chunks)
        self.bytes_sent += len(body)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        status, reply, *headers = await self.peers[base].handle(method, parts.path, query, body)
        if max_reply is not None and len(reply) > max_reply:
            raise RemoteProtocolError(f"reply of {len(reply)} bytes over {max_reply}")
        return status, bytearray(reply), len(reply), headers[0] if headers else {}

    reply = Transport.reply  # ``request`` as a context manager, as the real one
