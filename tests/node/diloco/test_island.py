"""The island's hook: due schedule, hand-off without waiting, adoption with version fencing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

from node.diloco.island import Island, IslandConfig, Outgoing
from protocol.diloco.fragments import plan_fragments


def _island(
    h: int = 4,
    fragments: int = 2,
    alpha: float = 0.0,
    *,
    rebase: bool = False,
    interval: Callable[[int], int] | None = None,
) -> tuple[Island, nn.Module, torch.optim.Optimizer, list[Outgoing]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    plan = plan_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], fragments)
    sent: list[Outgoing] = []
    cfg = IslandConfig(inner_steps=h, adopt_alpha=alpha, rebase=rebase, interval=interval)
    island = Island(model, opt, plan, sent.append, cfg)
    return island, model, opt, sent


def _step(model: nn.Module, opt: torch.optim.Optimizer, island: Island) -> None:
    loss = model(torch.randn(3, 4)).pow(2).sum()
    loss.backward()
    island.tokens(12)
    opt.step()
    opt.zero_grad()


def test_fragments_go_out_staggered_then_h_steps_after_adoption() -> None:
    island, model, opt, sent = _island(h=4, fragments=2)
    for _ in range(3):
        _step(model, opt, island)
    assert [o.fragment for o in sent] == [0, 1]  # offsets 0 and 2: steps 1 and 3
    assert sent[0].base_version == 0 and sent[0].steps == 1 and sent[0].tokens == 12
    assert sent[1].steps == 3 and sent[1].tokens == 36
    # while in flight nothing more goes out, even past H
    for _ in range(5):
        _step(model, opt, island)
    assert len(sent) == 2
    # a new version arrives: adopted at the next step, fragment due again H steps later
    new = torch.zeros_like(island.global_flat[0])
    island.deliver(0, 1, new)
    _step(model, opt, island)
    adopted_at = island.stats.step
    assert island.versions[0] == 1 and island.c_steps[0] == 0
    for _ in range(4):
        _step(model, opt, island)
    assert [o.fragment for o in sent][-1] == 0 and sent[-1].base_version == 1
    assert sent[-1].sender_step == adopted_at + 4
    assert island.stats.stalled_steps == 0


def test_pseudo_gradient_is_global_minus_local() -> None:
    island, model, opt, sent = _island(h=4, fragments=1)
    before = island.global_flat[0].clone()
    _step(model, opt, island)
    local = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    order = [dict(model.named_parameters())[n] for n in island.plan.fragments[0].names]
    local = torch.cat([p.detach().reshape(-1) for p in order])
    assert torch.allclose(sent[0].delta, before - local)


def test_overwrite_adoption_and_version_fencing() -> None:
    island, model, opt, sent = _island(h=2, fragments=1)
    _step(model, opt, island)
    target = torch.full_like(island.global_flat[0], 0.5)
    island.deliver(0, 3, target)
    island.deliver(0, 2, torch.zeros_like(target))  # older than what is in the inbox: ignored
    assert island.adopt_pending() == 1
    assert all(torch.all(p == 0.5) for p in model.parameters())
    island.deliver(0, 1, torch.zeros_like(target))  # older than held: not adopted
    island.adopt_pending()
    assert island.versions[0] == 3 and all(torch.all(p == 0.5) for p in model.parameters())
    state = island.global_state()
    assert set(state) == {n for n, _ in model.named_parameters()}


def test_blend_adoption() -> None:
    island, model, opt, _ = _island(h=2, fragments=1, alpha=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    island.deliver(0, 1, torch.zeros_like(island.global_flat[0]))
    island.adopt_pending()
    assert all(torch.allclose(p, torch.full_like(p, 0.5)) for p in model.parameters())


def test_refusal_frees_the_fragment_after_h_steps() -> None:
    island, model, opt, sent = _island(h=3, fragments=1)
    _step(model, opt, island)
    island.resolved(0, accepted=False)
    _step(model, opt, island)
    _step(model, opt, island)
    assert len(sent) == 1
    _step(model, opt, island)
    assert len(sent) == 2


def test_work_carried_into_the_next_round_holds_the_fragment_until_that_round_s_version() -> None:
    """An owner that carried our contribution into the round on version 1 (it came while the
    round on 0 merged) would refuse work on version 1 as a duplicate: the fragment waits for
    version 2, with the steps trained meanwhile kept (rebase) and shipped on it, also where a
    trained fragment holds its versions until it ships; without a version for that round, it
    gives up waiting 2H steps after the round opened here, as for work in flight."""
    for carried, hold in ((False, False), (True, False), (True, True)):
        island, model, opt, sent = _rebasing(h=3)
        island.cfg = IslandConfig(inner_steps=3, rebase=True, hold_until_shipped=hold)
        _step(model, opt, island)
        assert [o.base_version for o in sent] == [0]
        island.resolved(0, accepted=True, joined=1 if carried else 0)
        island.deliver(0, 1, island.global_flat[0].clone())  # the round on 0, without our work
        for _ in range(4):
            _step(model, opt, island)
        assert island.versions[0] == 1
        if not carried:  # due H steps after the adoption, as always
            assert [o.base_version for o in sent] == [0, 1]
            continue
        assert len(sent) == 1  # due, and held: our work still waits in the round on 1
        island.deliver(0, 2, island.global_flat[0].clone())
        for _ in range(2):  # adopted at the next step; its kept work is due 2H after it began
            _step(model, opt, island)
        assert island.versions[0] == 2 and [o.base_version for o in sent] == [0, 2]
        assert sent[1].steps == sent[1].sender_step - sent[0].sender_step  # every step since
        # no version for the round it joined: given up 2H steps after that round opened here
        island.resolved(0, accepted=True, joined=3)
        for _ in range(4):  # its base, version 3, comes late (a declined round merged again)
            _step(model, opt, island)
        island.deliver(0, 3, island.global_flat[0].clone())
        _step(model, opt, island)
        opened_at = island.stats.step
        while len(sent) == 2:
            _step(model, opt, island)
        assert island.stats.step == opened_at + 6 and sent[-1].base_version == 3


def test_detached_island_neither_ships_nor_adopts() -> None:
    island, model, opt, sent = _island(h=2, fragments=1)
    island.enabled = False
    island.deliver(0, 1, torch.zeros_like(island.global_flat[0]))
    for _ in range(4):
        _step(model, opt, island)
    assert sent == [] and island.versions[0] == 0
    assert len(island.stats.step_times_detached) == 3


def test_plan_must_match_model() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = plan_fragments([("other.weight", (2, 2))], 1)
    with pytest.raises(ValueError, match="lacks"):
        Island(model, opt, plan, lambda o: None, IslandConfig())


def test_a_trained_fragment_keeps_its_new_version_waiting_until_it_ships() -> None:
    """Versions made of other islands' work arrive more often than this island's H steps: adopted
    at once, each overwrites the steps trained since the last adoption and restarts the H count,
    and a slower island rarely ships. With ``hold_until_shipped`` the hook holds it until the
    fragment ships (off by default: see ``IslandConfig``)."""
    island, model, opt, sent = _island(h=4, fragments=1)
    island.cfg = IslandConfig(inner_steps=4, hold_until_shipped=True, rebase=False)
    _step(model, opt, island)  # offset 0: fragment 0 ships at step 1
    island.deliver(0, 1, torch.zeros_like(island.global_flat[0]))
    _step(model, opt, island)  # it was in flight: adopted, H counts from here
    assert island.versions[0] == 1 and len(sent) == 1
    for v in range(2, 5):  # others' versions keep coming, one per step
        island.deliver(0, v, torch.full_like(island.global_flat[0], float(v)))
        _step(model, opt, island)
        assert island.versions[0] == 1  # held: three steps of work are not overwritten
    _step(model, opt, island)  # H = 4 steps after the adoption: it ships, from version 1
    assert len(sent) == 2 and sent[-1].base_version == 1 and sent[-1].steps == 4
    _step(model, opt, island)  # and then takes the newest version that came
    assert island.versions[0] == 4 and all(torch.all(p == 4.0) for p in model.parameters())


def test_overwriting_a_slower_island_never_ships() -> None:
    island, model, opt, sent = _island(h=4, fragments=1)  # overwrite, no holding
    _step(model, opt, island)
    for v in range(1, 12):  # a version every step, as from faster islands
        island.deliver(0, v, torch.zeros_like(island.global_flat[0]))
        _step(model, opt, island)
    assert len(sent) == 1  # the H count restarts at every adoption


def test_a_slower_island_ships_its_work_before_adopting_a_newer_version() -> None:
    """``ship_before_adopt``: versions made of other islands' work arrive every 3 of this island's
    steps (H = 6). Each time, the 3 steps trained since the last adoption ship first, as the
    pseudo-gradient against the base held, and the new version is adopted at once (never held)."""
    island, model, opt, sent = _island(h=6, fragments=1)
    island.cfg = IslandConfig(inner_steps=6, ship_before_adopt=2, rebase=False)
    shipped_from: list[torch.Tensor] = []  # the island's weights when each contribution was cut

    def submit(out: Outgoing) -> None:
        shipped_from.append(island._flatten(0).clone())  # in the fragment's order
        sent.append(out)

    island._submit = submit
    _step(model, opt, island)  # offset 0: ships at step 1
    island.deliver(0, 1, torch.zeros_like(island.global_flat[0]))
    _step(model, opt, island)  # it was in flight: adopted, nothing more sent
    assert island.versions[0] == 1 and len(sent) == 1
    for v in range(2, 6):
        _step(model, opt, island)
        _step(model, opt, island)
        base = island.global_flat[0].clone()
        island.deliver(0, v, torch.full_like(base, float(v)))
        _step(model, opt, island)  # the third step since the adoption: ship, then adopt
        assert len(sent) == v and sent[-1].base_version == v - 1 and sent[-1].steps == 3
        assert sent[-1].tokens == 36 and island.versions[0] == v
        assert torch.equal(
            sent[-1].delta, base - shipped_from[-1]
        )  # the 3 steps' work, against v - 1
        assert not torch.equal(shipped_from[-1], base)
        assert all(torch.all(p == float(v)) for p in model.parameters())  # adopted right away
    assert island.stats.shipped_before_adopting == 4
    island.deliver(0, 6, torch.zeros_like(island.global_flat[0]))
    _step(
        model, opt, island
    )  # only 1 step trained since the last adoption (< 2): adopted, not shipped
    assert len(sent) == 5 and island.versions[0] == 6


def _rebasing(
    h: int, fragments: int = 1
) -> tuple[Island, nn.Module, torch.optim.Optimizer, list[Outgoing]]:
    island, model, opt, sent = _island(h=h, fragments=fragments)
    island.cfg = IslandConfig(inner_steps=h, rebase=True)
    return island, model, opt, sent


def test_rebase_keeps_the_steps_trained_while_a_contribution_is_in_flight() -> None:
    """Shipped at step 1, three more steps trained, then the merged version comes: the island
    holds the new version plus those three steps' work, counted for the next contribution, which
    then carries them (and nothing of what already shipped)."""
    island, model, opt, sent = _rebasing(h=4)
    _step(model, opt, island)  # ships at step 1
    shipped = island._flatten(0).clone()
    for _ in range(3):
        _step(model, opt, island)
    trained = island._flatten(0).clone()
    new = torch.randn_like(island.global_flat[0])
    island.deliver(0, 1, new)
    assert island.adopt_pending() == 1
    assert torch.allclose(island._flatten(0), new + (trained - shipped), atol=1e-6)
    assert island.versions[0] == 1 and island.c_steps[0] == 3 and island.c_tokens[0] == 36
    assert torch.equal(island.global_flat[0], new)
    before_next = island._flatten(0).clone()
    for _ in range(4):  # due H steps after the adoption
        _step(model, opt, island)
    assert (
        len(sent) == 2
        and sent[-1].base_version == 1
        and sent[-1].steps == 7
        and sent[-1].tokens == 84
    )
    assert torch.allclose(sent[-1].delta, new - island._flatten(0), atol=1e-6)
    assert not torch.allclose(before_next, new)  # the kept work was really in the model


def test_rebase_keeps_unshipped_work_when_others_versions_arrive() -> None:
    """Versions from merges this island was not in arrive every step: its work since its base is
    replayed onto each, stays counted, and still ships within 2H steps of when it began."""
    island, model, opt, sent = _rebasing(h=4)
    _step(model, opt, island)  # ships at step 1 (offset 0)
    island.deliver(0, 1, torch.zeros_like(island.global_flat[0]))
    _step(model, opt, island)  # in flight: rebased with one step kept, due at step 6
    assert island.c_steps[0] == 1 and island.next_due[0] == 6
    for v in range(2, 12):
        base = island.global_flat[0].clone()
        local = island._flatten(0).clone()
        new = torch.full_like(base, float(v))
        island.deliver(0, v, new)
        island.adopt_pending()
        assert torch.allclose(island._flatten(0), new + (local - base), atol=1e-6)
        _step(model, opt, island)
        if len(sent) == 2:
            break
    # not starved: shipped 2H steps after the kept work began (step 1), all of it, from the newest base
    assert (
        len(sent) == 2 and island.stats.step == 9 and sent[-1].steps == 8 and sent[-1].tokens == 96
    )
    assert sent[-1].base_version == island.versions[0] == 8


def test_rebase_with_nothing_to_keep_overwrites_bit_for_bit() -> None:
    """Synchronous DiLoCo ships and adopts with no step between: rebasing is then an overwrite."""
    island, model, opt, sent = _rebasing(h=2)
    island.global_flat[0] = (
        torch.randn_like(island.global_flat[0]) * 1e3
    )  # far from θ: Θ − (Θ − θ) ≠ θ
    _step(model, opt, island)  # ships at step 1
    new = torch.randn_like(island.global_flat[0])
    island.deliver(0, 1, new)
    island.adopt_pending()
    assert torch.equal(island._flatten(0), new) and island.c_steps[0] == 0
    island.deliver(0, 2, new * 2)  # nothing trained since: overwrite
    island.adopt_pending()
    assert torch.equal(island._flatten(0), new * 2)


def test_rebase_overwrites_work_that_is_not_finite_and_resyncs_overwrite() -> None:
    island, model, opt, sent = _rebasing(h=4)
    _step(model, opt, island)
    _step(model, opt, island)
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[0] = float("nan")
    new = torch.randn_like(island.global_flat[0])
    island.deliver(0, 1, new)
    island.adopt_pending()
    assert torch.equal(island._flatten(0), new) and island.c_steps[0] == 0
    _step(model, opt, island)
    island.deliver(0, 1, new, force=True)  # a resync: whole, whatever work there is
    island.adopt_pending()
    assert torch.equal(island._flatten(0), new)


def test_rebase_drops_its_reference_when_the_contribution_is_refused() -> None:
    """A refused contribution's work was not taken: the next adoption keeps all of it."""
    island, model, opt, sent = _rebasing(h=4)
    base = island.global_flat[0].clone()
    _step(model, opt, island)  # ships
    island.resolved(0, accepted=False)
    _step(model, opt, island)
    local = island._flatten(0).clone()
    new = torch.randn_like(base)
    island.deliver(0, 1, new)
    island.adopt_pending()
    assert torch.allclose(island._flatten(0), new + (local - base), atol=1e-6)
    assert island.c_steps[0] == 2


