"""Two islands train a Hugging Face ``transformers`` causal LM together, built from a config.

    pip install -e '.[examples]'
    python examples/hf_causal_lm.py [--steps 300] [--eval-every 50]

Nothing is downloaded: the model is ``GPT2LMHeadModel`` built from a small ``GPT2Config``
(2 layers, width 64, a vocabulary of the 256 byte values) with the same seed on both islands,
and the data are the bytes of the Python standard library's own source (``node.workload.corpus``).
The main process starts both islands and meanwhile founds a swarm around the model (a signed
manifest, one lab certifying both islands, as ``atoll swarm ...`` would), then hands each island
its key and certificate; island A starts the swarm, island B joins through A's address.
Each island trains on its own half of the training bytes with AdamW; every H steps each
fragment's pseudo-gradient goes, int8-compressed and signed, to the fragment's owner. Each island
prints its held-out loss before training, every ``--eval-every`` steps, and once more on the
swarm's final global model after leaving the ``with`` block::

    island 0: eval step 0 loss 5.4141
    ...
    island 0: eval final loss 2.4070 versions [18, 15] model b154c466c3efa109

(300 steps; both islands print the same final line). Any other causal LM of ``transformers``
works the same way: build it from its config with the same seed everywhere, list its embedding
tables in ``embeddings=`` and count ``x.numel()`` tokens per step. Tied weights (GPT-2's output
layer is its token embedding) are one parameter in ``named_parameters()``, so one tensor to
the swarm.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from node.api import Network, Swarm, SwarmIsland
from node.config import RunConfig
from node.workload.corpus import BatchSampler, CorpusShard, evaluate, load_corpus, split_corpus
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True, kw_only=True)
class Args:
    steps: int = _f(300, "inner steps per island")
    eval_every: int = _f(50, "held-out evaluation period, in inner steps")
    batch_size: int = _f(16, "windows per inner step")
    block_size: int = _f(64, "bytes per window (also the model's n_positions)")
    lr: float = _f(3e-3, "AdamW learning rate (constant)")
    corpus_bytes: int = _f(4_000_000, "how many bytes of the standard library's source to use")


SWARM = RunConfig(fragments=2, inner_steps=20, codec="int8")  # one embedding fragment, one other
EMBEDDINGS = ("transformer.wte.weight", "transformer.wpe.weight")  # merged by weighted mean
EVAL_BATCHES = 4


def make_model(block_size: int) -> GPT2LMHeadModel:
    # imported here, not at the top: the launcher founds the swarm while the islands start, and
    # importing transformers takes seconds
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # every island starts from the same weights: version 0 of each fragment
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=256,
        n_positions=block_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


class Logits(nn.Module):
    """``model(x, None) -> (logits, None)``, the form ``node.workload.corpus.evaluate`` scores."""

    def __init__(self, lm: GPT2LMHeadModel) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor, _targets: None) -> tuple[torch.Tensor, None]:
        return self.lm(input_ids=x).logits, None  # (B, T, 256)


def model_hash(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def island(shard: int, args: Args, credentials: mp.Queue, addresses: mp.Queue) -> None:
    torch.set_num_threads(1)
    # -------------------------------------------------------------------------------- data
    train, heldout = split_corpus(load_corpus(None, max_bytes=args.corpus_bytes))
    batches = BatchSampler(
        train,
        CorpusShard(shard, 2),
        batch_size=args.batch_size,
        block_size=args.block_size,
        seed=1000 + shard,
    )

    def eval_loss() -> float:
        return evaluate(
            Logits(model),
            heldout,
            batch_size=args.batch_size,
            block_size=args.block_size,
            n_batches=EVAL_BATCHES,
        )

    # -------------------------------------------------------------------------------- model
    model = make_model(args.block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    tokens = batches.tokens_per_batch  # (B * T) bytes per inner step
    print(
        f"island {shard}: eval step 0 loss {eval_loss():.4f}", flush=True
    )  # version 0, as on every island
    swarm: tuple[SwarmManifest, bytes, Certificate] = credentials.get(
        timeout=300
    )  # from the launcher
    manifest, seed, cert = swarm
    initial = [] if shard == 0 else [addresses.get(timeout=120)]
    # -------------------------------------------------------------------------------- training
    with SwarmIsland(
        model,
        opt,
        tokens_per_step=tokens,
        swarm=Swarm(manifest=manifest, key=Signer(seed), cert=cert, embeddings=EMBEDDINGS),
        network=Network(initial_peers=initial),
    ) as isl:
        if shard == 0:
            addresses.put(isl.url)
        isl.wait_for_members(2)  # start together: the final model is the one when both are done
        for step in range(args.steps):
            if step > 0 and step % args.eval_every == 0:
                print(f"island {shard}: eval step {step} loss {eval_loss():.4f}", flush=True)
            x, y = batches.next()  # (B, T) int64 each, y one byte ahead of x
            logits = model(input_ids=x).logits  # (B, T, 256)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            isl.tokens(x.numel())  # before the step: counted into what this step ships
            opt.step()  # the hook adopts arrived fragments and ships due ones
            opt.zero_grad(set_to_none=True)
    # leaving the block adopted the swarm's final global model into ``model``
    print(
        f"island {shard}: eval final loss {eval_loss():.4f} versions {isl.versions} "
        f"model {model_hash(isl.global_state())}",
        flush=True,
    )


def parse_args() -> Args:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in dataclasses.fields(Args):
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(f.default),
            default=f.default,
            help=f"{f.metadata['help']} (default: %(default)s)",
        )
    return Args(**vars(parser.parse_args()))


def main() -> None:
    args = parse_args()
    ctx = mp.get_context("spawn")
    credentials, addresses = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    procs = [
        ctx.Process(target=island, args=(i, args, credentials[i], addresses)) for i in range(2)
    ]
    for p in procs:
        p.start()
    # the founder's and the lab's part (keys in memory here; on disk with atoll keygen / swarm)
    founder, lab = Signer(os.urandom(32)), Signer(os.urandom(32))
    manifest = SwarmIsland.found(
        make_model(args.block_size),
        founder,
        name="hf-causal-lm",
        tokens_per_step=args.batch_size * args.block_size,
        config=SWARM,
        embeddings=EMBEDDINGS,
        authorities=[("example-lab", lab.public_key)],
    )
    seeds = [os.urandom(32) for _ in range(2)]
    certs = [
        Certificate.issue(
            lab,
            manifest=manifest,
            subject=Signer(seed).public_key,
            roles=("learner", "owner"),
            not_before=time.time() - 60,
            not_after=time.time() + 3600,
        )
        for seed in seeds
    ]
    for i in range(2):
        credentials[i].put((manifest, seeds[i], certs[i]))
    for p in procs:
        p.join()
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise SystemExit(
            f"island(s) {failed} failed (exit codes {[procs[i].exitcode for i in failed]})"
        )


if __name__ == "__main__":
    main()
