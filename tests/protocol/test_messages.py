"""Messages: validation in ``__post_init__``, the registries, schema derivation.

The hypothesis strategies here (``messages()``, ``encoded_tensors()``) are shared with the codec
and signing tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import DecodeError, LocalProtocolError
from protocol.wire import codec
from protocol.wire.messages import (
    CAPS,
    MESSAGE_TYPES,
    STRUCT_TYPES,
    Ack,
    Blob,
    Contribution,
    FetchFragment,
    FragmentState,
    Hello,
    Maybe,
    Message,
    PeerInfo,
    Scalar,
    StructOf,
    TupleOf,
    WireStruct,
    register,
    register_struct,
    schema_of,
    struct_code,
)
from protocol.wire.tensors import CODECS, DTYPES, EncodedTensor

# ── strategies ───────────────────────────────────────────────────────────────────────────────
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_./é", min_size=1, max_size=24)
counts = st.integers(min_value=0, max_value=(1 << 63) - 1)
floats = st.floats(min_value=0.0, max_value=1e9, allow_nan=False, allow_infinity=False)


@st.composite
def encoded_tensors(draw: st.DrawFn) -> EncodedTensor:
    """EncodedTensors with data and scales of consistent sizes."""
    codec_name = draw(st.sampled_from(CODECS))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    block = draw(st.integers(1, 8)) if codec_name in ("int8", "int4", "topk2", "sign1") else 0
    numel = math.prod(shape)
    kept = -(-numel // block) if block else 0  # topk2: one in block_size (numel < one chunk)
    per = {
        "none": 4 * numel,
        "bf16": 2 * numel,
        "int8": numel,
        "int4": (numel + 1) // 2,
        "topk2": 2 * kept + (kept + 3) // 4,
        "sign1": (numel + 7) // 8,
    }
    n_scales = 4 * (numel > 0) if codec_name == "topk2" else 4 * -(-numel // block) if block else 0
    return EncodedTensor(
        codec=codec_name,
        shape=shape,
        dtype=draw(st.sampled_from(DTYPES)),
        block_size=block,
        data=draw(st.binary(min_size=per[codec_name], max_size=per[codec_name])),
        scales=draw(st.binary(min_size=n_scales, max_size=n_scales)),
    )


tensor_tuples = st.lists(encoded_tensors(), min_size=1, max_size=3).map(tuple)
addresses = st.sampled_from(["", "http://127.0.0.1:8000", "https://peer.example:443"])
peer_infos = st.builds(PeerInfo, peer_id=st.binary(min_size=32, max_size=32), address=addresses)


def messages() -> st.SearchStrategy[Message]:
    """Every registered general message type, with valid random fields."""
    return st.one_of(
        st.builds(
            Contribution,
            swarm=names,
            fragment=counts,
            base_version=counts,
            base_digest=st.binary(min_size=32, max_size=32),
            tokens=counts,
            steps=counts,
            step_time=floats,
            sender_step=counts,
            tensors=tensor_tuples,
        ),
        st.builds(
            FragmentState,
            swarm=names,
            fragment=counts,
            version=counts,
            tensors=tensor_tuples,
            content_hash=st.binary(min_size=32, max_size=32),
        ),
        st.builds(
            FetchFragment,
            swarm=names,
            fragment=counts,
            after_version=st.integers(-1, 1 << 40),
            wait_s=st.floats(0.0, CAPS.max_wait_s),
        ),
        st.builds(Ack, accepted=st.booleans(), reason=st.text(max_size=40), version=counts),
        st.builds(
            Hello,
            swarm=names,
            peer=peer_infos,
            roles=st.lists(names, max_size=4).map(tuple),
            step=counts,
        ),
    )


def tensor(n: int = 4) -> EncodedTensor:
    return EncodedTensor(
        codec="none", shape=(n,), dtype="float32", block_size=0, data=bytes(4 * n), scales=b""
    )


def contribution(**changes: object) -> Contribution:
    fields: dict[str, object] = dict(
        swarm="s",
        fragment=0,
        base_version=0,
        base_digest=bytes(32),
        tokens=1,
        steps=1,
        step_time=0.5,
        sender_step=1,
        tensors=(tensor(),),
    )
    fields.update(changes)
    return Contribution(**fields)  # type: ignore[arg-type]


# ── round trips ──────────────────────────────────────────────────────────────────────────────
@settings(max_examples=100, deadline=None)
@given(messages())
def test_every_message_round_trips_through_the_codec(msg: Message) -> None:
    back = codec.decode(codec.encode(msg).tobytes(), max_size=1 << 20)
    assert back == msg
    assert type(back) is type(msg)


def test_registry_holds_the_general_messages() -> None:
    expected = {1: Contribution, 2: FragmentState, 3: FetchFragment, 4: Ack, 5: Hello}
    assert {c: MESSAGE_TYPES[c] for c in expected} == expected
    assert all(c == cls.TYPE_CODE for c, cls in expected.items())
    assert STRUCT_TYPES[1] is EncodedTensor and STRUCT_TYPES[2] is PeerInfo
    assert struct_code(PeerInfo) == 2


# ── validation ───────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"tokens": -1}, "tokens must be >= 0"),
        ({"steps": True}, "expected int, got bool"),
        ({"fragment": 1 << 63}, "signed 64-bit"),
        ({"fragment": 2.0}, "expected int, got float"),
        ({"step_time": -0.1}, "step_time must be >= 0"),
        ({"step_time": math.nan}, "not finite"),
        ({"step_time": "1"}, "expected float"),
        ({"swarm": ""}, "name must be"),
        ({"swarm": "x" * 200}, "name must be"),
        ({"swarm": "a\nb"}, "unprintable"),
        ({"swarm": "\ud800"}, "UTF-8"),
        ({"swarm": "é" * 600}, "exceeds the cap"),
        ({"swarm": b"s"}, "expected str"),
        ({"tensors": ()}, "no tensors"),
        ({"tensors": [tensor()]}, "expected a tuple"),
        ({"tensors": (tensor(),) * (CAPS.max_tuple + 1)}, "exceed the cap"),
        ({"tensors": (PeerInfo(peer_id=bytes(32)),)}, "expected EncodedTensor"),
    ],
)
def test_contribution_refuses_bad_values(changes: dict[str, object], reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        contribution(**changes)


def test_a_refusal_names_the_field_and_element_and_chains_nothing() -> None:
    """Checks run without building place names; a failure is checked again to name its place,
    so the error is the one a check naming every place raises, with no first error behind it."""
    with pytest.raises(DecodeError) as bad_role:
        Hello(swarm="s", peer=PeerInfo(peer_id=bytes(32)), roles=("a", "b", 3), step=0)  # type: ignore[arg-type]
    assert str(bad_role.value) == "Hello.roles[2]: expected str, got int"
    assert bad_role.value.__context__ is None
    with pytest.raises(DecodeError, match=r"^Contribution.tensors\[1\]: expected EncodedTensor"):
        contribution(tensors=(tensor(), PeerInfo(peer_id=bytes(32))))


def test_int_for_float_field_becomes_float() -> None:
    c = contribution(step_time=2)
    assert c.step_time == 2.0 and type(c.step_time) is float
    with pytest.raises(DecodeError, match="not finite"):
        contribution(step_time=1 << 1100)


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: PeerInfo(peer_id=bytes(31)), "expected 32 bytes"),
        (lambda: PeerInfo(peer_id=bytearray(32)), "expected bytes"),
        (lambda: PeerInfo(peer_id=bytes(CAPS.max_bytes + 1)), "inline bytes exceed"),
        (lambda: PeerInfo(peer_id=bytes(32), address="ftp://x"), "not '' or an http"),
        (lambda: PeerInfo(peer_id=bytes(32), address="http://"), "not '' or an http"),
        (lambda: PeerInfo(peer_id=bytes(32), address="http://" + "a" * 300), "longer than"),
        (lambda: FetchFragment(swarm="s", fragment=0, after_version=-2, wait_s=0), ">= -1"),
        (lambda: FetchFragment(swarm="s", fragment=0, after_version=0, wait_s=1e4), "wait_s"),
        (lambda: Ack(accepted=1, reason="", version=0), "expected bool"),
        (lambda: Ack(accepted=True, reason="", version=-5), ">= -1"),
        (lambda: Hello(swarm="s", peer=PeerInfo(peer_id=bytes(32)), roles=("",), step=0), "name"),
        (lambda: Hello(swarm="s", peer=bytes(32), roles=(), step=0), "expected PeerInfo"),
        (
            lambda: Hello(swarm="s", peer=PeerInfo(peer_id=bytes(32)), roles=("r",) * 17, step=0),
            "roles exceed",
        ),
        (
            lambda: FragmentState(
                swarm="s", fragment=0, version=0, tensors=(tensor(),), content_hash=b"x"
            ),
            "expected 32 bytes",
        ),
    ],
)
def test_messages_refuse_bad_values(build: object, reason: str) -> None:
    with pytest.raises(DecodeError, match=reason):
        build()  # type: ignore[operator]


def test_messages_are_frozen_and_slotted() -> None:
    c = contribution()
    with pytest.raises(AttributeError):
        c.tokens = 5  # type: ignore[misc]
    assert not hasattr(c, "__dict__")


# ── registries and schemas ───────────────────────────────────────────────────────────────────
@dataclass(frozen=True, slots=True, kw_only=True)
class _Probe(Message):
    note: str | None
    peers: tuple[PeerInfo | EncodedTensor, ...]
    blob: bytes | bytearray | memoryview
    maybe_blob: bytes | bytearray | memoryview | None = None


def test_schema_derives_kinds_from_annotations() -> None:
    assert dict(schema_of(_Probe)) == {
        "note": Maybe(Scalar(str)),
        "peers": TupleOf(StructOf((PeerInfo, EncodedTensor))),
        "blob": Blob(),
        "maybe_blob": Maybe(Blob()),
    }


def test_registering_a_new_message_round_trips_optional_and_union_fields() -> None:
    register(120)(_Probe)
    try:
        probe = _Probe(note=None, peers=(PeerInfo(peer_id=bytes(32)), tensor(2)), blob=b"xyz")
        assert codec.decode(codec.encode(probe).tobytes(), max_size=4096) == probe
        probe2 = _Probe(note="n", peers=(), blob=b"", maybe_blob=bytearray(b"q"))
        assert codec.decode(codec.encode(probe2).tobytes(), max_size=4096) == probe2
        with pytest.raises(LocalProtocolError, match="already registered"):
            register(121)(_Probe)
    finally:
        del MESSAGE_TYPES[120]


def test_duplicate_and_bad_codes_are_local_errors() -> None:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Other(Message):
        x: int

    with pytest.raises(LocalProtocolError, match="already registered to Contribution"):
        register(1)(Other)
    for code in (0, 128, True):
        with pytest.raises(LocalProtocolError, match="outside"):
            register(code)(Other)
    with pytest.raises(LocalProtocolError, match="not a Message"):
        register(110)(PeerInfo)  # type: ignore[type-var]
    with pytest.raises(LocalProtocolError, match="already registered to PeerInfo"):
        register_struct(2)(Other)
    with pytest.raises(LocalProtocolError, match="not a registered wire struct"):
        struct_code(Other)


def test_unsupported_annotations_are_local_errors() -> None:
    @dataclass(frozen=True)
    class Dicty(WireStruct):
        d: dict[str, int]

    @dataclass(frozen=True)
    class Mixed(WireStruct):
        m: int | str

    class NotDataclass(Message):
        pass

    @dataclass
    class Thawed(WireStruct):
        x: int

    @dataclass(frozen=True)
    class Derived(WireStruct):
        x: int
        y: int = field(init=False, default=0)

    @dataclass(frozen=True)
    class Unresolvable(WireStruct):
        u: Nowhere  # type: ignore[name-defined]  # noqa: F821

    for cls, reason in [
        (Dicty, "unsupported wire type"),
        (Mixed, "unsupported union"),
        (NotDataclass, "not a frozen dataclass"),
        (Thawed, "not a frozen dataclass"),
        (Derived, "init fields"),
        (Unresolvable, "cannot resolve"),
    ]:
        with pytest.raises(LocalProtocolError, match=reason):
            schema_of(cls)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Fussy(WireStruct):
    words: tuple[str, ...]

    def _check(self) -> None:
        if "boom" in self.words:
            raise ValueError("a validator written carelessly")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Carrier(Message):
    fussy: _Fussy


def test_decode_wraps_careless_validators_and_encode_caps_the_header() -> None:
    register_struct(120)(_Fussy)
    register(120)(_Carrier)
    try:
        wire = bytearray(codec.encode(_Carrier(fussy=_Fussy(words=("boo!",)))).tobytes())
        wire[wire.index(b"boo!") : wire.index(b"boo!") + 4] = b"boom"
        with pytest.raises(DecodeError, match="invalid values"):
            codec.decode(bytes(wire), max_size=4096)
        huge = _Carrier(fussy=_Fussy(words=("w" * CAPS.max_str,) * CAPS.max_tuple))
        with pytest.raises(LocalProtocolError, match="header of"):
            codec.encode(huge)
    finally:
        del MESSAGE_TYPES[120], STRUCT_TYPES[120]
