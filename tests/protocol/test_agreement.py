"""Agreement per contribution: work orthogonal to a round's correlated honest work dissents, alone
or as two identical colluders; correlated honest work never does; rounds too small or without a
consensus judge no one; the chunked Gram matrix is the plain one; standing puts random and stale
senders below every honest one over a run of rounds."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.diloco.agreement import AgreementConfig, agreement, gram, judge, medians
from protocol.diloco.standing import Event, Standing

CFG = AgreementConfig()
DIM = 4096


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def _honest(gen: torch.Generator, n: int, cosine: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``n`` vectors whose pairwise cosines are about ``cosine``: a shared direction plus each
    one's own noise, at norms that differ (honest learners' norms do). Returns them and the
    shared direction."""
    shared = _unit(torch.randn(DIM, generator=gen, dtype=torch.float64))
    out = []
    for _ in range(n):
        own = _unit(torch.randn(DIM, generator=gen, dtype=torch.float64))
        scale = 0.5 + float(torch.rand((), generator=gen, dtype=torch.float64))
        out.append((math.sqrt(cosine) * shared + math.sqrt(1 - cosine) * own).float() * scale)
    return out, shared


def _orthogonal(gen: torch.Generator, span: list[torch.Tensor]) -> torch.Tensor:
    """A random vector with every vector of ``span`` projected out (Gram-Schmidt in fp64)."""
    v = torch.randn(DIM, generator=gen, dtype=torch.float64)
    basis: list[torch.Tensor] = []
    for s in span:
        u = s.double()
        for b in basis:
            u = u - (u @ b) * b
        basis.append(_unit(u))
    for b in basis:
        v = v - (v @ b) * b
    return v.float()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_honest=st.integers(3, 8),
    cosine=st.floats(0.25, 0.9),
    colluders=st.integers(1, 2),
)
def test_work_orthogonal_to_a_correlated_honest_cluster_dissents_alone_or_colluding(
    seed: int, n_honest: int, cosine: float, colluders: int
) -> None:
    """One orthogonal sender, or two colluders sending the same orthogonal vector (they agree
    only with each other), among >= 3 correlated honest senders: the attackers dissent, the
    honest senders do not."""
    gen = torch.Generator().manual_seed(seed)
    honest, _ = _honest(gen, n_honest, cosine)
    bad = _orthogonal(gen, honest) * float(honest[0].norm())
    peers = [_key(i) for i in range(n_honest)] + [_key(100 + j) for j in range(colluders)]
    verdict = agreement(peers, honest + [bad.clone() for _ in range(colluders)], CFG)
    assert verdict.dissent == frozenset(_key(100 + j) for j in range(colluders)), verdict.reason


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 9), cosine=st.floats(0.2, 0.95))
def test_correlated_honest_work_never_dissents(seed: int, n: int, cosine: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    honest, _ = _honest(gen, n, cosine)
    verdict = agreement([_key(i) for i in range(n)], honest, CFG)
    assert not verdict.dissent, verdict.reason
    if n < CFG.min_senders:
        assert verdict.level is None and "no one judged" in verdict.reason


def test_two_colluders_among_two_honest_leave_no_consensus_and_judge_no_one() -> None:
    """Half the round colluding: every median is near 0, so the round judges no one (it must not
    blame the honest senders, whose median then is the colluders' 0)."""
    gen = torch.Generator().manual_seed(7)
    honest, _ = _honest(gen, 2, 0.5)
    bad = _orthogonal(gen, honest)
    verdict = agreement([_key(1), _key(2), _key(9), _key(10)], honest + [bad, bad.clone()], CFG)
    assert verdict.dissent == frozenset() and "no consensus" in verdict.reason


def test_a_sender_is_judged_by_its_best_contribution_and_each_other_sender_votes_once() -> None:
    """A sender with two contributions in a round (one carried late) gets one vote in the others'
    medians and is judged by the better of its own two."""
    gen = torch.Generator().manual_seed(3)
    honest, _ = _honest(gen, 4, 0.5)
    noise = _orthogonal(gen, honest)
    peers = [_key(1), _key(2), _key(3), _key(4), _key(4)]
    values = medians(peers, gram(honest + [noise]))
    assert values[4] is not None and abs(values[4]) < 1e-6  # the orthogonal one: 0
    verdict = judge(peers, values, CFG)
    assert verdict.dissent == frozenset()  # key 4's other contribution agrees
    # key 1's median counts key 4 once (the mean of its two cosines), not twice
    votes = sorted(
        [float(torch.nn.functional.cosine_similarity(honest[0], honest[j], dim=0)) for j in (1, 2)]
        + [
            (
                float(torch.nn.functional.cosine_similarity(honest[0], honest[3], dim=0))
                + float(torch.nn.functional.cosine_similarity(honest[0], noise, dim=0))
            )
            / 2
        ]
    )
    assert values[0] == pytest.approx(votes[1], abs=1e-6)


@given(
    n=st.integers(1, 6),
    length=st.integers(1, 300),
    chunk=st.integers(1, 64),
    with_norms=st.booleans(),
)
@settings(max_examples=30, deadline=None)
def test_the_chunked_gram_matrix_is_the_plain_one(
    n: int, length: int, chunk: int, with_norms: bool
) -> None:
    """Within 1e-6 of |a| |b| of the fp64 products (each chunk is summed in fp32): a cosine
    within replay's tolerance; the known norms' squares are the diagonal as given."""
    gen = torch.Generator().manual_seed(n * 1000 + length)
    deltas = [torch.randn(length, generator=gen) for _ in range(n)]
    stacked = torch.stack(deltas).double()
    expected = (stacked @ stacked.T).tolist()
    norms = [float(d.double().norm()) for d in deltas]
    got = gram(deltas, chunk=chunk, norms=norms if with_norms else None)
    for i in range(n):
        if with_norms:
            assert got[i][i] == norms[i] ** 2
        for j in range(n):
            assert got[i][j] == got[j][i]
            assert abs(got[i][j] - expected[i][j]) <= 1e-6 * norms[i] * norms[j] + 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [8192 * 3, 8192 * 40 + 77, 5000])
