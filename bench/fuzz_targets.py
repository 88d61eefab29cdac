"""What the fuzzer attacks: every decoder that turns a peer's bytes or strings into values.

Shared by ``bench.fuzz`` (long random runs) and ``tests/protocol/test_fuzz.py`` (short hypothesis
properties), so the list of decoders lives here once. A ``Target`` is a decoder fed one hostile
input; it passes when the decoder returns a value (that keeps its invariants) or raises a
``RemoteProtocolError`` (DecodeError, BadSignature, Oversize, …), and fails on any other
exception. ``seeds`` are valid encodings to mutate; ``trees`` are the msgpack structures inside
them and ``build`` re-encodes a (mutated) tree, to send well-framed values of the wrong type.

The mutators that make hostile inputs from the seeds are in ``bench.fuzz_mutators``.
"""

from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import msgpack
import tomli_w
import torch

from node.dht.bootstrap import _target as dialback_target
from node.dht.membership import MemberRecord
from node.diloco.flat import flat_from_tensors
from node.state.serve import (
    Manifest,
    RangeNotSatisfiable,
    encode_manifest,
    etag_version,
    parse_content_range,
    parse_range,
    unquote_etag,
)
from protocol.dht.messages import (
    FindNode,
    FindValue,
    NodesReply,
    Ping,
    Pong,
    Store,
    StoreReply,
    ValueReply,
)
from protocol.dht.records import RecordStore, sign_record
from protocol.diloco.compression import compress, decompress
from protocol.errors import DecodeError, RemoteProtocolError
from protocol.ids import key_id, peer_id_from_public_key
from protocol.wire.certificates import Certificate, check_certificate
from protocol.wire.codec import ALIGN, MAGIC, BodyReader, Encoded, decode, encode
from protocol.wire.membership import SwarmManifest
from protocol.wire.messages import (
    Ack,
    Contribution,
    FetchFragment,
    FragmentState,
    Hello,
    Message,
    PeerInfo,
)
from protocol.wire.request_auth import RequestAuth
from protocol.wire.signing import (
    ReplayWindow,
    SealedReader,
    Signer,
    open_envelope,
    open_sealed,
    seal,
)
from protocol.wire.tensors import EncodedTensor

__all__ = ["MAX_SIZE", "NOW", "SHAPES", "Target", "attempt", "frame", "targets"]

MAX_SIZE = 1 << 20  # cap on a message in every target
NOW = 1_700_000_000.0  # the clock of every seed and every check
SHAPES = ((3, 5), (7,), (2, 2, 2), (5,))  # the fragment plan the tensor targets check against
_SIGNER_SEED = bytes(range(32))


@dataclass(frozen=True, slots=True)
class Target:
    """One decoder to attack. ``feed`` raises what the decoder raises."""

    name: str
    feed: Callable[[bytes], object]
    seeds: tuple[bytes, ...]
    trees: tuple[object, ...] = ()
    build: Callable[[object], bytes] | None = None


def attempt(target: Target, data: bytes) -> str | None:
    """None if ``target`` handled ``data`` as documented, else what went wrong."""
    try:
        target.feed(data)
    except RemoteProtocolError:
        return None
    except Exception as e:  # everything else is a bug: IndexError, ValueError, MemoryError, …
        return f"{type(e).__name__}: {str(e)[:200]} (input {data[:64].hex()}… {len(data)} bytes)"
    return None


# ── seeds ────────────────────────────────────────────────────────────────────────────────────
def _signer() -> Signer:
    return Signer(_SIGNER_SEED)


def _tensors(
    codecs: tuple[str, ...] = ("none", "bf16", "int8", "int4"),
) -> tuple[EncodedTensor, ...]:
    out = []
    for i, (shape, codec) in enumerate(zip(SHAPES, codecs, strict=True)):
        t = torch.linspace(-1.0 - i, 2.0 + i, steps=int(torch.Size(shape).numel())).view(shape)
        out.append(compress(t, codec, block_size=4)[0])
    return tuple(out)


