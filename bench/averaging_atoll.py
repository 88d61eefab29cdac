"""The averaging bench's Atoll side: one peer (``SwarmIsland``) whose model is the bench's tensors.

One full-model cycle: every fragment is made due at once with this peer's pseudo-gradient
(``prepare`` sets θ = Θ − Δ_i, so the island's own snapshot Θ − θ is Δ_i), and the loop steps a
no-op inner optimizer (SGD, lr 0, no gradients: only the island's hook runs) until the island
has adopted a version above the one it held of every fragment. The swarm runs in ``sync`` mode
with quorum N: an owner merges a fragment only once every learner's contribution is in. Since
2026-11-30 sync mode is the paper's synchronous baseline, not elastic: a learner that dies is
waited for until it is back. So the kill test runs the swarm ``elastic`` (``bench_config``):
decoupled mode with every live learner as the quorum (``quorum_fraction`` 1), which waits for all
N as long as all N live, and for the survivors once a death is seen (docs/benchmarks.md, *A peer
killed mid-round*).

The loop is the bench's, not Atoll's: every contribution claims one inner step and one token
(equal merge weights, so the reference merge is known), and a fragment whose send failed or was
refused is made due again after ``RETRY_S`` (in training it would go out at the next H
boundary) with its pseudo-gradient restored. Between steps it sleeps until the island has news
(``Island.wait_for_news``: a version delivered, a contribution refused) or a retry is due: it
polled every 2 ms until 2026-12-04, which cost ~0.04 s of CPU per peer and round, ~5 % of
Atoll's CPU in a 4 × 50M round, that training's loop does not spend.

Codecs (``CODECS``): ``none`` sends fp32 both ways; ``fp16`` bf16 both ways; ``int8`` int8
pseudo-gradients up (blockwise absmax, error feedback on the learner) and each version down as
an int8 update over the previous one (``RunConfig.update_codec``, error feedback on the owner),
which every peer applies to the same base and checks against the owner-signed hash.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Any

import tomli_w
import torch
from torch import nn

from bench.averaging_inputs import Layout, classify, delta, relative_error
from node.api import Network, Swarm, SwarmIsland, Timing
from node.config import RunConfig
from node.diloco.flat import encode_flat, flat_digest, flat_from_tensors
from protocol.diloco.compression import compress, decompress
from protocol.diloco.outer import OuterConfig, merge_update
from protocol.diloco.updates import encode_update
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer

__all__ = ["AtollSide"]

RETRY_S = 0.25
POLL_S = 0.002  # after a step, the longest wait before looking again
SWARM = "bench-averaging"
# the bench's codec -> Atoll's (upload codec, download codec, update codec)
CODECS = {
    "none": ("none", "none", "none"),
    "fp16": ("bf16", "bf16", "none"),
    "int8": ("int8", "none", "int8"),
    "int4": ("int4", "none", "int4"),
}


class _Tensors(nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in tensors])


def bench_config(
    peers: int, layout: Layout, codec: str, *, elastic: bool = False, owner_fanout: int = 1
) -> RunConfig:
    """The run configuration of every Atoll peer of the bench (the manifest's recipe holds it).
    ``elastic``: decoupled mode with every live learner as the quorum (the kill test's), else
    sync mode with quorum N (see the module docstring); ``owner_fanout``: ``RunConfig``'s
    (``bench.averaging --owner-fanout``)."""
    up, down, update = CODECS[codec]
    # elastic: no grace window past the quorum (gamma 0). Its length is gamma * (tau * step time
    # - ...), the time a learner hides behind tau inner steps; the bench's "step" is a whole round
    # with no compute to hide a wait behind, so a round whose quorum a death lowered waited out
    # the 10 s cap for nobody (every survivor's work in)
    mode = (
        {"mode": "decoupled", "quorum_fraction": 1.0, "grace_gamma": 0.0}
        if elastic
        else {"mode": "sync"}
    )
    return RunConfig(
        peers=peers,
        fragments=layout.tensors,
        inner_steps=10**9,
        codec=up,
        download_codec=down,
        update_codec=update,
        outer_lr=1.0,
        outer_momentum=0.0,
        quorum=peers,
        **mode,
        eval_every=10**9,
        adopt_rebase=0,
        owner_fanout=owner_fanout,
    )  # nothing trains between shipping and adopting: overwrite, one copy


def _seed(*parts: object) -> bytes:
    return hashlib.sha256("/".join(map(str, parts)).encode()).digest()


def swarm_credentials(
    *,
    peers: int,
    seed: int,
    layout: Layout,
    codec: str,
    elastic: bool = False,
    owner_fanout: int = 1,
) -> dict[str, Any]:
    """A swarm as ``atoll local`` makes one (a founder's signed manifest with one lab, and a
    learner-and-owner certificate per peer), as JSON-ready text for the peers' specs: the swarm
    as deployed, with admission and certificate checks on every request. Keys are derived from
    ``seed``: the bench's swarms are throw-away and local."""
    founder, lab = Signer(_seed("bench-founder", seed)), Signer(_seed("bench-lab", seed))
    shapes = _Tensors([torch.empty(n, device="meta") for n in layout.sizes()])
    manifest = SwarmIsland.found(
        shapes,
        founder,
        name=SWARM,
        tokens_per_step=1,
        config=bench_config(peers, layout, codec, elastic=elastic, owner_fanout=owner_fanout),
        authorities=[("bench", lab.public_key)],
    )
    now = time.time()
    certs = [
        Certificate.issue(
            lab,
            manifest=manifest,
            subject=Signer(_seed("bench-peer", seed, i)).public_key,
            roles=("learner", "owner"),
            not_before=now - 60,
            not_after=now + 7 * 86400,
        )
        for i in range(peers)
    ]
    return {
        "manifest": tomli_w.dumps(manifest.to_toml_data()),
        "certs": [c.to_text() for c in certs],
    }


class AtollSide:
    """One Atoll peer of the bench (see the module docstring)."""

    def __init__(
        self,
        *,
        index: int,
        peers: int,
        seed: int,
        layout: Layout,
        codec: str,
        initial: list[torch.Tensor],
        initial_peers: list[str],
        credentials: dict[str, Any] | None = None,
        elastic: bool = False,
        owner_fanout: int = 1,
    ) -> None:
        """``credentials``: from ``swarm_credentials`` (a signed swarm); without, a development
        swarm (no manifest, no admission). ``elastic``: see ``bench_config``."""
        self.index, self.peers, self.seed, self.layout = index, peers, seed, layout
        self.codec, self.download_codec, self.update_codec = CODECS[codec]
        self.model = _Tensors(initial)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)
        cfg = bench_config(peers, layout, codec, elastic=elastic, owner_fanout=owner_fanout)
        swarm = (
            Swarm(
                manifest=SwarmManifest.from_toml(credentials["manifest"]),
                key=Signer(_seed("bench-peer", seed, index)),
                cert=Certificate.from_text(credentials["certs"][index]),
                config=cfg,
            )
            if credentials is not None
            else Swarm(name=SWARM, config=cfg)
        )
        self.api = SwarmIsland(
            self.model,
            self.optimizer,
            tokens_per_step=1,
            swarm=swarm,
            network=Network(initial_peers=initial_peers),
            timing=Timing(join_timeout_s=300.0, finish_timeout_s=0.0),
        )
        self.island = self.api.island
        self.block_size = cfg.block_size
        # the owners' merge, as the check recomputes it
        self.outer = OuterConfig(
            lr=1.0, momentum=0.0, aggregate=cfg.aggregate, rda_max_gain=cfg.rda_max_gain
        )
        named = dict(self.model.named_parameters())
        self.params = [[named[n] for n in f.names] for f in self.api.plan.fragments]
        self.tensor_ids = [
            [int(n.split(".")[-1]) for n in f.names] for f in self.api.plan.fragments
        ]
        self.round = -1
        self.target: list[int] = []
        self.base: list[torch.Tensor] = []
        # with updates, the owner's error-feedback residual per fragment as the check replays it
        # (peer 0 checks every round in order; zero before the first update, as the owner's is)
        self.owner_residual: dict[int, torch.Tensor] = {}
        # with a lossy download codec (bf16), the owner's own fp32 state per fragment as the check
        # replays it: the owner merges into that, and publishes it encoded (learners hold the
        # decoded copy, the check's ``base``); the initial model until the first merge
        self.owner_theta: dict[int, torch.Tensor] = {}

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> str:
        self.api.__enter__()
        return self.api.url

    def settle(self) -> list[str]:
        """Wait for every peer to be a member; return each fragment's owner (URL)."""
        self.api.wait_for_members(self.peers, timeout_s=300.0)
        owners = [self.api.node.owner_of(p) for p in range(len(self.params))]
        return [o[1] if o is not None else "" for o in owners]

    def close(self) -> None:
        self.api.close()

    # --- one cycle -------------------------------------------------------------------------------
    def prepare(self, round_: int, *, keep_base: bool) -> None:
        """Set θ_p = Θ_p − Δ_i for every fragment; zero the island's counters (outside the timing).

        With a lossy upload codec, the learner's error-feedback residuals are zeroed in place:
        the next round's compression still adds them (the same work as in training), but each
        contribution is then exactly Q(Δ_i), so the check can recompute it from the seeded
        inputs alone (in training the residual carries over; what it changes is which values
        are sent, not how much work or how many bytes)."""
        self.island.adopt_pending()
        if self.codec != "none":
            net = self.api.node.net
            for residual in net.residuals.values() if net is not None else ():
                residual.zero_()
        self.round = round_
        self.target = [v + 1 for v in self.island.versions]
        self.base = [g.clone() for g in self.island.global_flat] if keep_base else []
        for p in range(len(self.params)):
            self._set_fragment(p)

    def _set_fragment(self, p: int) -> None:
        with torch.no_grad():
            flat, offset = self.island.global_flat[p], 0
            for param, t in zip(self.params[p], self.tensor_ids[p], strict=True):
                n = param.numel()
                d = delta(self.seed, self.layout, self.round, self.index, t)
                torch.sub(flat[offset : offset + n], d, out=param.data)
                offset += n

    def cycle(self, timeout_s: float) -> dict[str, Any]:
        """Ship every fragment and step until each has its next version. Returns counts."""
        island, n = self.island, len(self.params)
        stats0 = self._net_stats()
        sent0 = dict(self.api.node.transport.messages_by_route)
        marked = [time.monotonic()] * n
        for p in range(n):
            island.next_due[p] = island.stats.step + 1
        retries = 0
        deadline = time.monotonic() + timeout_s
        while not self._done():
            if time.monotonic() > deadline:
                return {
                    "ok": False,
                    "error": f"versions {island.versions}, wanted {self.target} "
                    f"within {timeout_s:.0f} s",
                    "retries": retries,
                }
            seen = island.news
            retries += self._mark_retries(marked)
            due = any(
                island.next_due[p] <= island.stats.step + 1 for p in range(n) if not self._has(p)
            )
            if due:
                for p in range(n):  # one step, one token per contribution: equal merge weights
                    island.c_steps[p], island.c_tokens[p] = 0, 1
                self.optimizer.step()  # the hook ships what is due and adopts what arrived
            else:
                island.adopt_pending()
            if not self._done():  # sleep until a version or a refusal comes, or a retry is due
                island.wait_for_news(seen, POLL_S if due else RETRY_S)
        stats = {k: v - stats0[k] for k, v in self._net_stats().items()}
        sent = {  # requests sent and replies written in the round, by route
            route: n - sent0.get(route, 0)
            for route, n in self.api.node.transport.messages_by_route.items()
            if n > sent0.get(route, 0)
        }
        return {
            "ok": True,
            "retries": retries,
            "versions": list(island.versions),
            "messages": sent,
            **stats,
        }

    def _net_stats(self) -> dict[str, int]:
        """Versions this learner received, and of them taken as updates / updates refused."""
        net = self.api.node.net
        if net is None:
            return {
                "versions_received": 0,
                "updates_applied": 0,
                "update_mismatches": 0,
                "versions_replica": 0,
            }
        return {
            "versions_received": net.stats.versions_received,
            "updates_applied": net.stats.updates_applied,
            "update_mismatches": net.stats.update_mismatches,
            "versions_replica": net.stats.versions_replica,
        }

    def _has(self, p: int) -> bool:
        return self.island.versions[p] >= self.target[p]

    def _done(self) -> bool:
        return all(self._has(p) for p in range(len(self.params)))

    def _mark_retries(self, marked: list[float]) -> int:
        island, now, count = self.island, time.monotonic(), 0
        for p in range(len(self.params)):
            idle = island.in_flight[p] is None and island.next_due[p] > island.stats.step + 1
            if not self._has(p) and idle and now - marked[p] >= RETRY_S:
                if island.versions[p] == self.target[p] - 1:
                    self._set_fragment(p)  # a resync may have overwritten θ_p with Θ_p
                island.next_due[p] = island.stats.step + 1
                marked[p], count = now, count + 1
        return count

    # --- checks ----------------------------------------------------------------------------------
    def digests(self) -> list[str]:
        return [flat_digest(g).hex()[:16] for g in self.island.global_flat]

    def check(self, sets: dict[str, list[int]]) -> dict[str, Any]:
        """Each fragment against the merge of each set's pseudo-gradients (``prepare`` with
        ``keep_base``): the relative errors and the set it matches, or "not merged" when no
        version above the base came. One that matches no set is tried against the other subsets
        of the peers in ``sets`` (``_match_subset``: "subset 0,1,3", a merge of exactly those
        peers' whole contributions, or "subset 0,1,2 at 3/4 of a step", as an owner makes when a
        death lowered its round's quorum, signed and logged by it); "neither" is a wrong or
        partial merge."""
        out: list[dict[str, Any]] = []
        peers = sorted({i for members in sets.values() for i in members})
        for p, frag in enumerate(self.api.plan.fragments):
            version = self.island.versions[p]
            if version < self.target[p]:  # no new version came: the peer knows it has none
                out.append({"fragment": p, "matches": "not merged", "version": version})
                continue
            base, held = self.base[p], self.island.global_flat[p]
            refs = {name: self._reference(p, members) for name, members in sets.items()}
            errors = {name: relative_error(held, ref, base) for name, (ref, _, _) in refs.items()}
            matches = classify(errors, self.codec)
            if matches == "neither":
                tried = {tuple(sorted(members)) for members in sets.values()}
                matches = self._match_subset(p, held, base, peers, tried, refs, errors)
            _, residual, theta = refs[matches if matches in refs else "all"]
            if residual is not None:  # the owner's error feedback after this version
                self.owner_residual[p] = residual
            if theta is not None:  # the owner's fp32 state behind the encoded version
                self.owner_theta[p] = theta
            out.append(
                {
                    "fragment": p,
                    "matches": matches,
                    "version": version,
                    "errors": {k: float(f"{v:.3g}") for k, v in errors.items()},
                    "embedding": frag.is_embedding,
                }
            )
            del refs
        return {"fragments": out, "matches": sorted({f["matches"] for f in out})}

    def _match_subset(
        self,
        p: int,
        held: torch.Tensor,
        base: torch.Tensor,
        peers: list[int],
        tried: set[tuple[int, ...]],
        refs: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
        errors: dict[str, float],
    ) -> str:
        """The first subset of ``peers`` (largest first) whose merge ``held`` is: at a whole step
        (two peers or more, not in ``tried``) or at the subset's share of one (a round that
        closed below its share of the learners: the missing contributions as zeros,
        ``Decision.scale``); "neither" when none is. Adds each tried one to ``refs``/``errors``."""
        n = len(peers)
        for k in range(n - 1, 0, -1):
            for subset in itertools.combinations(peers, k):
                for scaled in (False, True):
                    if not scaled and (k < 2 or subset in tried):
                        continue
                    name = (
                        "subset "
                        + ",".join(map(str, subset))
                        + (f" at {k}/{n} of a step" if scaled else "")
                    )
                    refs[name] = self._reference(p, list(subset), scale=k / n if scaled else 1.0)
                    errors[name] = relative_error(held, refs[name][0], base)
                    if classify({name: errors[name]}, self.codec) == name:
                        return name
        return "neither"

    def _reference(
        self,
        p: int,
        members: list[int],
        *,
        scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What the owner's merge of ``members``' contributions gives (equal weights, no clip),
        as the peers hold it; with updates the owner's residual after it, and with a lossy
        download codec the owner's fp32 state after it (else None).

        With a lossy download codec the owner merges into its own fp32 state (``owner_theta``,
        replayed from the previous rounds' references) and publishes that encoded, while the
        learners measure their pseudo-gradients against the decoded copy they hold (``base``):
        a reference that merged into the decoded copy is off by a rounding of the whole state,
        which is several per cent of one round's update.

        Each contribution is Q(Δ_i) (``prepare`` zeroes the learners' residuals). With updates
        the held state is base + D(Q(Θ* − base + e)), e the owner's residual: replayed here from
        the previous rounds' references (``owner_residual``), so the reference is the owner's
        computation up to the order of the merge's sums (a few values that round to the other
        neighbouring int8 code); it is checked within ``tolerance``, which also covers a replay
        that drifted from the owner's residual (see ``bench.averaging_inputs.tolerance``)."""
        base, frag = self.base[p], self.api.plan.fragments[p]
        deltas = []
        for i in members:
            d = torch.cat(
                [delta(self.seed, self.layout, self.round, i, t) for t in self.tensor_ids[p]]
            )
            d = base - (base - d)  # as the island measures it: Θ − θ with θ = Θ − Δ
            enc, _ = compress(d, self.codec, block_size=self.block_size)
            deltas.append(decompress(enc))
        ones = [1.0] * len(deltas)
        start = self.owner_theta.get(p, base) if self.download_codec != "none" else base
        theta = merge_update(
            start, None, deltas, ones, ones, self.outer, embedding=frag.is_embedding, scale=scale
        ).theta
        shapes = [tuple(q.shape) for q in self.params[p]]
        if self.update_codec != "none":
            _, published, residual = encode_update(
                theta,
                base,
                self.owner_residual.get(p),
                shapes,
                self.update_codec,
                block_size=self.block_size,
            )
            return published, residual, None
        if self.download_codec == "none":
            return theta, None, None
        return (
            flat_from_tensors(encode_flat(theta, shapes, self.download_codec), shapes),
            None,
            theta,
        )
