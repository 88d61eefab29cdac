"""Validated publication through a real owner, on the built-in workload's tiny GPT: a contribution
inside every norm bound that would make the model worse is caught and left out of the version,
honest rounds publish, and ``atoll replay`` recomputes every check from the event log."""

from __future__ import annotations

import copy
import email
import hashlib
import random
from pathlib import Path

import pytest
import torch

from node.diloco.eventlog import replay
from node.diloco.owner import FragmentOwner, OwnerClocks, OwnerConfig, OwnerStart
from node.diloco.validation import OwnerValidation, WindowEvaluator, recheck
from node.workload.corpus import split_corpus, validation_slice
from node.workload.model import GPT, GPTConfig
from protocol.diloco.fragments import plan_fragments
from protocol.diloco.merge import MergeConfig
from protocol.diloco.outer import OuterConfig
from protocol.diloco.validation import ValidationConfig, draw_windows, judge
from tests.node.fakes import SWARM, FakeClock, contribution, flat_of, signer

A, B, C, D = (bytes([b]) * 32 for b in (0xA1, 0xB2, 0xC3, 0xD4))
pytestmark = pytest.mark.timeout(300)  # the module fixture trains a tiny GPT on a shared CPU
# Python source that does not change with this project's code (the standard library's email
# package, ~360 KB): the tiny GPT's data, so a refactor of node/ leaves the numbers here alone
CORPUS = b"".join(p.read_bytes() for p in sorted(Path(email.__file__).parent.glob("*.py")))


def _world():  # type: ignore[no-untyped-def]
    gcfg = GPTConfig.preset("tiny")
    model = GPT(gcfg, seed=0)
    train, heldout = split_corpus(CORPUS)
    _train(
        gcfg, model, train, seed=0, steps=80
    )  # past the first steps, where any step lowers the loss
    plan = plan_fragments([(n, tuple(p.shape)) for n, p in model.named_parameters()], 2)
    named = dict(model.named_parameters())
    shapes = [[tuple(named[n].shape) for n in f.names] for f in plan.fragments]
    data, _ = validation_slice(heldout, fraction=1.0)
    held = [flat_of(model, plan, p) for p in range(len(plan.fragments))]
    evaluator = WindowEvaluator(model, plan, lambda: held, data, block_size=gcfg.block_size)
    return gcfg, model, plan, shapes, train, evaluator


