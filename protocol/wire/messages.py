"""Atoll's general and DiLoCo wire messages and structs (type codes 1-31).

Each is a frozen, slotted, keyword-only dataclass whose annotations are its wire schema and
whose ``_check`` adds range checks; the schema machinery (kinds, the ``MESSAGE_TYPES`` and
``STRUCT_TYPES`` registries, ``register``, ``check_fields``, the ``WireStruct`` and ``Message``
bases, the ``CAPS`` size caps) lives in ``protocol.wire.schema`` and is re-exported here, so
``from protocol.wire.messages import register, Message`` keeps working. Importing this module
registers the classes below; since decoding constructs the same classes, every violation of a
schema or a range raises ``DecodeError``: a remote error when a peer sent it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocol.errors import DecodeError
from protocol.wire.schema import (
    CAPS,
    MESSAGE_TYPES,
    STRUCT_TYPES,
    Blob,
    Caps,
    Kind,
    Maybe,
    Message,
    Scalar,
    StructOf,
    TupleOf,
    WireStruct,
    check_fields,
    check_value,
    register,
    register_struct,
    schema_of,
    struct_code,
)
from protocol.wire.tensors import EncodedTensor

__all__ = [
    "CAPS",
    "MESSAGE_TYPES",
    "STRUCT_TYPES",
    "Ack",
    "Blob",
    "Caps",
    "Contribution",
    "FetchFragment",
    "FragmentState",
    "FragmentUpdate",
    "Hello",
    "Kind",
    "Maybe",
    "Message",
    "PeerInfo",
    "ReplicaAck",
    "ReplicaState",
    "Scalar",
    "StructOf",
    "TupleOf",
    "WireStruct",
    "check_fields",
    "check_value",
    "register",
    "register_struct",
    "schema_of",
    "struct_code",
]

PEER_ID_BYTES = 32
HASH_BYTES = 32
MAX_NORM_HISTORY = 64  # a merger's reference: a few rounds of accepted norms
MAX_STANDING = 4096  # sender keys whose standing a handoff carries (``StandingConfig.max_keys``)
MAX_STANDING_SCORE = 1000.0  # far past any ``StandingConfig`` bound; the successor checks its own


def _require(ok: bool, reason: str) -> None:
    if not ok:
        raise DecodeError(reason)


def _non_negative(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value >= 0, f"{type(obj).__name__}.{name} must be >= 0, got {value}")


def _name(value: str, where: str) -> None:
    _require(0 < len(value) <= CAPS.max_name, f"{where}: name must be 1..{CAPS.max_name} chars")
    _require(value.isprintable(), f"{where}: name has unprintable characters")


def _hash(value: bytes, n: int, where: str) -> None:
    _require(len(value) == n, f"{where}: expected {n} bytes, got {len(value)}")


def _tensors(value: tuple[EncodedTensor, ...], where: str) -> None:
    _require(len(value) > 0, f"{where}: carries no tensors")


# ── structs ──────────────────────────────────────────────────────────────────────────────────
register_struct(1)(EncodedTensor)


@register_struct(2)
@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo(WireStruct):
    """A peer: its id and the address it can be dialled at ("" when not dialable)."""

    peer_id: bytes
    address: str = ""

    def _check(self) -> None:
        _hash(self.peer_id, PEER_ID_BYTES, "PeerInfo.peer_id")
        a = self.address
        _require(len(a) <= CAPS.max_address, f"PeerInfo.address longer than {CAPS.max_address}")
        ok = a == "" or (a.startswith(("http://", "https://")) and a.split("://", 1)[1] != "")
        _require(ok and a.isprintable(), f"PeerInfo.address {a!r} is not '' or an http(s) URL")


# ── messages ─────────────────────────────────────────────────────────────────────────────────
@register(1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Contribution(Message):
    """A learner's compressed pseudo-gradient for one fragment, measured against version
    ``base_version`` whose decoded flat fp32 state hashes to ``base_digest`` (SHA-256): an owner
    applies it only to that very state."""

    swarm: str
    fragment: int
    base_version: int
    base_digest: bytes
    tokens: int
    steps: int
    step_time: float  # seconds per inner step (EMA)
    sender_step: int
    tensors: tuple[EncodedTensor, ...]
    last: bool = False  # the sender's last contribution of its run for this fragment (its flush)

    def _check(self) -> None:
        _name(self.swarm, "Contribution.swarm")
        _non_negative(
            self, "fragment", "base_version", "tokens", "steps", "step_time", "sender_step"
        )
        _hash(self.base_digest, HASH_BYTES, "Contribution.base_digest")
        _tensors(self.tensors, "Contribution.tensors")


@register(2)
@dataclass(frozen=True, slots=True, kw_only=True)
class FragmentState(Message):
    """Version ``version`` of a fragment's global parameters; ``content_hash`` is the
    caller's sha256 over the tensors' data and scales."""

    swarm: str
    fragment: int
    version: int
    tensors: tuple[EncodedTensor, ...]
    content_hash: bytes

    def _check(self) -> None:
        _name(self.swarm, "FragmentState.swarm")
        _non_negative(self, "fragment", "version")
        _tensors(self.tensors, "FragmentState.tensors")
        _hash(self.content_hash, HASH_BYTES, "FragmentState.content_hash")


@register(8)
@dataclass(frozen=True, slots=True, kw_only=True)
class FragmentUpdate(Message):
    """Version ``version`` of a fragment as a compressed outer update over ``base_version``:
    a learner holding that version, whose decoded flat fp32 state hashes to ``base_digest``,
    adds the decoded ``tensors`` to it (``protocol.diloco.updates.apply_update``) and must get a
    state hashing to ``state_digest`` (SHA-256 of the flat fp32 vector, which is also the
    ``content_hash`` of the version's full fp32 ``FragmentState``); anything else is a mismatch,
    repaired by fetching the full version."""

    swarm: str
    fragment: int
    version: int
    base_version: int
    base_digest: bytes
    state_digest: bytes
    tensors: tuple[EncodedTensor, ...]

    def _check(self) -> None:
        _name(self.swarm, "FragmentUpdate.swarm")
        _non_negative(self, "fragment", "version", "base_version")
        if self.base_version >= self.version:
            raise DecodeError(
                f"FragmentUpdate.base_version {self.base_version} must be below version {self.version}"
            )
        _hash(self.base_digest, HASH_BYTES, "FragmentUpdate.base_digest")
        _hash(self.state_digest, HASH_BYTES, "FragmentUpdate.state_digest")
        _tensors(self.tensors, "FragmentUpdate.tensors")


@register(3)
@dataclass(frozen=True, slots=True, kw_only=True)
class FetchFragment(Message):
    """Ask for the first version of a fragment after ``after_version`` (-1: any), waiting up
    to ``wait_s`` seconds for it (long poll)."""

    swarm: str
    fragment: int
    after_version: int
    wait_s: float

    def _check(self) -> None:
        _name(self.swarm, "FetchFragment.swarm")
        _non_negative(self, "fragment")
        _require(self.after_version >= -1, "FetchFragment.after_version must be >= -1")
        ok = 0.0 <= self.wait_s <= CAPS.max_wait_s
        _require(ok, f"FetchFragment.wait_s {self.wait_s} outside 0..{CAPS.max_wait_s}")


@register(4)
@dataclass(frozen=True, slots=True, kw_only=True)
class Ack(Message):
    """Whether a request was accepted, why, and the version it concerned (-1: none)."""

    accepted: bool
    reason: str
    version: int

    def _check(self) -> None:
        _require(self.version >= -1, f"Ack.version must be >= -1, got {self.version}")


@register(6)
@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaState(Message):
    """An owner's whole state for one fragment, handed to its replica before it publishes
    ``version`` (and to its successor when it retires): the global fragment and the outer
    momentum in fp32 (``momentum`` empty before the first merge with momentum), ``digest`` of the
    version as learners decode it, and the owner's ``epoch`` (a takeover starts a higher one).
    ``merged_peers``/``merged_bases``: for each recent sender, the newest base version of its work
    that is merged into this state, so the next owner refuses that work if it is sent again.
    With ``base_version`` >= 0 the state comes as the owner's update over the state of that
    version the replica holds (``base_digest``): ``theta`` then carries the update's tensors, to
    be applied as learners apply a ``FragmentUpdate`` (``protocol.diloco.updates``). With
    ``base_version == version`` (and ``base_digest == digest``, no tensors) the state is the
    one the replica holds under that version and digest already: a handoff by reference.
    ``final``: the sender handed ``version`` out as final (learners ending their run took it and
    left); the next owner holds it final too, refusing work for the final hold, or the swarm
    ends on two models.
    ``norm_history``: the merger's recent accepted norms, the reference its clip measures
    against, so a successor does not start without one; ``standing_peers``/``standing_scores``:
    the owner's standing per sender key (``protocol.diloco.standing``). Absent in older
    senders' messages (a successor then seeds its reference from norms it measures).
    ``norm_senders``: the key id of each ``norm_history`` norm's sender (empty bytes: unknown,
    e.g. a measured norm), so a successor counts a sender of its first round once in its clip
    reference; absent (older senders): every handed norm is anonymous."""

    swarm: str
    fragment: int
    epoch: int
    version: int
    digest: bytes
    theta: tuple[EncodedTensor, ...]
    momentum: tuple[EncodedTensor, ...]
    merged_peers: tuple[bytes, ...] = ()
    merged_bases: tuple[int, ...] = ()
    base_version: int = -1
    base_digest: bytes = b""
    final: bool = False
    norm_history: tuple[float, ...] = ()
    standing_peers: tuple[bytes, ...] = ()
    standing_scores: tuple[float, ...] = ()
    norm_senders: tuple[bytes, ...] = ()
    # left out of the bytes when empty, and taken as empty when absent (older senders)
    ADDED: ClassVar[frozenset[str]] = frozenset(
        {"norm_history", "standing_peers", "standing_scores", "norm_senders"}
    )

    @property
    def handed_norms(self) -> tuple[tuple[bytes | None, float], ...]:
        """``norm_history`` with each norm's sender (None: anonymous, as every norm is in an
        older sender's message)."""
        senders = self.norm_senders or (b"",) * len(self.norm_history)
        return tuple((p or None, n) for p, n in zip(senders, self.norm_history, strict=True))

    def _check(self) -> None:
        _name(self.swarm, "ReplicaState.swarm")
        _non_negative(self, "fragment", "epoch", "version")
        _hash(self.digest, HASH_BYTES, "ReplicaState.digest")
        _require(
            len(self.merged_peers) == len(self.merged_bases),
            "ReplicaState.merged_peers and merged_bases must pair up",
        )
        for peer in self.merged_peers:
            _hash(peer, PEER_ID_BYTES, "ReplicaState.merged_peers")
        _require(
            all(0 <= b <= self.version for b in self.merged_bases),
            "ReplicaState.merged_bases must lie in 0..version",
        )
        _require(
            len(self.norm_history) <= MAX_NORM_HISTORY and all(x >= 0 for x in self.norm_history),
            f"ReplicaState.norm_history must hold at most {MAX_NORM_HISTORY} norms, each >= 0",
        )
        _require(
            not self.norm_senders or len(self.norm_senders) == len(self.norm_history),
            "ReplicaState.norm_senders must be empty or pair up with norm_history",
        )
        for peer in self.norm_senders:
            if peer:
                _hash(peer, PEER_ID_BYTES, "ReplicaState.norm_senders")
        _require(
            len(self.standing_peers) == len(self.standing_scores) <= MAX_STANDING,
            f"ReplicaState.standing_peers and standing_scores must pair up, at most {MAX_STANDING}",
        )
        for peer in self.standing_peers:
            _hash(peer, PEER_ID_BYTES, "ReplicaState.standing_peers")
        _require(
            all(abs(s) <= MAX_STANDING_SCORE for s in self.standing_scores),
            f"ReplicaState.standing_scores must lie in -{MAX_STANDING_SCORE}..{MAX_STANDING_SCORE}",
        )
        if self.base_version == -1:
            _tensors(self.theta, "ReplicaState.theta")
            _require(
                self.base_digest == b"",
                "ReplicaState.base_digest must be empty without a base_version",
            )
            _require(
                len(self.theta) == 1 and len(self.momentum) <= 1,
                "ReplicaState carries one theta tensor and at most one momentum tensor",
            )
        elif self.base_version == self.version:
            _require(
                self.base_digest == self.digest and not self.theta and not self.momentum,
                "a handoff by reference (base_version == version) names the version's digest as its "
                "base and carries no tensors",
            )
        else:
            _require(
                0 <= self.base_version < self.version,
                "ReplicaState.base_version must be -1, lie in 0..version-1 (an update) or be version "
                "(by reference)",
            )
            _hash(self.base_digest, HASH_BYTES, "ReplicaState.base_digest")
            _require(not self.momentum, "an update handoff (base_version >= 0) carries no momentum")
            _tensors(self.theta, "ReplicaState.theta")
        if self.momentum:
            _tensors(self.momentum, "ReplicaState.momentum")


@register(7)
@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaAck(Message):
    """A replica's answer to a handoff: whether it took it, why, and the epoch and version it
    holds for the fragment now (-1: none)."""

    accepted: bool
    reason: str
    epoch: int
    version: int

    def _check(self) -> None:
        _require(
            self.epoch >= -1 and self.version >= -1, "ReplicaAck epoch and version must be >= -1"
        )


@register(5)
@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """A liveness and membership ping: who I am, what roles I take, my inner step."""

    swarm: str
    peer: PeerInfo
    roles: tuple[str, ...]
    step: int

    def _check(self) -> None:
        _name(self.swarm, "Hello.swarm")
        _non_negative(self, "step")
        n = len(self.roles)
        _require(n <= CAPS.max_roles, f"Hello.roles: {n} roles exceed the cap {CAPS.max_roles}")
        for role in self.roles:
            _name(role, "Hello.roles")
