"""The island's device path (``--device cuda``), run on the CPU.

The code that runs on a GPU is device-generic: the same functions run here with a *staged* CPU
link (host buffers, ``non_blocking`` copies, pinned when torch has CUDA), and must give results
bit-identical to the plain CPU path, which is the code as it was before the device path. What
only a GPU can show (streams, pinned memory, speed) is ``python -m bench.gpu_check`` (docs/gpu.md).
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from torch import nn

from node.diloco.device import DeviceLink, Landed, pinning_available
from node.diloco.island import Island, IslandConfig, Outgoing
from node.diloco.learner import IslandNet, LearnerNetConfig, OwnerLinks, Reach
from protocol.diloco.compression import compress
from protocol.diloco.device_codec import ON_DEVICE, encode_on_device
from protocol.diloco.fragments import plan_fragments
from protocol.errors import LocalProtocolError
from tests.node.fakes import (
    SWARM,
    FakeClock,
    MemoryOwnerPeer,
    MemoryTransport,
    flat_of,
    make_owner,
    shapes_of,
    signer,
)

CPU = torch.device("cpu")


# --- the codec: encode_on_device gives compress's bytes -----------------------------------------
@pytest.mark.parametrize("codec", ON_DEVICE)
@pytest.mark.parametrize("n", [1, 63, 64, 1001])
def test_encode_on_device_matches_compress_bytes_and_residual(codec: str, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g) * 0.01
    residual = torch.randn(n, generator=g) * 1e-4
    for r in (None, residual):
        want, want_res = compress(t, codec, block_size=16, residual=r)
        got = encode_on_device(t, codec, block_size=16, residual=r)
        assert bytes(want.data) == got.data.contiguous().view(torch.uint8).numpy().tobytes()
        assert bytes(want.scales) == got.scales.contiguous().view(torch.uint8).numpy().tobytes()
        assert torch.equal(want_res.expand(t.shape), got.residual.expand(t.shape))
        assert bool(got.finite)


def test_encode_on_device_saturates_bf16_as_compress_and_flags_nan() -> None:
    big = torch.tensor([3.0e38, -3.0e38, 1.0])  # beyond bf16's range: saturates, error kept
    want, want_res = compress(big, "bf16")
    got = encode_on_device(big, "bf16")
    assert bytes(want.data) == got.data.view(torch.uint8).numpy().tobytes()
    assert torch.equal(want_res, got.residual)
    assert not bool(encode_on_device(torch.tensor([1.0, float("nan")]), "int8").finite)
    with pytest.raises(LocalProtocolError, match="not encoded on a device"):
        encode_on_device(big, "topk2")


# --- the link: identity on the CPU, staged copies when asked -------------------------------------
def test_cpu_link_is_the_identity() -> None:
    link = DeviceLink(CPU)
    t = torch.arange(5.0)
    assert not link.staged and link.record() is None
    assert link.to_host([t], "k")[0] is t
    landed = link.to_device(t, "k")
    assert landed.host is t and landed.device is None and link.arrive(landed) is t


def test_staged_cpu_link_copies_through_reused_host_buffers() -> None:
    link = DeviceLink(CPU, staged=True)
    assert link.pinned == pinning_available()  # no CUDA here: plain host memory, same code
    a, b = torch.randn(10), torch.arange(7, dtype=torch.int8)
    host = link.to_host([a, b], "out")
    assert torch.equal(host[0], a) and torch.equal(host[1], b)
    assert host[0].data_ptr() != a.data_ptr()
    # busy: the next copy for the key gets a fresh buffer; released: the same one again
    again = link.to_host([a], "out")
    assert again[0].data_ptr() != host[0].data_ptr()
    link.release("out")
    reused = link.to_host([a * 2], "out")
    assert reused[0].data_ptr() == host[0].data_ptr() and torch.equal(reused[0], a * 2)
    landed = link.to_device(a, ("in", 0))
    assert landed.device is not None and landed.device.data_ptr() != a.data_ptr()
    assert torch.equal(link.arrive(landed), a)


def test_unstaged_link_to_a_device_is_refused() -> None:
    with pytest.raises(ValueError, match="must be staged"):
        DeviceLink(torch.device("meta"), staged=False)


# --- the island: staged and plain give the same bits ---------------------------------------------
def _island(
    *, staged: bool, rebase: bool
) -> tuple[Island, nn.Module, torch.optim.Optimizer, list[Outgoing]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    plan = plan_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], 2)
    sent: list[Outgoing] = []
    link = DeviceLink(CPU, staged=True) if staged else None
    island = Island(
        model, opt, plan, sent.append, IslandConfig(inner_steps=3, rebase=rebase), device_link=link
    )
    return island, model, opt, sent


def _drive(
    island: Island, model: nn.Module, opt: torch.optim.Optimizer, sent: list[Outgoing]
) -> list[torch.Tensor]:
    """Train 12 steps on seeded batches; every shipped fragment comes back as a version (its
    base minus half its Δ) two steps later. Returns every Δ and the final parameters."""
    g = torch.Generator().manual_seed(1)
    rng = random.Random(2)
    seen: list[torch.Tensor] = []
    pending: list[tuple[int, int, torch.Tensor]] = []
    for step in range(12):
        model(torch.randn(5, 6, generator=g)).pow(2).sum().backward()
        island.tokens(30)
        opt.step()
        opt.zero_grad()
        while len(seen) < len(sent):
            out = sent[len(seen)]
            seen.append(out.delta.clone())
            base = island.global_flat[out.fragment]
            pending.append((step + 2, out.fragment, base - 0.5 * out.delta))
        for _due, p, flat in [x for x in pending if x[0] == step]:
            island.deliver(p, island.versions[p] + 1, flat + rng.random() * 1e-3)
    assert island.stats.adopted >= 3 and len(seen) >= 4  # both paths ran, more than once
    return seen + [t.detach().clone() for t in model.parameters()]


@pytest.mark.parametrize("rebase", [True, False])
def test_staged_island_gives_the_plain_islands_bits(rebase: bool) -> None:
    plain = _drive(*_island(staged=False, rebase=rebase))
    staged = _drive(*_island(staged=True, rebase=rebase))
    assert len(plain) == len(staged) > 4
    assert all(torch.equal(a, b) for a, b in zip(plain, staged, strict=True))


def test_plain_island_matches_the_formulas() -> None:
    """The CPU path computes what it computed before the device path: Δ = Θ − θ exactly, and a
    rebase writes Θ + (θ − θ_ref) exactly."""
    island, model, opt, sent = _island(staged=False, rebase=True)
    model(torch.randn(5, 6)).pow(2).sum().backward()
    opt.step()
    theta = flat_of(model, island.plan, 0)
    assert sent and torch.equal(sent[0].delta, island.global_flat[0] - theta)
    model(torch.randn(5, 6)).pow(2).sum().backward()
    opt.step()  # one more step after shipping: work the rebase keeps
    kept = flat_of(model, island.plan, 0) - theta
    new = torch.randn_like(theta)
    island.deliver(0, 1, new)
    island.adopt_pending()
    assert torch.equal(flat_of(model, island.plan, 0), kept + new)


def test_a_replaced_host_global_is_copied_to_the_device_again() -> None:
    """A resumed checkpoint writes ``global_flat`` from outside: Δ is then measured from it."""
    island, model, _opt, _sent = _island(staged=True, rebase=False)
    island.global_flat[0] = island.global_flat[0] + 1.0
    theta = flat_of(model, island.plan, 0)
    assert torch.equal(island._pseudo_gradient(0), island.global_flat[0] - theta)


# --- the sender: contributions encoded through the staged link, the same bytes -------------------
class _Sender:
    def __init__(self, codec: str, *, staged: bool) -> None:
        island, model, _opt, _sent = _island(staged=staged, rebase=True)
        self.island, self.plan = island, island.plan
        self.shapes = shapes_of(model, self.plan)
        clock, owner_key = FakeClock(), signer(1)
        owners = {
            p: make_owner(
                self.plan,
                self.shapes,
                p,
                flat_of(model, self.plan, p),
                clock,
                who=owner_key,
                quorum=1,
            )
            for p in range(len(self.plan.fragments))
        }
        transport = MemoryTransport()
        transport.add(
            "http://owner.test", MemoryOwnerPeer(owner_key, owners, members={signer(7).peer_id})
        )
        self.owners = owners
        self.net = IslandNet(
            island,
            LearnerNetConfig(swarm=SWARM, shapes=self.shapes, codec=codec, block_size=16),
            OwnerLinks(
                signer(7),
                Reach(transport, owner_of=lambda p: (owner_key.peer_id, "http://owner.test")),
            ),
        )

    def outgoing(self, delta: torch.Tensor) -> Outgoing:
        return Outgoing(
            fragment=0, base_version=0, tokens=9, steps=3, step_time=0.0, sender_step=3, delta=delta
        )


@pytest.mark.parametrize("codec", [*ON_DEVICE, "topk2"])
def test_staged_contributions_carry_the_plain_bytes_and_residuals(codec: str) -> None:
    plain, staged = _Sender(codec, staged=False), _Sender(codec, staged=True)
    n = plain.island.global_flat[0].numel()
    g = torch.Generator().manual_seed(3)
    for _ in range(2):  # the second contribution carries the first one's error feedback
        delta = torch.randn(n, generator=g) * 0.02
        got = []
        for s in (plain, staged):
            msg, residuals = s.net.sender._compress(s.outgoing(delta.clone()), ("out", 0))
            s.island.device_link.release(("out", 0))
            s.net.sender.residuals.update(residuals)
            got.append((msg, residuals))
        (a, ra), (b, rb) = got
        assert [bytes(t.data) for t in a.tensors] == [bytes(t.data) for t in b.tensors]
        assert [bytes(t.scales) for t in a.tensors] == [bytes(t.scales) for t in b.tensors]
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)


def test_staged_nonfinite_pseudo_gradient_is_refused_locally() -> None:
    s = _Sender("int8", staged=True)
    delta = torch.zeros(s.island.global_flat[0].numel())
    delta[3] = float("nan")
    with pytest.raises(LocalProtocolError, match="NaN or Inf"):
        s.net.sender._compress(s.outgoing(delta), ("out", 0))


async def test_staged_contribution_is_merged_and_its_version_adopted() -> None:
    s = _Sender("int8", staged=True)
    await s.owners[0].set_expected(1)
    n = s.island.global_flat[0].numel()
    s.island.in_flight[0] = 0
    await s.net.sender.send(s.outgoing(torch.linspace(-0.1, 0.1, n)))
    assert s.net.stats.contributions_accepted == 1 and s.owners[0].version == 1
    got = await s.net.fetch(0, after=0, wait_s=0.0)
    assert got is not None
    s.island.deliver(0, *got)
    s.island.adopt_pending()
    assert s.island.versions[0] == 1 and torch.equal(s.island.global_flat[0], got[1])
    assert torch.equal(s.island._base(0), got[1])  # the device copy (here: staged on the CPU)
    assert isinstance(Landed(got[1]), tuple)


# --- asking for CUDA where there is none ---------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_stops_before_training_with_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "node", "local", "--peers", "2", "--device", "cuda", "--steps", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "atoll local: --device cuda: torch sees no CUDA device here; use --device cpu"
    )
