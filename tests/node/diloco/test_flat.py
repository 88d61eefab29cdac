"""node.diloco.flat: fragment vectors from malloc, decoded into and compared by digest. (What
``new_flat`` saves, fresh pages each round, is measured by ``bench.averaging``: see
docs/benchmarks.md, *Fresh pages*.)"""

from __future__ import annotations

import torch

from node.diloco.flat import encode_flat, flat_digest, flat_from_tensors, new_flat

SHAPES = [(300, 70), (1000,)]
NUMEL = 300 * 70 + 1000


def test_new_flat_is_a_writable_fp32_vector_of_its_own() -> None:
    a, b = new_flat(NUMEL), new_flat(NUMEL)
    assert (
        a.dtype == torch.float32
        and a.shape == (NUMEL,)
        and a.is_contiguous()
        and a.device.type == "cpu"
    )
    a.fill_(1.0)
    b.fill_(2.0)
    assert float(a.sum()) == NUMEL and a.data_ptr() != b.data_ptr()
    torch.sub(a, b, out=a)  # torch's kernels take it as any tensor
    assert bool((a == -1.0).all())


def test_decoding_without_out_gives_the_same_bits_in_a_new_flat_vector() -> None:
    flat = torch.randn(NUMEL)
    decoded = flat_from_tensors(encode_flat(flat, SHAPES, "none"), SHAPES)
    assert flat_digest(decoded) == flat_digest(flat) and decoded.data_ptr() != flat.data_ptr()
    int8 = flat_from_tensors(encode_flat(flat, SHAPES, "int8"), SHAPES)
    assert int8.shape == (NUMEL,) and int8.dtype == torch.float32


def test_fp32_tensors_end_to_end_in_a_body_are_found_where_they_lie_and_others_are_not() -> None:
    """``wire_flat_span``: the fp32 tensors of a received message lie end to end (even sizes need
    no padding between blobs), so the flat vector is a span of the body; a padded, compressed or
    mis-shaped message has no such span and is decoded by copy."""
    from node.diloco.flat import wire_flat_span
    from protocol.wire.codec import decode, encode
    from protocol.wire.messages import FragmentState

    def received(
        shapes: list[tuple[int, ...]], codec: str = "none"
    ) -> tuple[bytearray, FragmentState]:
        tensors = encode_flat(
            flat[: sum(int(torch.Size(s).numel()) for s in shapes)], shapes, codec
        )
        msg = FragmentState(
            swarm="s", fragment=0, version=1, tensors=tuple(tensors), content_hash=bytes(32)
        )
        body = bytearray(encode(msg).tobytes())
        opened = decode(memoryview(body), max_size=len(body))
        assert isinstance(opened, FragmentState)
        return body, opened

    flat = torch.randn(64, generator=torch.Generator().manual_seed(0))
    body, msg = received([(2, 3), (4,), (6,)])
    span = wire_flat_span(msg.tensors, [(2, 3), (4,), (6,)])
    assert span is not None and span[0] is body and span[2] == 16
    assert torch.equal(
        torch.frombuffer(body, dtype=torch.float32, count=span[2], offset=span[1]), flat[:16]
    )
    assert wire_flat_span(msg.tensors, [(6,), (4,), (6,)]) is None  # not the plan's shapes
    _, padded = received([(3,), (5,)])  # 12 bytes, then 4 of padding before the next blob
    assert wire_flat_span(padded.tensors, [(3,), (5,)]) is None
    _, int8 = received([(8,)], "int8")
    assert wire_flat_span(int8.tensors, [(8,)]) is None
    assert (
        wire_flat_span(encode_flat(flat[:8], [(8,)], "none"), [(8,)]) is None
    )  # not in a received body
