"""``atoll join``, ``atoll bootstrap`` and ``atoll status``: a peer's identity and swarm, checked first.

Every command that speaks to a swarm starts the same way (``load_swarm``): read the key, the
certificate and the manifest (from a file, or fetched by swarm id from an initial peer and
checked against the id), take any newer manifest an initial peer holds (how a revocation reaches
a joiner), and check the certificate against it. A mistake is one line that says what to do and a
non-zero exit, before a socket opens to train.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.config import config_from_args
from node.dht.membership import config_from_manifest
from node.dht.swarm import MANIFEST_PATH, request_headers
from node.wire.identity import IdentityError, load_certificate, load_key, load_manifest
from node.wire.tls import client_context
from protocol.errors import RemoteProtocolError
from protocol.wire.membership import (
    MAX_MANIFEST_BYTES,
    Certificate,
    SwarmManifest,
    admit,
)
from protocol.wire.signing import Signer

__all__ = ["SwarmError", "bootstrap_main", "join_main", "load_swarm", "signed_request", "status_main"]

log = logging.getLogger("atoll.join")


class SwarmError(Exception):
    """A one-line reason the command cannot go on, and what to do."""


@dataclass(frozen=True)
class Swarm:
    signer: Signer
    manifest: SwarmManifest
    cert: Certificate | None


def signed_request(url: str, *, swarm: str, signer: Signer, cert: Certificate | None, method: str = "GET",
                   body: bytes | None = None, limit: int = 16 << 20, timeout: float = 10.0) -> tuple[int, bytes]:
    """One signed request (``Atoll-Auth`` and the certificate); TLS without a pin: the answer's
    contents are checked by signature. Returns (status, body) for any HTTP status."""
    headers = request_headers(signer, cert.to_header() if cert is not None else "", swarm=swarm, method=method,
                              url=url, now=time.time())
    req = urllib.request.Request(url, data=body, headers=headers, method=method)
    ctx = client_context() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:  # noqa: S310 (http(s), checked)
            return resp.status, resp.read(limit)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(4096)


def _reason(body: bytes) -> str:
    try:
        return str(json.loads(body).get("reason", body[:200].decode(errors="replace")))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


def fetch_manifest(initial_peers: list[str], *, swarm: str, signer: Signer, cert: Certificate | None) -> SwarmManifest | None:
    """The newest verified manifest of swarm ``swarm`` that an initial peer hands over, or None.

    Raises ``SwarmError`` when a peer refuses us (403 with its reason: revoked, expired, …)."""
    best: SwarmManifest | None = None
    for base in initial_peers:
        if not base.startswith(("http://", "https://")):
            raise SwarmError(f"initial peer {base!r} is not an http(s) URL, e.g. https://host:7000")
        try:
            status, body = signed_request(base.rstrip("/") + MANIFEST_PATH, swarm=swarm, signer=signer, cert=cert,
                                    limit=MAX_MANIFEST_BYTES)
        except (OSError, ssl.SSLError) as exc:
            print(f"atoll: {base} did not answer ({exc}); trying the next", file=sys.stderr)
            continue
        if status in (401, 403):
            raise SwarmError(f"refused by {base}: {_reason(body)}")
        if status != 200:
            print(f"atoll: {base} answered {status} for the manifest: {_reason(body)}", file=sys.stderr)
            continue
        try:
            m = SwarmManifest.from_toml(body)
            m.verify(expected_id=swarm)
        except RemoteProtocolError as exc:
            print(f"atoll: {base} handed over a manifest that does not check out: {exc.reason}", file=sys.stderr)
            continue
        if best is None or m.version > best.version:
            best = m
    return best


def load_swarm(args: argparse.Namespace, *, initial_peers: list[str]) -> Swarm:
    """Key, certificate and manifest from ``args`` (``--key``, ``--cert``, ``--manifest`` or
    ``--swarm``), the manifest updated from ``initial_peers``, and the certificate checked."""
    try:
        signer = load_key(args.key)
        cert = load_certificate(args.cert) if args.cert else None
        manifest = load_manifest(args.manifest) if getattr(args, "manifest", None) else None
    except IdentityError as exc:
        raise SwarmError(str(exc)) from None
    swarm_id = manifest.swarm_id if manifest is not None else getattr(args, "swarm", None)
    if swarm_id is None:
        raise SwarmError("say which swarm: --manifest swarm.toml, or --swarm ID with --initial-peers")
    if initial_peers:
        fetched = fetch_manifest(initial_peers, swarm=swarm_id, signer=signer, cert=cert)
        if manifest is None:
            manifest = fetched
        elif fetched is not None:
            try:
                if manifest.superseded_by(fetched):
                    print(f"atoll: using manifest version {fetched.version} from the swarm "
                          f"(the file holds {manifest.version})", file=sys.stderr)
                    manifest = fetched
            except RemoteProtocolError as exc:
                raise SwarmError(f"the swarm's manifest does not fit yours: {exc.reason}") from None
    if manifest is None:
        raise SwarmError(f"no initial peer handed over the manifest of swarm {swarm_id}; "
                         "check --initial-peers, or pass --manifest swarm.toml")
    try:
        admit(manifest, cert, public_key=signer.public_key, role=None, now=time.time())
    except RemoteProtocolError as exc:
        raise SwarmError(f"cannot join swarm {manifest.name!r}: {exc.reason}") from None
    return Swarm(signer, manifest, cert)


def _scheme(manifest: SwarmManifest) -> str:
    return "https" if manifest.admission == "certified" else "http"


def _host_port(spec: str) -> tuple[str, int]:
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit():
        raise SwarmError(f"bad address {spec!r}: expected HOST:PORT, e.g. 0.0.0.0:7000")
    return host or "0.0.0.0", int(port)


def join_main(args: argparse.Namespace) -> int:
    from node.dht.swarm import SwarmCredentials
    from node.run.train import PeerOptions, run_peer

    logging.getLogger().setLevel(min(logging.INFO, logging.getLogger().level))
    try:
        swarm = load_swarm(args, initial_peers=list(args.initial_peers))
        cfg = config_from_manifest(swarm.manifest, config_from_args(args))
        host, port = _host_port(args.listen)
    except (SwarmError, ValueError) as exc:
        print(f"atoll join: {exc}", file=sys.stderr)
        return 1
    m = swarm.manifest
    lab = f", lab {swarm.cert.lab} ({','.join(swarm.cert.roles)})" if swarm.cert else ", uncertified learner"
    print(f"atoll join: swarm {m.name!r} ({m.swarm_id}, {m.admission}, manifest v{m.version}){lab}; "
          f"model {cfg.model}, {cfg.fragments} fragments, H={cfg.inner_steps}", flush=True)
    scheme = _scheme(m)
    public = f"{scheme}://{args.public_address}" if args.public_address else None
    if public is None and host in ("0.0.0.0", "::"):
        public = f"{scheme}://127.0.0.1:{port}" if port else None
        if port == 0:
            host = "127.0.0.1"
            print("atoll join: no --public-address; listening on 127.0.0.1 only "
                  "(others on this machine can reach it)", file=sys.stderr)
    opts = PeerOptions(index=int.from_bytes(os.urandom(2), "big") % max(cfg.peers, 1),
                       initial_peers=tuple(args.initial_peers), host=host, port=port, public_address=public,
                       wait_for_stop=False, final_sync=False, serve_after_s=args.serve_after_s,
                       signer=swarm.signer, credentials=SwarmCredentials(m, swarm.signer, swarm.cert),
                       checkpoint_dir=args.checkpoint_dir)
    try:
        run_peer(cfg, opts)
    except KeyboardInterrupt:
        return 130
    except (ConnectionError, RemoteProtocolError, TimeoutError) as exc:
        print(f"atoll join: {exc}", file=sys.stderr)
        return 1
    return 0


def bootstrap_main(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from node.dht.bootstrap import run_bootstrap
    from node.dht.swarm import SwarmCredentials

    try:
        host, port = _host_port(args.listen)
        credentials, signer, scheme = None, None, "http"
        if args.manifest or args.key or args.cert:
            if not (args.manifest and args.key):
                raise SwarmError("a swarm's bootstrap node needs --manifest and --key (and --cert in a certified swarm)")
            swarm = load_swarm(args, initial_peers=list(args.initial_peers))
            signer, scheme = swarm.signer, _scheme(swarm.manifest)
            credentials = SwarmCredentials(swarm.manifest, swarm.signer, swarm.cert)
    except SwarmError as exc:
        print(f"atoll bootstrap: {exc}", file=sys.stderr)
        return 1
    public = f"{scheme}://{args.public_address}" if args.public_address else None
    if public is None and host in ("0.0.0.0", "::"):
        print("atoll bootstrap: listening on all interfaces; pass --public-address HOST:PORT "
              "so the node advertises an address others can dial", file=sys.stderr)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_bootstrap(host, port, public, args.initial_peers, signer=signer, credentials=credentials))
    return 0


def status_main(args: argparse.Namespace) -> int:
    url = args.peer.rstrip("/") + "/v1/status"
    try:
        if args.key:
            if not args.manifest:
                raise SwarmError("--key needs --manifest (the swarm whose peer this is)")
            swarm = load_swarm(args, initial_peers=[])
            code, body = signed_request(url, swarm=swarm.manifest.swarm_id, signer=swarm.signer, cert=swarm.cert)
        else:
            ctx = client_context() if url.startswith("https://") else None
            try:
                with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:  # noqa: S310
                    code, body = resp.status, resp.read(16 << 20)
            except urllib.error.HTTPError as exc:
                code, body = exc.code, exc.read(4096)
        if code != 200:
            raise SwarmError(f"{url} answered {code}: {_reason(body)}"
                             + ("; a certified swarm's peer needs --manifest, --key and --cert" if code in (401, 403) else ""))
        status = json.loads(body)
    except (OSError, ValueError) as exc:
        print(f"atoll status: could not read {url}: {exc}", file=sys.stderr)
        return 1
    except SwarmError as exc:
        print(f"atoll status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(render_status(status))
    return 0


def render_status(status: dict[str, Any]) -> str:
    adm = status.get("admission") or {}
    lines = [f"peer {str(status.get('peer_id', '?'))[:12]} at {status.get('url')} (swarm {status.get('swarm')}"
             + (f", {adm.get('name')} v{adm.get('version')} {adm.get('admission')}" if adm else "") + ")"]
    for m in status.get("members", []):
        lines.append(f"  member {m['peer_id'][:12]} {m['url'] or '(not dialable)':28} lab={m.get('lab') or '-':10} "
                     f"roles={','.join(m['roles'])} reachable={m['reachable']} learning={m['learning']} step={m['step']}")
    for p, o in sorted(status.get("owners", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"  fragment {p}: owner {o['peer_id'][:12] if o else 'none'} {o['url'] if o else ''}")
    lines.append(f"  versions held {status.get('versions')}; bytes sent {status.get('bytes_sent', 0) / 1e6:.1f} MB")
    if adm:
        lines.append(f"  admitted {adm.get('admitted', 0)} requests; refused {sum(adm.get('refused', {}).values())}: "
                     f"{adm.get('refused', {})}")
    return "\n".join(lines)


def read_path(value: str | None) -> Path | None:
    return Path(value) if value else None