def _train(gcfg, local, train, *, seed: int, steps: int, lr: float = 3e-3) -> None:  # type: ignore[no-untyped-def]
    opt = torch.optim.AdamW(local.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    T = gcfg.block_size
    for _ in range(steps):
        starts = torch.randint(0, train.numel() - T - 1, (8,), generator=gen)
        window = train[starts[:, None] + torch.arange(T + 1)].long()
        _, loss = local(window[:, :-1], window[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()


def _honest(gcfg, model, plan, train, seed: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """A learner's pseudo-gradient for fragment 0: theta before minus theta after 20 AdamW steps."""
    local = copy.deepcopy(model)
    _train(gcfg, local, train, seed=seed, steps=20, lr=1e-3)
    return flat_of(model, plan, 0) - flat_of(local, plan, 0)


def _owner(plan, shapes, model, clock, validation, event_log=None, quorum=2):  # type: ignore[no-untyped-def]
    return FragmentOwner(
        OwnerConfig(
            swarm=SWARM,
            fragment=plan.fragments[0],
            shapes=tuple(shapes[0]),
            merge=MergeConfig(quorum=quorum, gamma=0.5, tau=2.0),
            outer=OuterConfig(lr=1.0, momentum=0.0),
            event_log=event_log,
        ),
        OwnerStart(
            theta=flat_of(model, plan, 0),
        ),
        signer=signer(1),
        clocks=OwnerClocks(clock),
        validation=validation,
    )


def _loss(evaluator: WindowEvaluator, theta: torch.Tensor) -> float:
    losses = evaluator.losses(0, theta, range(0, evaluator.pool, max(1, evaluator.pool // 64)))
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def world():  # type: ignore[no-untyped-def]
    gcfg, model, plan, shapes, train, evaluator = _world()
    deltas = [_honest(gcfg, model, plan, train, seed) for seed in (1, 2)]
    return model, plan, shapes, evaluator, deltas


async def _round(owner, shapes, sends) -> None:  # type: ignore[no-untyped-def]
    await owner.set_expected(len(sends))
    for peer, delta in sends:
        await owner.contribute(peer, contribution(delta, shapes[0], owner=owner))


async def test_an_honest_round_is_validated_and_published(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, plan, shapes, evaluator, (d1, d2) = world
    validation = OwnerValidation(evaluator, ValidationConfig(windows=16), rng=random.Random(0))
    owner = _owner(plan, shapes, model, FakeClock(), validation, event_log=tmp_path / "log.jsonl")
    await _round(owner, shapes, [(A, d1), (B, d2)])
    assert owner.version == 1 and owner.counts.checks == 1 and owner.counts.rejected == 0
    assert _loss(evaluator, owner.theta) < _loss(evaluator, flat_of(model, plan, 0))
    result = replay(tmp_path / "log.jsonl")
    assert result.validations == 1 and result.mismatches == []


async def test_validation_catches_what_clipping_let_through(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two colluders' inner-product manipulation (each minus twice its own honest estimate, inside
    the norm clip of 4x the reference) beside one honest learner. Without validation both are
    merged unclipped and the version is worse than the one before; with it the version holds the
    honest work only, and the attackers are counted as hurt."""
    model, plan, shapes, evaluator, (d1, d2) = world
    ipm = -2.0 * d2  # what a colluder trained honestly, turned against the mean
    start = _loss(evaluator, flat_of(model, plan, 0))
    sends = [(A, d1), (C, ipm), (D, ipm)]

    plain = _owner(plan, shapes, model, FakeClock(), None, quorum=3)
    await _round(plain, shapes, sends)
    assert plain.version == 1 and all(plain.penalties[p]["merged"] == 1 for p in (C, D))
    assert plain.penalties[C]["clipped"] == plain.penalties[D]["clipped"] == 0
    assert _loss(evaluator, plain.theta) > start  # clipping alone let a harmful version out

    clock = FakeClock()
    validation = OwnerValidation(evaluator, ValidationConfig(windows=16), rng=random.Random(1))
    owner = _owner(
        plan, shapes, model, clock, validation, event_log=tmp_path / "log.jsonl", quorum=1
    )
    await _round(owner, shapes, sends)
    assert owner.version == 0 and owner.penalties[C]["hurt"] == owner.penalties[D]["hurt"] == 1
    assert owner.penalties[A]["hurt"] == 0 and owner.penalties[A]["helped"] == 1
    assert (
        owner.standing.score(C, version=0) < 0 < owner.standing.score(A, version=0)
    )  # fed to the standing
    clock.advance(5.0)  # the merger retries the rest after retry_s
    await owner.tick()
    assert owner.version == 1 and owner.penalties[A]["merged"] == 1
    assert owner.penalties[C]["merged"] == owner.penalties[D]["merged"] == 0
    alone = _owner(plan, shapes, model, FakeClock(), None, quorum=1)  # A's work alone, unvalidated
    await _round(alone, shapes, [(A, d1)])
    assert torch.equal(
        owner.theta, alone.theta
    )  # the published version excludes the attacker's work
    assert _loss(evaluator, owner.theta) < start
    result = replay(tmp_path / "log.jsonl")
    assert result.validations == 2 and result.mismatches == []


async def test_colluders_who_cancel_the_honest_work_are_dropped(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two honest learners and two colluders sending their sign flips: the candidate barely moves,
    so it does not raise the loss, and when only a hurtful candidate was scored the colluders were
    merged (and credited) for a round that made no progress. A candidate that does not improve
    beyond noise is scored too: both are dropped, and the retry publishes the honest work alone."""
    model, plan, shapes, evaluator, (d1, d2) = world
    start = _loss(evaluator, flat_of(model, plan, 0))
    sends = [(A, d1), (B, d2), (C, -d1), (D, -d2)]

    before = OwnerValidation(evaluator, ValidationConfig(windows=16, rule=1), rng=random.Random(3))
    lax = _owner(plan, shapes, model, FakeClock(), before, quorum=4)
    await _round(lax, shapes, sends)
    assert lax.version == 1 and lax.counts.rejected == 0 and lax.penalties[C]["merged"] == 1
    assert abs(_loss(evaluator, lax.theta) - start) < 0.002 * start  # a version that went nowhere

    clock = FakeClock()
    validation = OwnerValidation(evaluator, ValidationConfig(windows=16), rng=random.Random(3))
    owner = _owner(
        plan, shapes, model, clock, validation, event_log=tmp_path / "log.jsonl", quorum=1
    )
    await _round(owner, shapes, sends)
    assert owner.version == 0 and owner.penalties[C]["hurt"] == owner.penalties[D]["hurt"] == 1
    assert owner.penalties[A]["hurt"] == owner.penalties[B]["hurt"] == 0
    assert (
        max(owner.standing.score(p, version=0) for p in (C, D))
        < 0
        < min(owner.standing.score(p, version=0) for p in (A, B))
    )
    clock.advance(5.0)  # the merger retries the rest after retry_s
    await owner.tick()
    assert owner.version == 1 and owner.penalties[C]["merged"] == owner.penalties[D]["merged"] == 0
    assert _loss(evaluator, owner.theta) < start
    result = replay(tmp_path / "log.jsonl")
    assert result.validations == 2 and result.mismatches == []


def test_a_check_logged_before_flat_candidates_were_scored_replays_as_it_was() -> None:
    """A record without ``rule`` (an owner before it published a flat candidate unscored)
    recomputes to what it logged, while the same record under the new rule would not."""
    before = [2.0 + 0.01 * i for i in range(16)]
    flat = [b + (0.001 if i % 2 else -0.001) for i, b in enumerate(before)]
    old = {"windows": 16, "every": 1, "z": 3.0, "min_rise": 0.002}
    verdict = judge(before, flat, None, ValidationConfig(**old, rule=1))
    record = {
        "kind": "validation",
        "version": 1,
        "seed": 5,
        "pool": 4096,
        "windows": list(draw_windows(4096, 16, 5)),
        "data": "x",
        "config": old,
        "before": before,
        "candidate": flat,
        "alone": None,
        "publish": True,
        "drop": [],
        "helped": [],
        "reason": verdict.reason,
    }
    assert verdict.publish and recheck(record) == []
    assert recheck({**record, "config": {**old, "rule": 2}})  # the new rule would have scored it


async def test_replay_finds_an_edited_check(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, plan, shapes, evaluator, (d1, _) = world
    validation = OwnerValidation(evaluator, ValidationConfig(windows=16), rng=random.Random(2))
    owner = _owner(
        plan, shapes, model, FakeClock(), validation, event_log=tmp_path / "log.jsonl", quorum=1
    )
    await _round(owner, shapes, [(C, -d1)])  # a sign flip alone in its round: nothing published
    assert owner.version == 0 and owner.penalties[C]["hurt"] == 1
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    import json

    records = [json.loads(line) for line in lines]
    check = next(r for r in records if r["kind"] == "validation")
    assert recheck(check) == []
    assert recheck({**check, "seed": check["seed"] + 1})  # other windows than those evaluated
    assert recheck({**check, "drop": []})  # a verdict the losses do not give


def test_a_callable_validation_loss_checks_candidates_too() -> None:
    """``Swarm(validate=...)``'s evaluator (``node.api``): the user's ``validate(model) -> loss``,
    repeated; a deterministic one has no spread, so the floor (``min_rise``) is the noise."""
    from node.diloco.validation import CallableEvaluator
    from tests.node.fakes import tiny_model, tiny_plan

    model = tiny_model()
    plan = tiny_plan(model)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))

    def validate(m: torch.nn.Module) -> float:
        return float(((m(x) - 1.0) ** 2).mean())

    held = [flat_of(model, plan, p) for p in range(len(plan.fragments))]
    evaluator = CallableEvaluator(model, plan, lambda: held, validate)
    validation = OwnerValidation(evaluator, ValidationConfig(windows=4), rng=random.Random(0))
    theta = held[0]
    assert validation.check(0, 1, theta, theta, lambda: {}).verdict.publish  # unchanged: no rise
    worse = validation.check(0, 1, theta, theta * -4.0, lambda: {A: theta * -4.0})
    assert worse is not None and not worse.verdict.publish and worse.verdict.drop == {A}
    assert (
        worse.record["before"] == [worse.record["before"][0]] * 4
    )  # the repeats of a deterministic loss


def test_without_held_fragments_the_others_are_the_islands_trained_weights() -> None:
    from node.diloco.validation import CallableEvaluator
    from tests.node.fakes import tiny_model, tiny_plan

    model = tiny_model()
    plan = tiny_plan(model)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

    def validate(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(m(x).square().mean())

    evaluator = CallableEvaluator(model, plan, None, validate, repeats=2)
    theta = flat_of(model, plan, 0)
    assert evaluator.losses(0, theta, range(2)) == [validate(model)] * 2
    with torch.no_grad():  # the island trains fragment 1 on: the next check sees it
        for name in plan.fragments[1].names:
            dict(model.named_parameters())[name].add_(0.5)
    assert evaluator.losses(0, theta, range(2)) == [validate(model)] * 2


# --- the validation set the swarm's manifest pins (format 2) ----------------------------------
def _pinned_manifest(pin: str):  # type: ignore[no-untyped-def]
    """A founder's format-2 manifest pinning ``pin``, as a peer reads it from its TOML."""
    import tomli_w

    from protocol.wire.membership import SwarmManifest

    founder = signer(9)
    m = SwarmManifest(
        name="pinned",
        founder=founder.public_key,
        recipe=(("fragments", 2),),
        format=2,
        validation_sha256=pin,
    ).signed(founder)
    back = SwarmManifest.from_toml(tomli_w.dumps(m.to_toml_data()))
    back.verify(expected_id=m.swarm_id)
    return back


async def test_a_peer_whose_validation_set_is_the_pinned_one_validates(world) -> None:  # type: ignore[no-untyped-def]
    from node.diloco.validation import window_evaluator

    model, plan, shapes, evaluator, (d1, d2) = world
    data = evaluator.data
    manifest = _pinned_manifest(evaluator.digest)
    pinned = window_evaluator(
        model,
        plan,
        None,
        data,
        block_size=evaluator.block_size,
        windows=16,
        pinned=manifest.validation_sha256,
    )
    assert pinned is not None and pinned.digest == manifest.validation_sha256
    validation = OwnerValidation(pinned, ValidationConfig(windows=16), rng=random.Random(0))
    owner = _owner(plan, shapes, model, FakeClock(), validation)
    await _round(owner, shapes, [(A, d1), (B, d2)])
    assert owner.version == 1 and owner.counts.checks == 1


def test_a_peer_whose_validation_set_is_not_the_pinned_one_refuses_to_start(world, caplog) -> None:  # type: ignore[no-untyped-def]
    from node.diloco.validation import ValidationSetMismatch, window_evaluator

    model, plan, _, evaluator, _ = world
    other = evaluator.data[: evaluator.data.numel() // 2].clone()  # e.g. a smaller corpus
    theirs = hashlib.sha256(other.numpy().tobytes()).hexdigest()
    manifest = _pinned_manifest(evaluator.digest)
    with pytest.raises(ValidationSetMismatch) as caught:
        window_evaluator(
            model,
            plan,
            None,
            other,
            block_size=evaluator.block_size,
            windows=16,
            pinned=manifest.validation_sha256,
        )
    message = str(caught.value)
    assert theirs in message and evaluator.digest in message  # both hashes
    assert "--corpus" in message and "--validate-windows 0" in message  # what to do
    # opting out is explicit, and said: the owned fragments are then published unchecked
    with caplog.at_level("WARNING", logger="atoll.validation"):
        assert (
            window_evaluator(
                model,
                plan,
                None,
                other,
                block_size=evaluator.block_size,
                windows=0,
                pinned=manifest.validation_sha256,
            )
            is None
        )
    assert "published unchecked" in caplog.text