def test_rebase_work_kept_from_a_long_flight_is_due_within_2h_of_when_it_began() -> None:
    island, model, opt, sent = _rebasing(h=4)
    _step(model, opt, island)  # ships at step 1
    for _ in range(5):  # 5 > H steps in flight (the give-up is at 2H)
        _step(model, opt, island)
    assert len(sent) == 1
    island.deliver(0, 1, torch.zeros_like(island.global_flat[0]))
    island.adopt_pending()
    assert island.c_steps[0] == 5 and island.next_due[0] == island.stats.step + 3  # 2H after step 1
    for _ in range(3):
        _step(model, opt, island)
    assert len(sent) == 2 and sent[-1].steps == 8 and sent[-1].base_version == 1


def test_flush_ships_the_work_no_contribution_holds_measured_from_the_version_in_flight() -> None:
    island, model, opt, sent = _island(h=4, fragments=2, rebase=True)
    for _ in range(6):  # fragment 0 ships at step 1 and fragment 1 at step 3, both stay in flight
        _step(model, opt, island)
    assert [o.fragment for o in sent] == [0, 1]
    merged = island.global_flat[0] - 0.01  # fragment 0's merged version arrives while flushing
    island.deliver(0, 1, merged)
    flushed = island.flush(timeout_s=0.2)  # fragment 1's version never comes: it stays in flight
    assert flushed == 1 and island.stats.flushed == 1
    last = sent[-1]
    assert last.fragment == 0 and last.base_version == 1
    assert last.last and not any(
        o.last for o in sent[:-1]
    )  # marked: the owner waits for the others'
    assert last.steps == 5 and last.tokens == 60  # the 5 steps trained since fragment 0 shipped
    order = [dict(model.named_parameters())[n] for n in island.plan.fragments[0].names]
    local = torch.cat([p.detach().reshape(-1) for p in order])
    assert torch.allclose(last.delta, merged - local)  # Θ_1 − θ: exactly the work on top of it
    assert island.flush(timeout_s=0.0) == 0  # nothing trained since: nothing more to send


