"""Ending a finished process without the interpreter's teardown (``atoll peer``, every rank of
``atoll join --nproc N``, and any ``SwarmIsland`` script run under torchrun)."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

__all__ = ["exit_without_teardown"]


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Flush stdout, stderr and the log handlers, then end the process with ``code`` at once.

    Call it once the results are out and every file is written and closed (and, on a rank of a
    multi-process island, after every rank passed the final barrier and destroyed the process
    group). Two reasons not to go through the interpreter's teardown:

    - On a rank, DDP's reducer and FSDP's device mesh still hold the gloo group after
      ``destroy_process_group``, so its C++ objects (context, sockets, the tensors of its last
      work) would be freed during interpreter finalization, with the other rank possibly gone
      already, where gloo's teardown can abort the process (SIGABRT, "terminate called without
      an active exception"; PyTorch PR #179291 describes that finalization crash). torchrun then
      reports the island failed after its result was out, the more often the busier the machine
      (docs/islands.md).
    - Freeing every module torch brought in, and their exit hooks, takes 1-2 s of CPU per process
      on a small machine, paid by every peer of a local swarm while its launcher waits.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
