"""What admission and TLS cost per request, against the same server without them, in one run.

Four servers on 127.0.0.1 answer one small route; a client sends ``--requests`` GETs to each,
``--concurrency`` at a time, over kept-alive connections:

``plain``      no manifest: HTTP, no headers checked (the baseline);
``open``       an open swarm: HTTP, every request signed (``Atoll-Auth`` + certificate) and checked;
``certified``  a certified swarm: HTTPS (TLS 1.3, the peer's Ed25519 key, pinned) and checked;
``refused``    the certified server answering a stranger (no certificate) with 403s.

Requests per second are the best of ``--repeats``; ratios are against ``plain`` from the same
run (these machines are shared and noisy: compare ratios, not absolute numbers). Human-readable
lines go to stderr; the last line of stdout is one JSON object.

    python -m bench.admission [--requests 2000] [--concurrency 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from aiohttp import web

from node.dht.swarm import SwarmCredentials
from node.wire.admission import request_headers
from node.wire.tls import server_context
from node.wire.transport import Transport
from protocol.wire.certificates import Certificate
from protocol.wire.membership import SwarmManifest
from protocol.wire.signing import Signer


def _key() -> Signer:
    return Signer.from_seed(os.urandom(32))


async def _hello(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _server(
    manifest: SwarmManifest | None, who: Signer, cert: Certificate | None
) -> Transport:
    cred = SwarmCredentials(manifest, who, cert) if manifest is not None else None
    t = Transport(
        "127.0.0.1", 0, tls=server_context(who) if cred is not None and cred.certified else None
    )
    if cred is not None:
        cred.install(t)
    t.app.router.add_get("/v1/hello", _hello)
    await t.start()
    return t


async def _client(
    manifest: SwarmManifest | None,
    who: Signer,
    cert: Certificate | None,
    pin: bytes | None,
    server: Transport,
    server_id: bytes,
) -> Transport:
    t = Transport("127.0.0.1", 0)
    t.recipient_of = lambda _url: server_id  # headers name the server: good there only
    if manifest is not None:
        header = cert.to_header() if cert is not None else ""
        t.authenticate = lambda method, url, to: request_headers(
            who,
            header,
            swarm=manifest.swarm_id,
            method=method,
            url=url,
            now=time.time(),
            recipient=to,
        )
    if pin is not None:
        t.pins[server.url] = pin
    await t.start()
    return t


async def _rate(client: Transport, url: str, n: int, concurrency: int, expect: int) -> float:
    async def worker(count: int) -> None:
        for _ in range(count):
            status, buf, _, _ = await client.request("GET", url, timeout_s=30)
            client.pool.give(buf)
            if status != expect:
                raise RuntimeError(f"{url} answered {status}, expected {expect}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    return (n // concurrency * concurrency) / (time.perf_counter() - t0)


async def run(requests: int, concurrency: int, repeats: int) -> dict[str, Any]:
    founder, lab = _key(), _key()
    now = time.time()
    swarms = {}
    for admission in ("open", "certified"):
        unsigned = SwarmManifest(
            name=f"bench-{admission}", founder=founder.public_key, admission=admission, created=now
        )
        swarms[admission] = unsigned.with_authority("lab", lab.public_key).signed(founder)

    def cert(m: SwarmManifest, who: Signer) -> Certificate:
        return Certificate.issue(
            lab,
            manifest=m,
            subject=who.public_key,
            roles=("learner", "owner"),
            not_before=now - 60,
            not_after=now + 3600,
        )

    srv_key, cli_key = _key(), _key()
    setups: dict[str, tuple[SwarmManifest | None, Certificate | None, bool, int]] = {
        "plain": (None, None, False, 200),
        "open": (swarms["open"], cert(swarms["open"], cli_key), False, 200),
        "certified": (swarms["certified"], cert(swarms["certified"], cli_key), True, 200),
        "refused": (swarms["certified"], None, True, 403),
    }
    rates: dict[str, float] = {}
    transports: list[Transport] = []
    try:
        for name, (m, c, pinned, expect) in setups.items():
            server = await _server(m, srv_key, cert(m, srv_key) if m is not None else None)
            pin = cert(m, srv_key).tls_pin if pinned and m is not None else None
            client = await _client(m, cli_key, c, pin, server, srv_key.peer_id)
            transports += [server, client]
            url = server.url + "/v1/hello"
            await _rate(client, url, concurrency, concurrency, expect)  # warm the connections
            rates[name] = max(
                [await _rate(client, url, requests, concurrency, expect) for _ in range(repeats)]
            )
            print(
                f"{name:10} {rates[name]:8.0f} requests/s  ({rates[name] / rates['plain']:.2f}x plain)",
                file=sys.stderr,
            )
    finally:
        for t in transports:
            await t.close()
    return {
        "bench": "admission",
        "requests": requests,
        "concurrency": concurrency,
        "repeats": repeats,
        "requests_per_s": {k: round(v, 1) for k, v in rates.items()},
        "ratio_to_plain": {k: round(v / rates["plain"], 3) for k, v in rates.items()},
        "per_request_overhead_ms": {
            k: round(1000 / v - 1000 / rates["plain"], 3) for k, v in rates.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.requests, args.concurrency, args.repeats))))


if __name__ == "__main__":
    main()