def test_flush_ships_a_fragment_with_nothing_in_flight_before_waiting_for_another() -> None:
    """Seen at the end of a chaos run: an owner's last round waits for every learner's last
    contribution, and a learner's flush waited for another fragment's version, held by such a
    round: three fragments waited on each other until the owners' 3 s wait ran out, and the
    last work merged in two rounds. A fragment with nothing in flight ships at once."""
    island, model, opt, sent = _island(h=4, fragments=2, rebase=True)
    for _ in range(6):  # fragment 0 ships at step 1 and fragment 1 at step 3
        _step(model, opt, island)
    island.deliver(1, 1, island.global_flat[1] - 0.01)  # fragment 1's version is back; 0's is not
    timer = threading.Timer(0.3, lambda: island.deliver(0, 1, island.global_flat[0] - 0.01))
    timer.start()
    try:
        assert island.flush(timeout_s=5.0) == 2
    finally:
        timer.cancel()
    assert [(o.fragment, o.last) for o in sent[2:]] == [
        (1, True),
        (0, True),
    ]  # 1 did not wait for 0
    assert sent[-1].base_version == 1 and sent[-2].base_version == 1


def test_flush_sends_nothing_for_a_fragment_untrained_since_it_was_adopted() -> None:
    island, model, opt, sent = _island(h=2, fragments=1, rebase=True)
    _step(model, opt, island)
    island.deliver(0, 1, island.global_flat[0].clone())
    island.adopt_pending()  # the only contribution came back: no work left outside it
    assert island.c_steps[0] == 0 and island.flush(timeout_s=0.0) == 0 and len(sent) == 1