def test_the_gram_matrix_is_the_per_chunk_dot_products_summed_in_order_to_the_last_bit(
    dtype: torch.dtype, length: int
) -> None:
    """Each pair's products of whole chunks are taken in one call (``np.vecdot``), not one
    ``np.dot`` per chunk: the same bits as ``np.dot`` of every chunk added in fp64 in chunk
    order, a partial last chunk included (``atoll replay`` recomputes agreement from them)."""
    import numpy as np

    from protocol.diloco.agreement import CHUNK

    gen = torch.Generator().manual_seed(length)
    deltas = [torch.randn(length, generator=gen, dtype=dtype) for _ in range(4)]
    arrays = [d.numpy() for d in deltas]
    want = [[0.0] * 4 for _ in range(4)]
    for i in range(4):
        for j in range(i, 4):
            for start in range(0, length, CHUNK):
                end = start + CHUNK
                want[i][j] += float(np.dot(arrays[i][start:end], arrays[j][start:end]))
            want[j][i] = want[i][j]
    assert gram(deltas) == want


def test_the_gram_matrix_of_fp64_and_half_precision_work() -> None:
    """fp64 work is multiplied in fp64; bf16 work is converted to fp32 first; an unknown or
    non-finite norm is computed."""
    gen = torch.Generator().manual_seed(7)
    wide = [torch.randn(20_000, generator=gen, dtype=torch.float64) for _ in range(3)]
    plain = (torch.stack(wide) @ torch.stack(wide).T).tolist()
    for row, want in zip(gram(wide, norms=[None, math.nan, None]), plain, strict=True):
        assert row == pytest.approx(want, rel=1e-12, abs=1e-9)
    half = [w.to(torch.bfloat16) for w in wide]
    exact = torch.stack([h.double() for h in half])
    for row, want in zip(gram(half), (exact @ exact.T).tolist(), strict=True):
        assert row == pytest.approx(want, rel=1e-5, abs=1e-3)
    with pytest.raises(ValueError, match="norms"):
        gram(wide, norms=[1.0])


def test_zero_and_mismatched_contributions() -> None:
    """A zero contribution has cosine 0 with everything; lengths and sizes must match."""
    zero = torch.zeros(8)
    ones = torch.ones(8)
    assert medians([_key(1), _key(2), _key(3)], gram([zero, ones, ones])) == pytest.approx(
        [0.0, 0.5, 0.5]
    )
    with pytest.raises(ValueError, match="one length"):
        gram([torch.ones(3), torch.ones(4)])
    with pytest.raises(ValueError, match="peers"):
        agreement([_key(1)], [ones, ones], CFG)
    with pytest.raises(ValueError, match="min_senders"):
        AgreementConfig(min_senders=2)
    with pytest.raises(ValueError, match="floor"):
        AgreementConfig(ratio=2.0)


@pytest.mark.parametrize("kind", ["random", "stale"])
def test_a_random_or_stale_sender_ends_below_every_honest_one(kind: str) -> None:
    """Thirty rounds of five honest learners whose shared direction moves every round (as
    training moves it) and one attacker: a random direction at an honest norm, or its first
    round's honest work re-sent for ever. The owner records what ``Reputation.published`` does:
    DISSENT for a dissenting sender, MERGED otherwise. Before agreement every one of them earned
    the same merge credit, and the attacker saturated beside the honest learners."""
    gen = torch.Generator().manual_seed(11)
    standing = Standing()
    honest_keys = [_key(i) for i in range(5)]
    attacker = _key(200)
    first: torch.Tensor | None = None
    for version in range(1, 31):
        honest, _ = _honest(gen, 5, 0.35)
        if kind == "random":
            bad = torch.randn(DIM, generator=gen) * float(honest[0].norm()) / math.sqrt(DIM)
        else:
            first = honest[0].clone() if first is None else first
            bad = first
        peers = honest_keys + [attacker]
        verdict = agreement(peers, honest + [bad], CFG)
        for peer in peers:
            event = Event.DISSENT if peer in verdict.dissent else Event.MERGED
            standing.record(peer, event, version=version)
    lowest_honest = min(standing.score(k, version=30) for k in honest_keys)
    assert lowest_honest > 0.5
    assert standing.score(attacker, version=30) < 0 < lowest_honest
    assert standing.score(attacker, version=30) < standing.config.threshold + 0.5
