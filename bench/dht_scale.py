"""The DHT at scale: N nodes on 127.0.0.1 store K keys, lose a fraction, and still find them all.

One process hosts every node: one aiohttp server (``DHTRouter`` mounts node ``i`` at
``/v1/dht/i``), one client session, no link emulation, so the run measures the protocol and the
Python cost of its RPCs (every request and reply is Ed25519-signed and verified). Phases:

``join``   node 0 starts alone; every other node bootstraps from a random node that has already
           joined (ping it, look up its own id), ``--concurrency`` joins at a time;
``store``  key ``i`` (``key_id("bench/i")``) is stored by a random node at the ``k`` nodes
           nearest it; ``replicas`` counts the nodes that hold it;
``kill``   a random ``--kill`` fraction of the nodes stops: its path answers 503 and its tasks end;
``get``    every key is looked up (FIND_VALUE) from a random surviving node; ``found`` is the
           fraction whose record came back intact, ``hops`` the lookups' hop counts
           (``protocol.dht.lookup``: sequential round trips until the value arrived).

Run from the repository root::

    python -m bench.dht_scale --json                       # 500 nodes, 1000 keys, kill 20 %
    python -m bench.dht_scale --json --nodes 100 --keys 100

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from node.dht.kademlia import DHTConfig, DHTNode
from node.dht.route import DHTRouter
from node.wire.transport import Transport
from protocol.ids import key_id
from protocol.wire.signing import Signer

T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    """What to run (mirrored by the command line)."""

    nodes: int = 500
    keys: int = 1000
    kill: float = 0.2  # fraction of the nodes stopped before the get phase
    k: int = 20  # replication factor and bucket size
    alpha: int = 3  # lookup parallelism
    concurrency: int = 32  # joins / stores / gets in flight at once
    ttl_s: float = 3600.0
    seed: int = 0
    phase_timeout_s: float = 1800.0
    json: bool = False


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def bounded(items: Sequence[T], limit: int, fn: Callable[[T], Awaitable[Any]]) -> list[Any]:
    """``fn`` over ``items`` with at most ``limit`` running at once; results in order."""
    sem = asyncio.Semaphore(limit)

    async def one(item: T) -> Any:
        async with sem:
            return await fn(item)

    return await asyncio.gather(*(one(item) for item in items))


def percentile(counts: Counter[int], q: float) -> float:
    """The ``q``-th percentile of a histogram (the median interpolates, others nearest-rank)."""
    values = sorted(counts.elements())
    if not values:
        return float("nan")
    if q == 50:
        return float(statistics.median(values))
    return float(values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))])


# ── phases ──────────────────────────────────────────────────────────────────────────────────


async def join(nodes: list[DHTNode], cfg: Config, rng: random.Random) -> int:
    joined = [nodes[0]]

    async def one(node: DHTNode) -> int:
        entry = rng.choice(joined)
        reached = await node.bootstrap([entry.me.address])
        joined.append(node)
        return reached

    reached = await bounded(nodes[1:], cfg.concurrency, one)
    return sum(1 for r in reached if r == 0)


async def store(
    nodes: list[DHTNode], keys: list[bytes], cfg: Config, rng: random.Random
) -> list[int]:
    publishers = [rng.choice(nodes) for _ in keys]

    async def one(i: int) -> int:
        return await publishers[i].store(keys[i], value_of(i), cfg.ttl_s)

    return await bounded(range(len(keys)), cfg.concurrency, one)


async def get(live: list[DHTNode], keys: list[bytes], cfg: Config, rng: random.Random) -> int:
    readers = [rng.choice(live) for _ in keys]

    async def one(i: int) -> bool:
        records = await readers[i].get(keys[i])
        return any(r.value == value_of(i) for r in records)

    return sum(await bounded(range(len(keys)), cfg.concurrency, one))


def value_of(i: int) -> bytes:
    return f"value {i}".encode()


def rpc_totals(nodes: list[DHTNode]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for node in nodes:
        out.update(node.metrics.rpcs_out)
    return dict(out)


# ── the run ─────────────────────────────────────────────────────────────────────────────────


async def run(cfg: Config) -> dict[str, Any]:
    """Run every phase; the JSON result (see the module docstring)."""
    rng = random.Random(cfg.seed)
    transport = Transport()  # no LinkEmulator profile: loopback as fast as it goes
    router = DHTRouter(transport)
    await transport.start()
    dht_cfg = DHTConfig(k=cfg.k, alpha=cfg.alpha, maintenance_period_s=0, request_timeout_s=20.0,
                        lookup_timeout_s=120.0)  # fmt: skip
    nodes = [DHTNode(Signer(rng.randbytes(32)), transport, router.url(str(i)), dht_cfg)
             for i in range(cfg.nodes)]  # fmt: skip
    for i, node in enumerate(nodes):
        router.mount(node, str(i))
        await node.start()
    keys = [key_id(f"bench/{i}") for i in range(cfg.keys)]
    out: dict[str, Any] = {"config": asdict(cfg)}
    try:
        out.update(await phases(nodes, router, keys, cfg, rng))
    finally:
        for node in nodes:
            await node.close()
        await transport.close()
    return out


async def phases(nodes: list[DHTNode], router: DHTRouter, keys: list[bytes], cfg: Config,
                 rng: random.Random) -> dict[str, Any]:  # fmt: skip
    t0 = time.perf_counter()
    async with asyncio.timeout(cfg.phase_timeout_s):
        failed_joins = await join(nodes, cfg, rng)
    t_join = time.perf_counter()
    contacts = statistics.mean(len(n.routing) for n in nodes)
    say(f"join   {t_join - t0:7.1f} s  {cfg.nodes} nodes, {failed_joins} failed, "
        f"{contacts:.0f} contacts per node")  # fmt: skip
    async with asyncio.timeout(cfg.phase_timeout_s):
        replicas = await store(nodes, keys, cfg, rng)
    t_store = time.perf_counter()
    say(f"store  {t_store - t_join:7.1f} s  {cfg.keys} keys, replicas min {min(replicas)} "
        f"mean {statistics.mean(replicas):.1f}")  # fmt: skip
    killed = rng.sample(range(cfg.nodes), int(cfg.kill * cfg.nodes))
    for i in killed:
        router.unmount(str(i))
        await nodes[i].close()
    dead = set(killed)
    live = [n for i, n in enumerate(nodes) if i not in dead]
    async with asyncio.timeout(cfg.phase_timeout_s):
        found = await get(live, keys, cfg, rng)
    t_get = time.perf_counter()
    hops: Counter[int] = Counter()
    for node in live:
        hops.update(node.metrics.value_hops)
    say(
        f"get    {t_get - t_store:7.1f} s  found {found}/{cfg.keys} after killing {len(killed)}, "
        f"hops median {statistics.median(hops.elements())} histogram {dict(sorted(hops.items()))}"
    )
    return {
        "nodes": cfg.nodes, "keys": cfg.keys, "killed": len(killed),
        "found_fraction": found / cfg.keys,
        "hops_median": percentile(hops, 50), "hops_p90": percentile(hops, 90),
        "hops_histogram": {str(h): n for h, n in sorted(hops.items())},
        "replicas_min": min(replicas), "replicas_mean": statistics.mean(replicas),
        "failed_joins": failed_joins, "contacts_per_node_mean": contacts,
        "wall_s": {"join": t_join - t0, "store": t_store - t_join, "get": t_get - t_store,
                   "total": t_get - t0},
        "rpcs_out": rpc_totals(nodes),
    }  # fmt: skip


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m bench.dht_scale", description=__doc__.split("\n")[0]
    )
    defaults = Config()
    p.add_argument("--nodes", type=int, default=defaults.nodes, help="DHT nodes in the process")
    p.add_argument("--keys", type=int, default=defaults.keys, help="keys stored, then looked up")
    p.add_argument("--kill", type=float, default=defaults.kill, help="fraction of nodes stopped")
    p.add_argument("--k", type=int, default=defaults.k, help="bucket size and replication factor")
    p.add_argument("--alpha", type=int, default=defaults.alpha, help="lookup parallelism")
    p.add_argument("--concurrency", type=int, default=defaults.concurrency,
                   help="joins / stores / gets in flight at once")  # fmt: skip
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--json", action="store_true", help="print one JSON object last on stdout")
    a = p.parse_args(argv)
    return Config(nodes=a.nodes, keys=a.keys, kill=a.kill, k=a.k, alpha=a.alpha,
                  concurrency=a.concurrency, seed=a.seed, json=a.json)  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_args(argv)
    if cfg.nodes < 2 or not 0 <= cfg.kill < 1 or cfg.keys < 1:
        raise SystemExit("need --nodes >= 2, --keys >= 1 and 0 <= --kill < 1")
    result = asyncio.run(run(cfg))
    if cfg.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
