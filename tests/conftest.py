"""Fixtures every test shares."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """The test process computes on one torch thread, as every peer does (``RunConfig.threads``).
    On a busy 2-core box two intra-op threads wait on each other at every op (at load 4 a
    60-example hypothesis test of ``norm64`` took 5 s of wall instead of 0.6 to 1.1 s), and which
    tests ran before (the workload tests used to set it for the rest of the run) no longer decides
    it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config: pytest.Config) -> None:
    """A run stopped with SIGTERM (a CI job's timeout, ``kill``) stops as Ctrl-C does, so each
    running test's fixtures stop the ``atoll`` peer processes they started; the default SIGTERM
    ends pytest at once and left them running."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    # the process-level tests' ``atoll`` children are forked from one process that imported
    # torch once (node.run.prefork): ~7 s of CPU less each on the 2-core box
    import bench.cli_swarm

    bench.cli_swarm.FORK_CHILDREN = True