def test_a_growing_interval_spaces_a_fragments_syncs_as_it_says() -> None:
    island, model, opt, sent = _island(
        h=2, fragments=1, rebase=True, interval=lambda step: 2 if step < 4 else 6
    )
    for _ in range(14):
        _step(model, opt, island)
        if island.in_flight[0] is not None:  # its version comes back at once
            island.deliver(0, island.versions[0] + 1, island.global_flat[0].clone())
    # ships at step 1 (offset 0), due 2 after each adoption until step 4, then 6 after
    assert [o.sender_step for o in sent] == [1, 4, 11]


def test_wait_for_news_wakes_on_a_delivery_or_a_refusal_and_not_on_what_it_already_saw() -> None:
    island, _, _, _ = _island(h=1, fragments=2)
    seen = island.news
    assert island.wait_for_news(seen, 0.05) is False  # nothing happened: it times out
    flat = island.global_flat[0].clone()
    threading.Timer(0.05, lambda: island.deliver(0, 1, flat)).start()
    t0 = time.monotonic()
    assert island.wait_for_news(seen, 10.0) is True
    assert time.monotonic() - t0 < 5.0  # woken by the delivery, not the timeout
    seen = island.news
    island.resolved(1, accepted=False)  # news that came before the wait began is not lost
    assert island.wait_for_news(seen, 10.0) is True
    assert island.wait_for_news(island.news, 0.01) is False
    island.resolved(1, accepted=True)  # an acceptance frees nothing: no news
    assert island.wait_for_news(island.news, 0.01) is False


