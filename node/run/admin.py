"""``atoll keygen`` and ``atoll swarm ...``: the founder's and the labs' administration commands.

``keygen`` makes a peer's (or founder's, or authority's) Ed25519 key. The founder then writes a
signed swarm manifest (``swarm init``), adds one authority per lab (``swarm add-authority``) and
revokes keys (``swarm revoke``); each edit is signed again with the version one higher, and
``swarm publish`` hands the new version to a member, from which it spreads. A lab's authority
certifies its peers (``swarm certify``). ``swarm show`` prints what a manifest says.

Every failure prints one line, ``atoll <command>: <what is wrong and what to do>``, to stderr and
exits 1 (2 for a bad argument value); never a traceback, and never a private key's bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from node.config import RECIPE_FIELDS, SCHEDULE_FIELDS, RunConfig, add_run_arguments
from node.wire.identity import (
    IdentityError,
    generate_key,
    load_key,
    load_manifest,
    public_key_from_arg,
    save_certificate,
    save_key,
    save_manifest,
)
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.wire.certificates import ROLES, Certificate
from protocol.wire.membership import ADMISSIONS, SwarmManifest
from protocol.wire.signing import Signer

__all__ = ["add_admin_commands", "run_admin"]

CLOCK_SKEW_S = 60.0  # a certificate is valid from this long before it was issued
PUBLISH_TIMEOUT_S = 10.0


class UsageError(ValueError):
    """An argument value that cannot be used (exit status 2)."""


# --- the parsers -----------------------------------------------------------------------------
def add_admin_commands(sub: Any) -> None:
    """Add ``keygen`` and ``swarm`` (with its sub-commands) to the ``atoll`` sub-parsers."""
    keygen = sub.add_parser(
        "keygen", help="make an Ed25519 key (PEM, mode 0600) and print its public key"
    )
    keygen.add_argument(
        "--out", type=Path, required=True, metavar="KEY", help="where to write the key"
    )
    keygen.add_argument(
        "--json", action="store_true", help='print {"public_key", "peer_id"} as JSON'
    )
    keygen.add_argument("--force", action="store_true", help="overwrite an existing key file")

    swarm = sub.add_parser(
        "swarm",
        help="found and administer a certified swarm (manifest, authorities, "
        "certificates, revocations)",
    )
    cmds = swarm.add_subparsers(dest="swarm_command", required=True)
    _add_init(cmds)
    add = cmds.add_parser(
        "add-authority", help="let a lab's authority key certify peers (founder only)"
    )
    add.add_argument("manifest", type=Path, help="the swarm manifest (rewritten in place)")
    add.add_argument(
        "--founder", type=Path, required=True, metavar="KEY", help="the founder's key file"
    )
    add.add_argument("--lab", required=True, help="the lab's name")
    add.add_argument(
        "--key",
        required=True,
        metavar="PUBKEY",
        help="the authority's public key (hex) or key file",
    )

    cert = cmds.add_parser("certify", help="certify a peer's key as a lab's authority")
    cert.add_argument("--manifest", type=Path, required=True, help="the swarm manifest")
    cert.add_argument(
        "--authority", type=Path, required=True, metavar="KEY", help="the authority's key file"
    )
    cert.add_argument(
        "--peer", required=True, metavar="PUBKEY", help="the peer's public key (hex) or key file"
    )
    cert.add_argument(
        "--roles", required=True, help="comma-separated roles: learner, owner or learner,owner"
    )
    cert.add_argument(
        "--days", default="30", help="validity in days; fractions allowed (default: 30)"
    )
    cert.add_argument(
        "--out", type=Path, required=True, metavar="CERT", help="where to write the certificate"
    )

    rev = cmds.add_parser(
        "revoke", help="revoke a peer's key (founder only; bumps the manifest version)"
    )
    rev.add_argument("manifest", type=Path, help="the swarm manifest (rewritten in place)")
    rev.add_argument(
        "--founder", type=Path, required=True, metavar="KEY", help="the founder's key file"
    )
    rev.add_argument(
        "--peer", required=True, metavar="PUBKEY", help="the key to revoke (hex) or its key file"
    )

    pub = cmds.add_parser(
        "publish", help="hand a (newer) manifest to a member; it spreads from there"
    )
    pub.add_argument("manifest", type=Path, help="the swarm manifest")
    pub.add_argument(
        "--peer", required=True, metavar="URL", help="a member's address, e.g. http://host:port"
    )
    pub.add_argument(
        "--founder",
        type=Path,
        required=True,
        metavar="KEY",
        help="the founder's key file: members take a manifest post only with its signature",
    )

    show = cmds.add_parser("show", help="print what a manifest says (its signature verified)")
    show.add_argument("manifest", type=Path, help="the swarm manifest")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.add_argument(
        "--artifact-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the recipe's artifacts are kept: print the recipe itself when it is there",
    )


def _add_init(cmds: Any) -> None:
    init = cmds.add_parser("init", help="found a swarm: write its signed manifest")
    init.add_argument("--name", required=True, help="the swarm's name")
    init.add_argument(
        "--founder", type=Path, required=True, metavar="KEY", help="the founder's key file"
    )
    init.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default="open",
        help="open: anyone may learn, certified peers own; certified: every peer needs a certificate",
    )
    init.add_argument("--out", type=Path, required=True, help="where to write the manifest")
    init.add_argument("--force", action="store_true", help="overwrite an existing manifest")
    init.add_argument(
        "--validation-sha256",
        default="",
        metavar="HEX",
        help="pin the swarm's validation set: the SHA-256 every peer reports as "
        "per_peer[i].validation.data_sha256 (a format-2 manifest; a peer whose set hashes "
        "otherwise refuses to start)",
    )
    init.add_argument(
        "--recipe",
        type=Path,
        default=None,
        metavar="TOML",
        help="the swarm trains this recipe (docs/recipes.md): its model, tokenizer and data are "
        "stored in --artifact-dir by hash, and the manifest pins the recipe's hash (format 3); "
        "its [schedule], batch size and seed replace the flags below",
    )
    init.add_argument(
        "--artifact-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where --recipe's artifacts are stored (serve them with atoll bootstrap "
        "--artifact-dir DIR); default: the same folder atoll join uses",
    )
    recipe = init.add_argument_group("recipe (shared by every peer of the swarm)")
    every = argparse.ArgumentParser(add_help=False)
    add_run_arguments(every)
    for action in every._actions:
        if action.dest in RECIPE_FIELDS:
            text = action.help or ""
            if action.dest in SCHEDULE_FIELDS:  # before " (default: ...)"
                text = text.replace(
                    " (default",
                    "; part of the swarm's learning-rate schedule, which "
                    "atoll join follows unless given its own (default",
                    1,
                )
            recipe.add_argument(
                *action.option_strings,
                dest=action.dest,
                type=action.type,
                default=action.default,
                help=text,
            )


# --- running them ----------------------------------------------------------------------------
def run_admin(args: argparse.Namespace) -> int:
    """Run ``atoll keygen`` or ``atoll swarm <command>``; return the exit status."""
    name = "keygen" if args.command == "keygen" else f"swarm {args.swarm_command}"
    handler = _HANDLERS[name]
    try:
        return handler(args)
    except UsageError as exc:
        return _fail(name, str(exc), 2)
    except (IdentityError, LocalProtocolError, ValueError) as exc:
        return _fail(name, str(exc), 1)
    except RemoteProtocolError as exc:
        return _fail(name, exc.reason, 1)
    except OSError as exc:
        return _fail(
            name, f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""), 1
        )


def _fail(name: str, message: str, code: int) -> int:
    print(f"atoll {name}: {' '.join(message.split())}", file=sys.stderr)
    return code


def _keygen(args: argparse.Namespace) -> int:
    signer = generate_key()
    save_key(signer, args.out, force=args.force)
    if args.json:
        print(json.dumps({"public_key": signer.public_key.hex(), "peer_id": signer.peer_id.hex()}))
    else:
        print(f"public_key {signer.public_key.hex()}")
        print(f"peer_id {signer.peer_id.hex()}")
    return 0


def _init(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.force:
        raise IdentityError(
            f"{args.out} already exists; pass --force to overwrite it "
            "(or edit it with add-authority / revoke)"
        )
    from node.dht.membership import recipe_of  # here: every atoll command builds these parsers

    founder = load_key(args.founder)
    recipe_sha256, cfg = "", _recipe_config(args)
    if args.recipe is not None:
        recipe_sha256, cfg = _stored_recipe(args, cfg)
    manifest = SwarmManifest(
        name=args.name,
        founder=founder.public_key,
        admission=args.admission,
        created=time.time(),
        recipe=recipe_of(cfg),
        format=3 if recipe_sha256 else 2 if args.validation_sha256 else 1,
        validation_sha256=args.validation_sha256.lower(),
        recipe_sha256=recipe_sha256,
    )
    save_manifest(manifest.signed(founder), args.out)
    print(manifest.swarm_id)
    print(f"wrote {args.out}: swarm {args.name}, admission {args.admission}, version 1")
    if recipe_sha256:
        print(f"recipe {recipe_sha256} and its artifacts stored in {_artifact_dir(args)}")
    return 0


def _artifact_dir(args: argparse.Namespace) -> Path:
    from node.state.artifacts import default_artifact_dir

    return Path(args.artifact_dir) if args.artifact_dir else default_artifact_dir()


def _stored_recipe(args: argparse.Namespace, cfg: RunConfig) -> tuple[str, RunConfig]:
    """Store ``--recipe`` and its artifacts; the recipe's hash and the run fields it sets."""
    from node.run.checks import check_recipe
    from node.run.recipes import init_recipe, recipe_config
    from node.state.artifacts import ArtifactStore

    recipe, digest = init_recipe(args.recipe, ArtifactStore(_artifact_dir(args)))
    try:
        cfg = recipe_config(recipe, cfg)
        check_recipe(cfg)
    except ValueError as exc:  # CheckError too
        raise UsageError(str(exc)) from None
    return digest, cfg