def _messages() -> list[Message]:
    signer = _signer()
    peer = PeerInfo(peer_id=signer.peer_id, address="http://127.0.0.1:8000")
    tensors = _tensors()
    key = key_id("atoll/s/members")
    member = MemberRecord(
        url="http://127.0.0.1:8000",
        roles=("learner", "owner"),
        reachable=True,
        manifest="ab" * 16,
        learning=True,
        step=3,
    )
    record = sign_record(signer, key, member.encode(), NOW + 60.0)
    return [
        Contribution(
            swarm="s",
            fragment=1,
            base_version=2,
            base_digest=b"d" * 32,
            tokens=512,
            steps=10,
            step_time=0.25,
            sender_step=40,
            tensors=tensors,
        ),
        FragmentState(swarm="s", fragment=0, version=7, tensors=tensors, content_hash=b"h" * 32),
        FetchFragment(swarm="s", fragment=0, after_version=-1, wait_s=5.0),
        Ack(accepted=False, reason="stale", version=3),
        Hello(swarm="s", peer=peer, roles=("owner", "learner"), step=9),
        Ping(sender=peer),
        Pong(sender=peer),
        FindNode(sender=peer, target=key),
        FindValue(sender=peer, key=key),
        Store(sender=peer, records=(record,)),
        NodesReply(peers=(peer, PeerInfo(peer_id=b"\x07" * 32))),
        ValueReply(records=(record, record), peers=(peer,)),
        StoreReply(accepted=1, reasons=("full",)),
        # the other codecs' tensors (last, so the indices above stay put)
        Contribution(
            swarm="s",
            fragment=2,
            base_version=0,
            base_digest=b"e" * 32,
            tokens=64,
            steps=2,
            step_time=0.5,
            sender_step=2,
            tensors=_tensors(("sign1", "topk2", "sign1", "topk2")),
        ),
    ]


def _encoded() -> tuple[bytes, ...]:
    return tuple(encode(m).tobytes() for m in _messages())


def _sealed(body: bytes, i: int = 0) -> bytes:
    """``body`` (any bytes) sealed by the fixed signer at ``NOW``."""
    enc = Encoded(parts=[memoryview(body)], size=len(body))
    return seal(enc, _signer(), now=NOW, nonce=i.to_bytes(16, "big")).tobytes()


def _split_frame(data: bytes) -> object:
    """A codec encoding as the tree ``[header, [blob, …]]`` (inverse of ``frame``)."""
    n = struct.unpack_from(">I", data, 5)[0]
    header = msgpack.unpackb(data[9 : 9 + n], raw=False, strict_map_key=False)
    blobs, offset = [], 9 + n
    for length in header[2]:
        offset += -offset % ALIGN
        blobs.append(data[offset : offset + length])
        offset += length
    return [header, blobs]


def frame(tree: object) -> bytes:
    """The codec's framing around ``[header, [blob, …]]`` (or around any header alone)."""
    ok = isinstance(tree, list) and len(tree) == 2 and isinstance(tree[1], list)
    header, blobs = (tree[0], tree[1]) if ok else (tree, [])  # type: ignore[index]
    h = _packb(header)
    out = bytearray(struct.pack(">4sBI", MAGIC, 1, len(h)) + h)
    for b in blobs:
        out += bytes(-len(out) % ALIGN)
        out += b if isinstance(b, (bytes, bytearray)) else _packb(b)
    return bytes(out)


def _packb(tree: object) -> bytes:
    """msgpack of ``tree``; lone surrogates go out as the invalid UTF-8 a hostile peer sends."""
    out: bytes = msgpack.packb(tree, use_bin_type=True, unicode_errors="surrogatepass")
    return out


def _envelope_tree(envelope: bytes) -> object:
    """An envelope as ``[[version, key, timestamp, nonce, digest, size], signature]``."""
    signed, signature = msgpack.unpackb(envelope)
    return [msgpack.unpackb(signed), signature]


def _envelope_build(tree: object) -> bytes:
    """The inverse of ``_envelope_tree``: the signed part packed into its bin (if a list)."""
    if isinstance(tree, list) and len(tree) == 2 and isinstance(tree[0], list):
        return _packb([_packb(tree[0]), tree[1]])
    return _packb(tree)


def _unpack_all(seeds: Sequence[bytes]) -> tuple[object, ...]:
    return tuple(msgpack.unpackb(s, raw=False, strict_map_key=False) for s in seeds)


# ── feeds ────────────────────────────────────────────────────────────────────────────────────
def _decode(data: bytes | memoryview) -> Message:
    return decode(data, max_size=MAX_SIZE)


