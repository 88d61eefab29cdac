"""One frozen config for a swarm run, mirrored by the CLI's flags.

Every peer of a local swarm receives the same ``RunConfig`` (as JSON) plus its own index; the
launcher derives nothing else, so a peer started by hand with the same file behaves the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from protocol.diloco.interval import interval
from protocol.diloco.merge_config import LatePolicy

__all__ = [
    "LARGE_MODEL_BYTES",
    "RECIPE_FIELDS",
    "SCHEDULE_FIELDS",
    "SHARDINGS",
    "SWARM_WIDE_FIELDS",
    "StandinSpec",
    "Aggregate",
    "Codec",
    "DownloadCodec",
    "FinalFlush",
    "Growth",
    "LatePolicy",
    "Mode",
    "RunConfig",
    "Sharding",
    "Switch",
    "UpdateCodec",
    "add_run_arguments",
    "config_from_args",
]

# The values a field takes (RunConfig checks them; tests/node/test_config.py checks that they are
# protocol/'s: CODECS, UPDATE_CODECS, GROWTHS, AGGREGATES).
Mode = Literal["decoupled", "sync", "ddp"]
Sharding = Literal["contiguous", "striped"]  # how the train split is dealt (node.workload.corpus)
Growth = Literal["constant", "inverse-lr", "qsr", "sqrt-lr"]  # protocol.diloco.interval
Codec = Literal["none", "bf16", "int8", "int4", "topk2", "sign1"]  # protocol.wire.tensors
DownloadCodec = Literal["none", "bf16"]
UpdateCodec = Literal[
    "none", "bf16", "int8", "int4", "topk2", "sign1"
]  # "none": full versions only
Aggregate = Literal["rda", "normed", "mean"]  # protocol.diloco.aggregates
FinalFlush = Literal[-1, 0, 1]  # -1: auto (``RunConfig.flushes``)
Switch = Literal[0, 1]  # an on/off flag, spelled 0 or 1 on the command line and in JSON

SHARDINGS: tuple[Sharding, ...] = get_args(Sharding)

# The fields every peer of a swarm must share: the model and how it is cut, merged and weighted
# (a signed manifest's recipe holds them, but ``swarm``, which becomes the swarm id).
SWARM_WIDE_FIELDS = (
    "swarm",
    "mode",
    "seed",
    "model",
    "batch_size",
    "fragments",
    "inner_steps",
    "sync_growth",
    "codec",
    "block_size",
    "download_codec",
    "update_codec",
    "full_every",
    "outer_lr",
    "outer_momentum",
    "quorum",
    "quorum_fraction",
    "grace_gamma",
    "grace_tau",
    "grace_cap_s",
    "staleness_bound",
    "late_policy",
    "max_tokens_per_step",
    "aggregate",
    "rda_max_gain",
)
# The inner learning-rate schedule a swarm's learners follow: a manifest's recipe may hold it, and
# ``atoll join`` takes it from there unless its own flags say otherwise. Not swarm-wide: a peer on
# another schedule is still a member (its steps only weigh its contributions), so peers need not
# agree on it (``manifest_hash`` leaves it out).
SCHEDULE_FIELDS = ("steps", "lr", "warmup_steps", "min_lr_ratio")
# A signed manifest's recipe: the swarm-wide fields but the swarm's name, and the schedule (here,
# not in node.dht.membership, so that ``atoll``'s parser reads it without the DHT's imports)
RECIPE_FIELDS = tuple(name for name in SWARM_WIDE_FIELDS if name != "swarm") + SCHEDULE_FIELDS
# A model of at least this many fp32 bytes is large: a peer then sizes its memory by the model's
# (freed tensors go back to the kernel, ``node.diloco.allocator.bound_for_model``; the body pool
# is a share of the model, ``node.wire.bodies.pool_bytes_for_model``; docs/scale.md)
LARGE_MODEL_BYTES = 256 << 20

# Why ``--shard fsdp`` cannot run (``atoll join`` refuses before torchrun starts; a rank built
# some other way refuses in ``node.run.train``)
FSDP_NEEDS_RANKS = "--shard fsdp shards the model over an island's processes: add --nproc 2 or more"
FSDP_CANNOT_VALIDATE = (
    "--shard fsdp cannot check the versions this island owns (validated publication runs the "
    "whole model's forward on rank 0 alone): add --validate-windows 0, or use --shard ddp"
)


def _one_of(names: tuple[str, ...]) -> str:
    """``a, b or c``."""
    return f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """One swarm run's settings; a field's flag is ``--`` plus its name with dashes (``_HELP``).
    Why each default is what it is, with the measurements and commands: docs/configuration.md."""

    # --- swarm -----------------------------------------------------------------------------
    swarm: str = "atoll-local"
    peers: int = 3
    seed: int = 0
    # --- inner training (each island) -------------------------------------------------------
    # the smallest preset: the most rounds a fragment in a given time, which is what closes the
    # gap to frequent syncs at H = 200
    model: str = "tiny"
    corpus: str | None = None  # None: the Python standard library's own .py files
    corpus_max_bytes: int | None = None
    # contiguous: learner m trains on the m-th slice of the corpus by path; striped: every
    # learner's shard spans the whole corpus, as a data-parallel sampler's would
    sharding: Sharding = "contiguous"
    steps: int = 9000  # at H = 200, 45 rounds a fragment: within 1 % of syncing every 30 steps
    batch_size: int = 16
    lr: float = 6e-3  # the inner AdamW peak: lower eval loss than 3e-3 at 4 peers
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine ends at lr * this
    weight_decay: float = 0.1
    threads: int = 1
    device: str = "cpu"
    # "real" (forward, backward, AdamW on the corpus) or "standin=STEP_S[,rms=R]": each inner
    # step waits STEP_S s and moves the parameters by a seeded drift plus noise (no loss measured;
    # node.workload.standin), to run models the CPU cannot train
    compute: str = "real"
    # --- Decoupled DiLoCo --------------------------------------------------------------------
    mode: Mode = "decoupled"  # or "sync" / "ddp": the synchronous comparisons (see _HELP)
    fragments: int = 4
    inner_steps: int = 200  # H: every fragment is due once per H inner steps (see ``steps``)
    # how H follows the inner lr as it decays: constant, inverse-lr (H/ratio), qsr (H/ratio²)
    # or sqrt-lr (H·√ratio)
    sync_growth: Growth = "constant"
    # pseudo-gradient compression; int4 both ways cost under 0.5 % of eval loss against int8
    # up / fp32 down, at about 4x fewer bytes
    codec: Codec = "int4"
    block_size: int = 64
    download_codec: DownloadCodec = "none"  # global fragments handed back by owners
    update_codec: UpdateCodec = "int4"  # versions also published as updates over the previous one
    # with updates: every Nth version goes out full (0: only when an update cannot serve)
    full_every: int = 0
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    # how an owner combines a round's contributions: normed (each scaled to the median norm,
    # then the mean), rda (the paper's, which overshot at 32 peers) or mean
    aggregate: Aggregate = "normed"
    rda_max_gain: float = 0.0  # RDA's step at most this many times the normed mean's (0: unbounded)
    quorum: int = 1
    # K is at least this share of the learners an owner sees: with K = 1 alone most versions are
    # one learner's work. -1 (auto): 0.5, or 1 with outer momentum, where partial merges diverged
    quorum_fraction: float = -1.0
    grace_gamma: float = 0.8
    grace_tau: int = 2
    grace_cap_s: float = 10.0
    staleness_bound: int = 2
    late_policy: LatePolicy = "carry"
    adopt_alpha: float = 0.0
    hold_versions: Switch = 0  # 1: adopt a trained fragment's new version only once it has shipped
    # >0: a fragment trained this many steps ships before taking a newer version
    ship_before_adopt: int = 0
    # 1: after its last step an island sends the work no contribution holds yet (0: up to H steps
    # are dropped); -1 (auto): on with plain averaging, off with outer momentum, where it overshot
    final_flush: FinalFlush = -1
    # 1: adopt a version with the island's unshipped work replayed on top (0: overwrite, which
    # undid the steps trained while a fragment was in flight)
    adopt_rebase: Switch = 1
    max_tokens_per_step: int = 0  # the most tokens a contribution may claim per inner step
    spread_fanout: int = 2  # uploads of each version per holder before it points learners at others
    # an owner's own direct uploads of each version before it points learners at holders (its
    # replica handoff is one more): owners stay off the hot path as swarms grow
    owner_fanout: int = 1
    # a swarm with at most this many learners besides an owner gets each version from the owner
    # directly, within owner_max_uploads (pointing there only adds a transfer to every round)
    owner_serves_all: int = 3
    # validated publication (node.diloco.validation): windows of the pinned validation set an
    # owner checks each candidate version on (0: off), in a random one of validate_every merges
    validate_windows: int = 16
    validate_every: int = 1
    # an owner's uploads of one version to learners, in multiples of its size, past which it
    # points them at holders; a final version is always served (0: no budget)
    owner_max_uploads: float = 3.0
    # --- evaluation and reporting ------------------------------------------------------------
    eval_every: int = 100
    eval_batches: int = 8
    overlap_block: int = 0  # >0: alternate blocks of this many steps detached / in the swarm
    link: str = ""  # emulated link, e.g. "latency=50ms,bandwidth=10mbit,drop=0.01"
    baseline_lr: float = 0.0  # --baseline's data-parallel peak lr (0: the islands' --lr)

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming every field whose value is out of range, with the fix."""
        problems = [*self._choice_problems(), *self._range_problems(), *self._clash_problems()]
        if problems:
            raise ValueError("; ".join(problems))

    def _choice_problems(self) -> list[str]:
        """Fields of a ``Literal`` type holding a value it does not list."""
        problems = []
        for name, choices in _choices().items():
            value = getattr(self, name)
            if value not in choices:
                problems.append(_not_one_of(name, value, choices))
        return problems

    def _range_problems(self) -> list[str]:
        """Numbers out of their range (a swarm's recipe sets some: refused here, not when an
        owner starts)."""
        problems = [
            f"{_flag(name)} must be >= {least}, got {getattr(self, name)}"
            for name, least in _AT_LEAST.items()
            if getattr(self, name) < least
        ]
        if self.full_every < 0:
            problems.append(
                f"--full-every must be >= 0 (0: full versions only when an update cannot serve), "
                f"got {self.full_every}"
            )
        if self.validate_windows == 1 or self.validate_windows < 0 or self.validate_every < 1:
            problems.append(
                f"--validate-windows must be 0 (off) or >= 2 (noise needs two windows) and "
                f"--validate-every >= 1; got {self.validate_windows} and {self.validate_every}"
            )
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            problems.append(f"--outer-lr must be finite and > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            problems.append(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if not (self.rda_max_gain == 0 or 1 <= self.rda_max_gain < math.inf):
            problems.append(
                f"--rda-max-gain must be >= 1 and finite, or 0 (unbounded), got {self.rda_max_gain}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.ship_before_adopt < 0:
            problems.append(
                f"--ship-before-adopt must be >= 0 (0: off), got {self.ship_before_adopt}"
            )
        if not 0.0 <= self.adopt_alpha < 1.0:
            problems.append(f"--adopt-alpha must be in [0, 1), got {self.adopt_alpha}")
        try:
            StandinSpec.parse(self.compute)
        except ValueError as exc:
            problems.append(str(exc))
        return problems + self._share_problems()

    def _share_problems(self) -> list[str]:
        """Shares and fan-outs out of their range."""
        problems = []
        if not (self.baseline_lr >= 0 and self.baseline_lr < 1):
            problems.append(
                f"--baseline-lr must be in [0, 1) (0: the islands' --lr), got {self.baseline_lr}"
            )
        if not (0.0 <= self.quorum_fraction <= 1.0 or self.quorum_fraction == -1):
            problems.append(
                f"--quorum-fraction must be -1 (auto) or between 0 and 1, got {self.quorum_fraction}"
            )
        if not 0 <= self.spread_fanout <= 64:
            problems.append(
                f"--spread-fanout must be 0..64 (0: owners serve every learner), got {self.spread_fanout}"
            )
        if not 1 <= self.owner_fanout <= 64:
            problems.append(f"--owner-fanout must be 1..64, got {self.owner_fanout}")
        if not 0 <= self.owner_serves_all <= 64:
            problems.append(f"--owner-serves-all must be 0..64, got {self.owner_serves_all}")
        elif self.owner_max_uploads != 0 and self.owner_serves_all > self.owner_max_uploads:
            problems.append(
                f"--owner-serves-all ({self.owner_serves_all}) must not exceed --owner-max-uploads "
                f"({self.owner_max_uploads:g}): each learner served is one upload of the version"
            )
        if self.owner_max_uploads != 0 and not self.owner_fanout <= self.owner_max_uploads <= 1024:
            problems.append(
                f"--owner-max-uploads must be 0 (no budget) or between --owner-fanout "
                f"({self.owner_fanout}) and 1024, got {self.owner_max_uploads}"
            )
        return problems

    def _clash_problems(self) -> list[str]:
        """Valid values that do not go together."""
        problems = []
        if self.codec == "topk2" and not 1 <= self.block_size <= 4096:
            problems.append(f"--block-size must be 1..4096 with topk2, got {self.block_size}")
        if self.update_codec in _UPDATE_CODECS and self.download_codec != "none":
            problems.append(
                f"--update-codec {self.update_codec} (the default is int4) sends versions as updates over "
                f"fp32 full versions: with --download-codec {self.download_codec} add --update-codec none"
            )
        if self.adopt_rebase == 1 and self.adopt_alpha:
            problems.append(
                f"--adopt-alpha {self.adopt_alpha} blends the island's parameters into each version, "
                f"and --adopt-rebase 1 (the default) keeps its unshipped work on top: to blend, add "
                f"--adopt-rebase 0"
            )
        return problems

    @property
    def standin(self) -> StandinSpec | None:
        """The stand-in compute ``compute`` asks for (None: real training)."""
        return StandinSpec.parse(self.compute)

    @property
    def flushes(self) -> bool:
        """Whether islands send their unshipped work at the end (``final_flush``, -1 resolved)."""
        return self.final_flush == 1 or (self.final_flush == -1 and self.outer_momentum == 0)

    @property
    def merge_quorum_fraction(self) -> float:
        """The share of the learners a merge waits for (``quorum_fraction``, -1 resolved): 0.5 with
        plain averaging, every learner with outer momentum, whose partial merges diverged."""
        if self.quorum_fraction >= 0:
            return self.quorum_fraction
        return 1.0 if self.outer_momentum > 0 else 0.5

    @property
    def merge_max_claimed_steps(self) -> int:
        """The inner steps a contribution's claim counts for at most (``MergeConfig.max_claimed_steps``):
        2H at the longest H of the run (``--sync-growth``), the most a learner trains between two
        sends of one fragment with one in flight. A claim beyond it only buys weight, which the
        others' median caps; the time bound alone let a 20 s-old version claim 20,001 steps."""
        longest = max(
            self.inner_steps,
            interval(self.inner_steps, max(self.min_lr_ratio, 1e-6), self.sync_growth),
        )
        return 2 * longest

    @property
    def merge_max_work_steps(self) -> int | None:
        """The inner steps of work a contribution counts for at most (``MergeConfig.max_work_steps``):
        2H with outer momentum, where a learner faster than the round's pace shipped ~3.5H steps a
        round and Nesterov's gain on them diverged (docs/benchmarks.md, *A slow learner under outer
        momentum*). 2H, not H: an island ships the work it kept over an adoption at most 2H after
        that work began, so at even speeds contributions cover H to 2H steps (11-20 at H = 10 in
        all 3,804 of a 3,000-step run) and none is scaled. None with plain averaging, whose merge
        is the islands' mean whatever they did."""
        return 2 * self.inner_steps if self.outer_momentum > 0 else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        """Raises ``ValueError`` for text that is not a JSON object of known fields of fitting types."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("not a config: JSON nested too deeply") from None
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object of config fields")
        kinds = _field_types()
        unknown = set(data) - set(kinds)
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(kinds)}")
        wrong = [
            f"{name} = {value!r:.40} should be {_type_name(*kinds[name])}"
            for name, value in data.items()
            if not _fits(value, *kinds[name])
        ]
        if wrong:
            raise ValueError(f"config fields of the wrong type: {'; '.join(wrong)}")
        return cls(**data)

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        """Raises ``OSError`` when ``path`` cannot be read, ``ValueError`` when it holds no config."""
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                "not a text file (a config is JSON, as atoll local writes it)"
            ) from None
        return cls.from_json(text)


# the least value of a count (``--peers must be >= 1``)
_AT_LEAST = {
    "peers": 1,
    "steps": 1,
    "fragments": 1,
    "inner_steps": 1,
    "quorum": 1,
    "max_tokens_per_step": 0,
}
_UPDATE_CODECS = get_args(UpdateCodec)[1:]  # the lossy ones ("none": full versions only)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _not_one_of(name: str, value: object, choices: tuple[object, ...]) -> str:
    """``--mode must be decoupled, sync or ddp, got 'x'``."""
    if name in ("sharding", "aggregate"):
        return f"{_flag(name)} must be one of {', '.join(map(str, choices))}; got {value!r}"
    listed = "-1 (auto), 0 or 1" if name == "final_flush" else _one_of(tuple(map(str, choices)))
    return f"{_flag(name)} must be {listed}, got {value!r}"


@functools.cache
def _field_types() -> dict[str, tuple[type, bool]]:
    """Each field's JSON and command-line type (a ``Literal``'s: its values' type) and whether
    it may be None."""
    types = {}
    for name, hint in get_type_hints(RunConfig).items():
        args = get_args(hint)
        if get_origin(hint) is Literal:
            types[name] = (type(args[0]), False)
        elif type(None) in args:
            types[name] = (next(a for a in args if a is not type(None)), True)
        else:
            types[name] = (hint, False)
    return types


@functools.cache
def _choices() -> dict[str, tuple[object, ...]]:
    """The values each field of a ``Literal`` type may take."""
    return {
        name: get_args(hint)
        for name, hint in get_type_hints(RunConfig).items()
        if get_origin(hint) is Literal
    }


def _type_name(kind: type, optional: bool) -> str:
    return kind.__name__ + (" | None" if optional else "")


def _fits(value: object, kind: type, optional: bool) -> bool:
    """Whether a JSON value fits a field of type ``kind``: an int fits a float field, a bool
    fits none, None only an optional one."""
    if value is None:
        return optional
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


_HELP = {
    "swarm": "swarm name (peers of different swarms refuse each other)",
    "peers": "number of peer processes (islands)",
    "seed": "seed for model init and data order",
    "model": "model preset: tiny, small, base or medium",
    "corpus": "a text file or folder to train on (default: the Python standard library's .py files)",
    "corpus_max_bytes": "read at most this many corpus bytes",
    "sharding": "how the train split is dealt to learners: contiguous (learner m takes the m-th slice of the corpus "
    "sorted by path) or striped (disjoint stripes of <= 64 KiB dealt round robin: every shard spans the "
    "whole corpus, as a data-parallel sampler's would)",
    "steps": "inner steps per island",
    "batch_size": "sequences per inner step per island",
    "lr": "inner AdamW learning rate",
    "warmup_steps": "inner learning-rate warmup steps",
    "min_lr_ratio": "the inner learning rate's cosine ends at lr times this",
    "weight_decay": "inner AdamW weight decay",
    "threads": "torch threads per peer",
    "device": "cpu or cuda",
    "compute": "real (forward, backward and AdamW on the corpus) or standin=STEP_S[,rms=R]: each inner step "
    "waits STEP_S seconds (a device's time) and moves the parameters by a seeded drift shared by all "
    "peers plus per-peer noise, R per element (default 1e-4) times the lr schedule's shape; "
    "no loss is measured (docs/scale.md)",
    "mode": "decoupled (Atoll), sync (synchronous DiLoCo: quorum = all learners, no grace window, every "
    "learner waits for each merged version) or ddp (sync with H = 1), to compare under the same chaos",
    "fragments": "P: number of model fragments synchronised separately",
    "inner_steps": "H: inner steps between two syncs of the same fragment (the least, with --sync-growth)",
    "sync_growth": "how H follows the inner learning rate as it decays: constant, inverse-lr (H / (lr/peak)) or qsr "
    "(H / (lr/peak)^2, the quadratic synchronization rule), at most 100 H; or sqrt-lr "
    "(H * sqrt(lr/peak), shrinking: H is then the most)",
    "final_flush": "1: after the last step every island sends the work of each fragment that no contribution "
    "holds yet, merged into the owners' final versions; 0: that work is dropped; -1 (auto): 1 with "
    "plain averaging, 0 with --outer-momentum above 0 (the last merge would be one more momentum step)",
    "codec": "pseudo-gradient compression: none, bf16, int8, int4, topk2 (sparse: top-k of each "
    "4096-element chunk, 2-bit values, the rest kept in the error-feedback residual) or sign1 "
    "(one sign bit per value and a mean |value| per block, with error feedback)",
    "block_size": "elements per absmax block for int8/int4, per scale for sign1; for topk2, elements per "
    "value sent (density 1/block_size)",
    "download_codec": "compression of global fragments sent back: none or bf16",
    "update_codec": "owners also publish each version as the outer update over the previous version, "
    "compressed with this codec (bf16, int8, int4, topk2 or sign1) with the owner's error feedback; "
    "a learner holding the previous version fetches the update, applies it and checks the "
    "owner-signed hash of the result (bit-identical on every peer), else the full fp32 "
    "version (none: always full versions)",
    "full_every": "with --update-codec: every Nth version is sent full to everyone (0: full versions only "
    "to joiners, learners more than one version behind and after a hash mismatch)",
    "outer_lr": "outer Nesterov learning rate (1.0 with momentum 0 = plain averaging)",
    "outer_momentum": "outer Nesterov momentum",
    "aggregate": "how an owner combines the pseudo-gradients of a round: rda (radial-directional averaging: "
    "the mean direction, at the median norm, so one large contribution cannot steer it), normed (the "
    "mean of the pseudo-gradients each scaled to the median norm: as robust, but the step shrinks "
    "as the mean's does when they disagree) or mean (the token-weighted mean; embedding fragments "
    "always use it)",
    "rda_max_gain": "with --aggregate rda: the step is at most this many times the length of the normed mean "
    "(the pseudo-gradients scaled to the median norm, then averaged); 0: RDA as published, "
    "which keeps the median norm however much the pseudo-gradients disagree",
    "quorum": "K: minimum contributions before a merge may close",
    "quorum_fraction": "K is also at least this share of the learners the owner sees (rounded up; 0: K alone, "
    "the paper's rule; learners that stop are dropped from the count, so they stall nothing; "
    "-1: auto, 0.5 with plain averaging and 1 with --outer-momentum above 0, where merges of "
    "part of the learners diverged)",
    "grace_gamma": "gamma: fraction of hidden time the grace window may spend",
    "grace_tau": "tau: inner steps a fragment may stay in flight",
    "grace_cap_s": "upper bound of the grace window in seconds",
    "staleness_bound": "S: oldest base version (in versions) an owner accepts",
    "late_policy": "late contributions: carry (into the next merge, discounted) or drop (resync)",
    "hold_versions": "1: a fragment trained since its last adoption takes a newer global version only once it "
    "has shipped (every H steps whatever the version rate; pair with a larger "
    "--staleness-bound); 0: adopt each version as it comes",
    "adopt_alpha": "adoption blend: theta <- alpha*theta + (1-alpha)*global (0 = overwrite)",
    "adopt_rebase": "1: adopt a version as global + (theta - theta_ref), keeping the island's work that no "
    "contribution holds yet (theta_ref: the fragment as it shipped, else its base); 0: overwrite",
    "ship_before_adopt": "N > 0: when a newer global version of a fragment arrives and the island trained it "
    "N or more steps since its last adoption without shipping, that work ships first "
    "(one version stale), so an island slower than the swarm still contributes (0: off)",
    "max_tokens_per_step": "the most tokens a learner may claim per inner step; the merge clamps "
    "to it (0: batch size x the model's context length)",
    "spread_fanout": "versions spread peer to peer: an owner (and every learner holding a version) uploads "
    "each version to this many learners and points the others at them, so an owner's "
    "upload per version stays bounded however many learners there are (0: owners "
    "serve every learner themselves)",
    "validate_windows": "validated publication: windows of the pinned validation set an owner evaluates each "
    "candidate version on before publishing it; one that does not lower the loss beyond the "
    "windows' noise has each contribution scored alone, and those that hurt are dropped; "
    "one that raises it is not published (0: off)",
    "validate_every": "validated publication: check a random one in this many merges (1: every merge)",
    "owner_fanout": "with versions spreading: the learners an owner uploads each version to itself before it "
    "points the others at holders (its replica handoff is one more upload)",
    "owner_serves_all": "with versions spreading: a swarm with at most this many learners besides an owner "
    "gets each version from the owner itself, none pointed at holders (each serve counts against "
    "--owner-max-uploads, which it may not exceed; 0: never)",
    "owner_max_uploads": "with versions spreading: the most an owner uploads of one version to learners, for "
    "any reason (direct serves, repeats, fallbacks) and in any form (full, or an update), "
    "in multiples of its full size; past it, learners are pointed at peers likely to hold it, or take a later "
    "version; final versions are always served (0: no budget)",
    "eval_every": "inner steps between held-out evaluations",
    "eval_batches": "held-out batches per evaluation",
    "overlap_block": "measure overlap: alternate blocks of N steps trained alone and in the swarm (0: off)",
    "baseline_lr": "peak learning rate of --baseline's data-parallel run (0: the islands' --lr); its batch is "
    "peers x --batch-size, which usually wants a higher lr: tune it, or the comparison flatters the swarm",
    "link": "emulated link for every peer, e.g. latency=50ms,bandwidth=10mbit,drop=0.01",
}


@dataclass(frozen=True, slots=True)
class StandinSpec:
    """``--compute standin=STEP_S[,rms=R]``: seconds per inner step and RMS change per element."""

    step_s: float
    step_rms: float = 1e-4

    @staticmethod
    def parse(text: str) -> StandinSpec | None:
        """None for ``real``; raises ``ValueError`` (one line, with the fix) for anything else."""
        if text == "real":
            return None
        usage = "--compute must be real or standin=STEP_S[,rms=R] (e.g. standin=0.5)"
        kind, _, rest = text.partition("=")
        if kind != "standin" or not rest:
            raise ValueError(f"{usage}, got {text!r}")
        step, *extra = rest.split(",")
        fields = dict(e.partition("=")[::2] for e in extra)
        if set(fields) - {"rms"} or any("=" not in e for e in extra):
            raise ValueError(f"{usage}: only rms=R may follow STEP_S, got {text!r}")
        try:
            spec = StandinSpec(float(step), float(fields.get("rms", 1e-4)))
        except ValueError:
            raise ValueError(f"{usage}: STEP_S and R are numbers, got {text!r}") from None
        if not (0 <= spec.step_s <= 3600 and 0 < spec.step_rms < 1):
            raise ValueError(f"{usage}: STEP_S in 0..3600 and R in (0, 1), got {text!r}")
        return spec


def add_run_arguments(
    parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = (), **defaults: Any
) -> None:
    """Add one flag per ``RunConfig`` field (``--inner-steps`` for ``inner_steps``), but those in
    ``exclude``."""
    for f in dataclasses.fields(RunConfig):
        if f.name in exclude:
            continue
        default = defaults.get(f.name, f.default)
        flag = _flag(f.name)
        kind, _ = _field_types()[f.name]
        text = _HELP.get(f.name, "")
        if default not in (None, "") and "(default" not in text:
            text += " (default: %(default)s)"
        parser.add_argument(flag, type=kind, default=default, help=text)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    names = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in vars(args).items() if k in names})
