"""The process-level tests' swarms: ``bench.cli_swarm``, which the benches that start real swarms
share."""

from bench.cli_swarm import (
    ENV,
    ROOT,
    Proc,
    SwarmFiles,
    admin,
    atoll,
    get_json,
    make_swarm,
    start_bootstrap,
)

__all__ = [
    "ENV",
    "ROOT",
    "Proc",
    "SwarmFiles",
    "admin",
    "atoll",
    "get_json",
    "make_swarm",
    "start_bootstrap",
]
