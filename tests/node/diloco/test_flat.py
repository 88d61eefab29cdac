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
    assert a.dtype == torch.float32 and a.shape == (NUMEL,) and a.is_contiguous() and a.device.type == "cpu"
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