def _chunks(data: bytes) -> list[bytes]:
    step = 1 + len(data) % 13
    return [data[i : i + step] for i in range(0, len(data), step)]


def _body_reader(data: bytes) -> None:
    reader = BodyReader(MAX_SIZE)
    for chunk in _chunks(data):
        reader.feed(chunk)
    if reader.done:
        _decode(reader.view())


def _sealed_reader(data: bytes) -> None:
    reader = SealedReader(MAX_SIZE)
    for chunk in _chunks(data):
        reader.feed(chunk)
    if reader.done:
        reader.open(now=NOW, replay=ReplayWindow())


def _open_sealed(data: bytes) -> None:
    open_sealed(data, now=NOW, replay=ReplayWindow(), max_size=MAX_SIZE)


def _open_signed_body(data: bytes) -> None:
    """A hostile body from an authenticated peer: sealed validly, so it reaches the decoder."""
    _open_sealed(_sealed(data))


def _decompress(data: bytes) -> None:
    for t in getattr(_decode(data), "tensors", ()):
        decompress(t)
        decompress(t, out=torch.empty(t.shape, dtype=torch.bfloat16))


def _flat(data: bytes) -> None:
    tensors = getattr(_decode(data), "tensors", None)
    if tensors is not None:
        flat = flat_from_tensors(tensors, SHAPES)
        assert flat.numel() == sum(int(torch.Size(s).numel()) for s in SHAPES)
        assert bool(torch.isfinite(flat).all())


def _records(data: bytes) -> None:
    store = RecordStore()
    for rec in getattr(_decode(data), "records", ()):
        # also as if the subkey matched the key that signed it, to reach the signature check
        for r in (rec, replace(rec, subkey=peer_id_from_public_key(rec.public_key))):
            with contextlib.suppress(RemoteProtocolError):
                store.put(r, NOW)


def _member(data: bytes) -> None:
    MemberRecord.decode(data)


def _manifest(data: bytes) -> None:
    m = Manifest.parse(data, max_total=1 << 30)
    assert 0 < m.size <= 1 << 30 and len(m.hashes) % 32 == 0


