"""Two islands train one model of your own together: `SwarmIsland` around any nn.Module.

    python examples/custom_model.py [--steps 300]

The main process founds a swarm (a signed manifest around this model) with one lab whose
authority certifies both islands, as a real multi-lab swarm would with ``atoll swarm ...``.
Process A starts it; process B joins through A's address. Each fits its own half of a
synthetic regression problem (y = W x + noise) with AdamW; every H steps each fragment's
pseudo-gradient goes, int8-compressed and signed, to the fragment's owner, which merges and
hands the new global fragment back. Leaving the ``with`` block waits for the swarm's final
global model; both islands end holding it, print its loss on the full problem and its hash.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import time

import torch
from torch import nn

from node.api import Network, Swarm, SwarmIsland
from node.config import RunConfig
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer

DIM = 32


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every island starts from the same weights: version 0 of each fragment
    return nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, DIM))


def problem(shard: int, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(DIM, DIM, generator=g) / DIM**0.5  # the same target for everyone
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(100 + shard))
    return x, x @ w.T + 0.01 * torch.randn(n, DIM, generator=g)


CONFIG = RunConfig(fragments=2, inner_steps=20, codec="int8", outer_lr=1.0, outer_momentum=0.0)


def island(
    shard: int,
    steps: int,
    swarm: tuple[SwarmManifest, bytes, Certificate],
    addresses: mp.Queue,
    results: mp.Queue,
) -> None:
    torch.set_num_threads(1)
    manifest, seed, cert = swarm
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = problem(shard)
    initial = [] if shard == 0 else [addresses.get(timeout=60)]
    with SwarmIsland(
        model,
        opt,
        tokens_per_step=64,
        swarm=Swarm(manifest=manifest, key=Signer(seed), cert=cert),
        network=Network(initial_peers=initial),
    ) as isl:
        if shard == 0:
            addresses.put(isl.url)
        isl.wait_for_members(2)  # start together: the final model is the one when both are done
        for _ in range(steps):
            idx = torch.randint(0, len(x), (64,))
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
            isl.tokens(64)
            opt.step()
            opt.zero_grad()
    # leaving the block adopted the swarm's final global model into ``model``
    x_all = torch.cat([problem(0)[0], problem(1)[0]])
    y_all = torch.cat([problem(0)[1], problem(1)[1]])
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x_all), y_all).item()
    digest = hashlib.sha256()
    for name, tensor in sorted(isl.global_state().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    results.put(
        {"shard": shard, "loss": final, "versions": isl.versions, "hash": digest.hexdigest()[:16]}
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    addresses, results = ctx.Queue(), ctx.Queue()
    with torch.no_grad():
        x, y = problem(0)
        start = nn.functional.mse_loss(make_model()(x), y).item()
    # the founder's and the lab's part (keys in memory here; on disk with atoll keygen / swarm)
    founder, lab = Signer(os.urandom(32)), Signer(os.urandom(32))
    manifest = SwarmIsland.found(
        make_model(),
        founder,
        name="example",
        tokens_per_step=64,
        config=CONFIG,
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
    procs = [
        ctx.Process(
            target=island, args=(i, args.steps, (manifest, seeds[i], certs[i]), addresses, results)
        )
        for i in range(2)
    ]
    for p in procs:
        p.start()
    out = sorted((results.get(timeout=300) for _ in procs), key=lambda r: r["shard"])
    for p in procs:
        p.join(timeout=30)
    print(f"loss at start {start:.4f}")
    for r in out:
        print(
            f"island {r['shard']}: loss {r['loss']:.4f}, global versions {r['versions']}, "
            f"global model {r['hash']}"
        )


if __name__ == "__main__":
    main()