def _slow_submit(
    sent: list[Outgoing], seconds: float, clock: dict[str, float], queued: dict[str, float]
) -> Callable[[Outgoing], None]:
    def submit(out: Outgoing) -> None:
        time.sleep(seconds)
        for thread, s in queued.items():  # what the scheduler reports each thread waited for a CPU
            clock[thread] += s
        sent.append(out)

    return submit


@pytest.mark.parametrize(
    ("queued", "stalls"),
    [
        ({}, True),
        ({"trainer": 0.3}, False),
        ({"holder": 0.3}, False),
        ({"trainer": 0.1, "holder": 0.1}, True),
    ],
)
def test_a_hand_off_counts_as_a_stall_only_for_the_time_not_spent_waiting_for_a_cpu(
    monkeypatch: pytest.MonkeyPatch, queued: dict[str, float], stalls: bool
) -> None:
    """A hand-off that takes 0.3 s of wall time is a stall; one whose 0.3 s the scheduler says
    the trainer spent runnable, waiting for a CPU on a busy box, is not, nor one that another
    thread of the process (it may hold the GIL the trainer waits for) spent so. Contention that
    explains only part of the wait leaves the rest a stall."""
    me = threading.get_native_id()
    clock = {"trainer": 0.0, "holder": 0.0}
    monkeypatch.setattr(
        "node.diloco.island.thread_run_delays",
        lambda: {me: clock["trainer"], me + 1: clock["holder"]},
    )
    island, model, opt, sent = _island(h=4, fragments=1)
    island._submit = _slow_submit(sent, 0.3, clock, queued)
    _step(model, opt, island)  # fragment 0 is due at step 1
    assert len(sent) == 1
    assert (island.stats.stalled_steps == 1) is stalls