def _text(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _range(data: bytes) -> None:
    for size in (0, 1, 4096, 1 << 40):
        try:
            span = parse_range(_text(data), size)
        except RangeNotSatisfiable:
            continue
        assert span is None or 0 <= span[0] < span[1] <= size, (span, size)


def _etag(data: bytes) -> None:
    version = etag_version(unquote_etag(_text(data)))
    assert version is None or version >= 0


def _content_range(data: bytes) -> None:
    span = parse_content_range(_text(data))
    assert span is None or all(type(x) is int and x >= 0 for x in span)


def _dialback(data: bytes) -> None:
    text = _text(data)
    for query in ({"port": text}, {"url": text}):
        with contextlib.suppress(DecodeError):
            _, _, port = dialback_target(query)
            assert 0 < port < 65536


@functools.cache
def _swarm() -> tuple[SwarmManifest, Certificate]:
    """A signed manifest with one authority, and the certificate it gave the fixed signer."""
    founder, lab, peer = Signer(b"\x0f" * 32), Signer(b"\x1e" * 32), _signer()
    manifest = SwarmManifest(
        name="fuzz",
        founder=founder.public_key,
        admission="certified",
        created=NOW - 3600,
        recipe=(("inner_steps", 50), ("outer_lr", 0.7)),
    )
    manifest = manifest.with_authority("lab-a", lab.public_key).with_revoked(b"\x05" * 32)
    manifest = manifest.signed(founder)
    cert = Certificate.issue(
        lab,
        manifest=manifest,
        subject=peer.public_key,
        roles=("owner",),
        not_before=NOW - 60,
        not_after=NOW + 3600,
    )
    return manifest, cert


def _manifest_toml(data: bytes) -> None:
    SwarmManifest.from_toml(data).verify()


def _check_cert(cert: Certificate) -> None:
    manifest = _swarm()[0]
    check_certificate(manifest, cert, public_key=cert.subject, role="owner", now=NOW)


def _certificate(data: bytes) -> None:
    _check_cert(Certificate.decode(data))


def _cert_text(data: bytes) -> None:
    for parse in (Certificate.from_header, Certificate.from_text):
        with contextlib.suppress(RemoteProtocolError):
            _check_cert(parse(_text(data)))


def _auth_header(data: bytes) -> None:
    auth = RequestAuth.parse(_text(data))
    assert len(auth.public_key) == 32 and len(auth.signature) == 64, auth
    auth.verify(
        swarm=_swarm()[0].swarm_id,
        method="POST",
        target="/v1/rpc",
        now=NOW,
        recipient=bytes(32),
        unbound_ok=True,
    )


# ── the targets ──────────────────────────────────────────────────────────────────────────────
@functools.cache
def targets() -> tuple[Target, ...]:
    """Every decoder, with valid seeds (built once, on first call)."""
    encoded = _encoded()
    trees = tuple(_split_frame(e) for e in encoded)
    tensor_msgs = (*encoded[:2], encoded[-1])
    sealed = tuple(_sealed(e, i) for i, e in enumerate(encoded))
    envelopes = tuple(s[4 : 4 + struct.unpack_from(">I", s)[0]] for s in sealed)
    members = (
        MemberRecord(
            url="http://10.0.0.1:9",
            roles=("owner",),
            reachable=False,
            manifest="m",
            learning=False,
            step=1,
        ).encode(),
        MemberRecord(url="", roles=(), reachable=True, manifest="", learning=True).encode(),
    )
    manifests = (
        encode_manifest(
            [b"a" * 32, b"b" * 32], etag="v3-abcdef", size=100_000, chunk_size=64 << 10
        ),
    )
    strings = {
        "range": ("bytes=0-99", "bytes=-5", "bytes=10-", " bytes=1-1 ", "bytes=0-1,2-3"),
        "etag": ('"v12-0123abcdef"', "v0-ff", 'W/"v1-a"'),
        "content_range": ("bytes 0-9/100", "bytes 5-5/6"),
        "dialback": ("8080", "http://127.0.0.1:9000", "https://[::1]:443", "http://h"),
    }
    records = (encoded[9], encoded[11])
    manifest, cert = _swarm()
    swarm_toml = (tomli_w.dumps(manifest.to_toml_data()).encode(),)
    certs = (cert.encode(),)
    strings["cert_text"] = (cert.to_header(), cert.to_text())
    strings["auth_header"] = (
        RequestAuth.make(
            _signer(),
            swarm=manifest.swarm_id,
            method="POST",
            target="/v1/rpc",
            now=NOW,
            recipient=bytes(32),
            nonce=b"\x07" * 16,
        ),
    )

    def t(
        name: str,
        feed: Callable[[bytes], object],
        seeds: tuple[bytes, ...],
        tree_list: tuple[object, ...] = (),
        build: Callable[[object], bytes] | None = None,
    ) -> Target:
        return Target(name, feed, seeds, tree_list, build)

    def text(name: str, feed: Callable[[bytes], object]) -> Target:
        return t(name, feed, tuple(s.encode() for s in strings[name.split(".")[1]]))

    return (
        t("codec.decode", _decode, encoded, trees, frame),
        t("codec.body_reader", _body_reader, tuple(struct.pack(">Q", len(e)) + e for e in encoded)),
        t(
            "signing.open_envelope",
            lambda d: open_envelope(d, max_size=MAX_SIZE),
            envelopes,
            tuple(_envelope_tree(e) for e in envelopes),
            _envelope_build,
        ),
        t("signing.open_sealed", _open_sealed, sealed),
        t("signing.sealed_reader", _sealed_reader, sealed),
        t("signing.signed_body", _open_signed_body, encoded, trees, frame),
        t("compression.decompress", _decompress, tensor_msgs, (*trees[:2], trees[-1]), frame),
        t("flat.flat_from_tensors", _flat, tensor_msgs, (*trees[:2], trees[-1]), frame),
        t("records.verify_and_store", _records, records, (trees[9], trees[11]), frame),
        t("membership.member_record", _member, members, _unpack_all(members), _packb),
        t("state.manifest", _manifest, manifests, _unpack_all(manifests), _packb),
        text("state.range", _range),
        text("state.etag", _etag),
        text("state.content_range", _content_range),
        text("bootstrap.dialback", _dialback),
        t("membership.manifest_toml", _manifest_toml, swarm_toml),
        t("membership.certificate", _certificate, certs, _unpack_all(certs), _packb),
        text("membership.cert_text", _cert_text),
        text("membership.auth_header", _auth_header),
    )