def _recipe_config(args: argparse.Namespace) -> RunConfig:
    """The ``RunConfig`` the recipe flags describe, with what the GPT workload implies filled in
    (a token cap of 0 becomes batch size x context length, as every peer would compute), checked
    as ``atoll join`` and ``atoll local`` check it: a recipe every peer refuses is never signed."""
    from node.run.checks import check_recipe
    from node.workload.presets import resolved

    try:
        cfg = RunConfig(**{name: getattr(args, name) for name in RECIPE_FIELDS})
        check_recipe(cfg)
        return resolved(cfg)
    except ValueError as exc:  # CheckError too
        raise UsageError(str(exc)) from None


def _founder_of(manifest: SwarmManifest, path: Path) -> Signer:
    founder = load_key(path)
    if founder.public_key != manifest.founder:
        raise IdentityError(
            f"{path} is not the founder's key of swarm {manifest.name} (founder "
            f"{manifest.founder.hex()}); only the founder may edit its manifest"
        )
    return founder


def _add_authority(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    founder = _founder_of(manifest, args.founder)
    key = public_key_from_arg(args.key)
    if key in manifest.revoked:
        raise IdentityError(
            f"key {key.hex()} is revoked in this swarm; make a new key for lab {args.lab}"
        )
    newer = manifest.with_authority(args.lab, key).signed(founder)
    save_manifest(newer, args.manifest)
    print(
        f"lab {args.lab} (authority {key.hex()}) added; {args.manifest} is now version {newer.version}"
    )
    return 0


def _revoke(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    founder = _founder_of(manifest, args.founder)
    key = public_key_from_arg(args.peer)
    if key in manifest.revoked:
        print(
            f"{key.hex()} is already revoked; {args.manifest} stays at version {manifest.version}"
        )
        return 0
    newer = manifest.with_revoked(key).signed(founder)
    save_manifest(newer, args.manifest)
    print(
        f"revoked {key.hex()}; {args.manifest} is now version {newer.version} "
        f"(hand it to a member: atoll swarm publish {args.manifest} --founder {args.founder} "
        "--peer URL)"
    )
    return 0


def _certify(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    authority = load_key(args.authority)
    subject = public_key_from_arg(args.peer)
    roles, days = _parse_roles(args.roles), _parse_days(args.days)
    if subject in manifest.revoked:
        raise IdentityError(
            f"key {subject.hex()} is revoked in swarm {manifest.name} "
            f"(manifest version {manifest.version}); the peer needs a new key"
        )
    now = time.time()
    cert = Certificate.issue(
        authority,
        manifest=manifest,
        subject=subject,
        roles=roles,
        not_before=now - CLOCK_SKEW_S,
        not_after=now + days * 86400.0,
    )
    save_certificate(cert, args.out)
    expiry = datetime.fromtimestamp(cert.not_after, tz=UTC).isoformat(timespec="seconds")
    print(
        f"certified {subject.hex()} for lab {cert.lab}, roles {','.join(cert.roles)}, "
        f"valid until {expiry}; wrote {args.out}"
    )
    return 0


def _parse_roles(text: str) -> tuple[str, ...]:
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    if not roles or any(r not in ROLES for r in roles):
        raise UsageError(f"--roles {text!r}: expected learner, owner or learner,owner")
    return roles


def _parse_days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = float("nan")
    if not 0 < days < 36500:
        raise UsageError(
            f"--days {text!r}: expected a positive number of days below 36500 "
            "(fractions allowed: 0.0001 is about 9 s)"
        )
    return days


def _publish(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)  # refuse to hand out a manifest that does not verify
    founder = _founder_of(manifest, args.founder)
    body = Path(args.manifest).read_bytes()
    base = args.peer.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise UsageError(f"--peer {args.peer!r} is not an http(s) URL, e.g. http://host:7000")
    from node.dht.swarm import MANIFEST_PATH, manifest_post_headers
    from node.run.join import http_fetch

    try:
        # a certified peer's TLS certificate is self-signed: the manifest proves itself (the founder's
        # signature), so the publisher needs no pin to hand it over. The whole answer within the
        # timeout: a peer trickling it a byte a second does not hold the command
        status, got = http_fetch(
            base + MANIFEST_PATH,
            method="POST",
            body=body,
            limit=65536,
            headers={
                "Content-Type": "application/toml",
                **manifest_post_headers(founder, manifest, body),
            },
            timeout=PUBLISH_TIMEOUT_S,
        )
    except TimeoutError:
        raise IdentityError(f"{base} did not answer within {PUBLISH_TIMEOUT_S:.0f} s") from None
    except OSError as exc:
        raise IdentityError(f"could not reach {base}: {exc.strerror or exc}") from None
    answer = got.decode(errors="replace").strip()
    if status >= 400:
        raise IdentityError(
            f"{base} refused the manifest: {status} {_reason(answer or str(status))}"
        )
    print(answer or f"{base} took the manifest")
    return 0


def _reason(text: str) -> str:
    """A peer's error body as one short line (the ``error`` or ``reason`` of a JSON body)."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        text = str(data.get("error") or data.get("reason") or text)
    return " ".join(text.split())[:300]


def _show(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    info = _describe(manifest)
    if manifest.recipe_sha256:
        document = _recipe_document(manifest.recipe_sha256, _artifact_dir(args))
        if document is not None:
            info["recipe_document"] = document
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(
        f"swarm {info['name']} id {info['id']} version {info['version']} admission {info['admission']}"
    )
    print(f"  founder {info['founder']}")
    for a in info["authorities"]:
        print(f"  authority {a['lab']}: {a['public_key']}")
    for key in info["revoked"]:
        print(f"  revoked {key}")
    print("  recipe " + " ".join(f"{k}={v}" for k, v in info["recipe"].items()))
    if "recipe_document" in info:
        print(f"  recipe document {manifest.recipe_sha256}:")
        for line in info["recipe_document"].splitlines():
            print(f"    {line}")
    return 0


def _recipe_document(digest: str, folder: Path) -> str | None:
    """The recipe the manifest pins, as text, when the artifact store holds it (verified)."""
    from node.state.artifacts import ArtifactError, ArtifactStore

    store = ArtifactStore(folder)
    if not store.has(digest):
        print(
            f"atoll swarm show: the recipe {digest[:16]} is not in {folder} (atoll join fetches "
            "it from peers; pass --artifact-dir to read another folder)",
            file=sys.stderr,
        )
        return None
    try:
        return store.open_verified(digest).read_text()
    except (ArtifactError, UnicodeDecodeError) as exc:
        print(f"atoll swarm show: {exc}", file=sys.stderr)
        return None


def _describe(m: SwarmManifest) -> dict[str, Any]:
    return {
        "id": m.swarm_id,
        "name": m.name,
        "version": m.version,
        "admission": m.admission,
        "created": m.created,
        "founder": m.founder.hex(),
        "authorities": [{"lab": a.lab, "public_key": a.public_key.hex()} for a in m.authorities],
        "revoked": sorted(k.hex() for k in m.revoked),
        "recipe": dict(m.signed_recipe()),  # with the format and the validation pin (format 2)
    }


_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "keygen": _keygen,
    "swarm init": _init,
    "swarm add-authority": _add_authority,
    "swarm certify": _certify,
    "swarm revoke": _revoke,
    "swarm publish": _publish,
    "swarm show": _show,
}