def test_the_run_delays_of_this_process_s_threads_are_read_and_only_grow() -> None:
    from node.diloco.run_delay import thread_run_delays, waited_for_cpu

    me = threading.get_native_id()
    first = thread_run_delays()
    sum(range(200_000))
    again = thread_run_delays()
    assert me in first and me in again
    assert all(0.0 <= first[t] <= again[t] for t in first.keys() & again.keys())
    # a thread that ended between the snapshots, or began after the first, explains nothing
    assert waited_for_cpu({me: 1.0, 7: 5.0}, {me: 1.5, 8: 9.0}, me) == 0.5


def test_a_rebase_in_slices_writes_the_same_bits_and_nothing_when_not_finite() -> None:
    """On the CPU a rebase works in slices (never θ − θ_ref for a whole fragment at once): the
    parameters end as Θ + (θ − θ_ref) computed whole, bit for bit, across slice edges; a
    non-finite value in the last slice leaves every parameter as it was."""
    from node.diloco.adoption import SLICE, Adoption

    g = torch.Generator().manual_seed(3)
    params = [
        nn.Parameter(torch.randn(SLICE + 12345, generator=g)),
        nn.Parameter(torch.randn(7, 3, generator=g)),
    ]
    n = sum(p.numel() for p in params)
    flat, reference = torch.randn(n, generator=g), torch.randn(n, generator=g)
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    adoption = Adoption([params], torch.optim.SGD(params, lr=0.1))
    assert adoption.rebase(0, flat, reference)
    assert torch.equal(
        torch.cat([p.detach().reshape(-1) for p in params]), (theta - reference).add_(flat)
    )
    before = [p.detach().clone() for p in params]
    reference[-1] = float("inf")
    assert not adoption.rebase(0, flat, reference)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
