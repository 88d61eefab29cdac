"""Peer processes of ``atoll local`` forked from one warm process instead of each started cold.

A peer started by exec imports torch and builds its AdamW, whose first use imports
``torch._dynamo``: about 7 s of CPU on the shared 2-core box, before it does anything of its
own, so 32 peers took minutes to start and every restart of a chaos run paid it again. The
launcher instead starts one *prefork server* (``python -m node.run.prefork``) that imports
what a peer imports, once, and forks each peer on request. The child is ``atoll peer`` as
exec would run it (``node.cli.main`` with the same arguments, environment and working folder),
in its own session, with the stdin, stdout and log file the launcher made for it.

The server and the launcher speak over a Unix ``SOCK_SEQPACKET`` pair, one JSON object a
message, with file descriptors passed alongside (``SCM_RIGHTS``):

  launcher → server  {"seq": n, "argv": [...]}  + the child's stdin, stdout, stderr
  server → launcher  {"ready": pid}                        once, after its imports
                     {"seq": n, "pid": pid}  + a pidfd     a child forked
                     {"seq": n, "error": "..."}            none forked (the launcher execs it)
                     {"exited": pid, "code": c}            a child reaped (``Popen``'s code)

The launcher signals a child through its pidfd (never a pid that may have been reused), and
learns its exit code from the server, which is its parent. Nothing a peer does passes through
the server: it only forks and reaps. Where forking is not possible (no ``os.fork``, no pidfd:
not Linux 5.3 or later), the server does not start, or it fails, the launcher execs each peer
as before; ``atoll local --spawn exec`` asks for that.

Fork safety: the server starts no thread of its own and forks only while it has one Python
thread (native libraries' pools, such as OpenBLAS's, stop and restart across a fork through
their own ``pthread_atfork`` handlers); it runs no torch operation, so torch's intra-op pool
does not exist yet. Python's ``random`` is reseeded in every child; torch's default generator
is at its fixed initial seed, as in a process started by exec.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["ForkServer", "ForkedChild", "ForkedProcess", "PreforkServer", "fork_supported"]

log = logging.getLogger(__name__)

MAX_MESSAGE = 64 * 1024  # one request: a peer's argv
# what the server imports before it forks: what ``atoll peer`` and ``atoll join`` import, and
# torch._dynamo, which a process's first AdamW imports (by name: the children run ``python -m
# node`` as a program, so node/ does not depend on this module's imports)
PRELOAD = ("setproctitle", "torch", "torch._dynamo", "node.cli", "node.run.train", "node.run.join")
READY_TIMEOUT_S = 180.0  # the server's imports; a busy 2-core box has taken ~10 s
SPAWN_TIMEOUT_S = 30.0  # one fork and its reply


def fork_supported() -> bool:
    """Whether peers can be forked here: ``os.fork``, ``os.pidfd_open`` (Linux 5.3+) and
    passing descriptors over Unix sockets."""
    if not (hasattr(os, "fork") and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # an older kernel, or a sandbox that refuses the call
        return False
    return True


# --- launcher side -------------------------------------------------------------------------------
class ForkedProcess:
    """A peer the server forked, with the part of ``asyncio.subprocess.Process`` the launcher
    uses: ``pid``, ``stdin``, ``stdout``, ``returncode``, ``wait``, ``kill``, ``send_signal``."""

    def __init__(
        self,
        pid: int,
        pidfd: int,
        stdin: asyncio.StreamWriter,
        stdout: asyncio.StreamReader,
    ) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._exited = asyncio.Event()

    def send_signal(self, sig: int) -> None:
        """Signal the child through its pidfd; ``ProcessLookupError`` once it has exited."""
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def exited(self, code: int) -> None:
        """The server reaped the child (or, the server gone, its pidfd said it ended)."""
        if self.returncode is None:
            self.returncode = code
            self._exited.set()
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self.stdin.close()


class PreforkServer:
    """The launcher's handle on the prefork server: ``start`` it, ``spawn`` peers, ``close``."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self._proc = proc
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._seq = 0
        self._pending: dict[int, asyncio.Future[tuple[int, int]]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._exits: dict[int, int] = {}  # reaped before their ForkedProcess was made
        self._ready: asyncio.Future[int] = self._loop.create_future()
        self._gone = False
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._on_readable)

    @classmethod
    async def start(cls, log_path: Path) -> PreforkServer:
        """Start the server and wait until it has imported what a peer needs. Raises
        ``RuntimeError`` (what went wrong, and that the peers will be started by exec)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with log_path.open("ab") as err:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "node.run.prefork",
                    str(theirs.fileno()),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=err,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
        except OSError as exc:
            ours.close()
            raise RuntimeError(f"the prefork server did not start: {exc}") from exc
        finally:
            theirs.close()
        server = cls(proc, ours)
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await server._ready
        except (TimeoutError, RuntimeError) as exc:
            await server.close()
            why = (
                f"not ready within {READY_TIMEOUT_S:.0f} s"
                if isinstance(exc, TimeoutError)
                else exc
            )
            raise RuntimeError(f"the prefork server failed: {why} (log: {log_path})") from exc
        return server

    async def spawn(self, argv: Sequence[str], stderr_path: Path) -> ForkedProcess:
        """Fork ``atoll`` with ``argv`` (``["peer", ...]``), its stderr written to
        ``stderr_path`` (from its start, as the exec'd peer's is). Raises ``RuntimeError`` when
        the server cannot fork it."""
        if self._gone:
            raise RuntimeError("the prefork server has exited")
        child_in, our_in = os.pipe()
        our_out, child_out = os.pipe()
        err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._seq += 1
        seq = self._seq
        reply: asyncio.Future[tuple[int, int]] = self._loop.create_future()
        self._pending[seq] = reply
        try:
            message = json.dumps({"seq": seq, "argv": list(argv)}).encode()
            socket.send_fds(self._sock, [message], [child_in, child_out, err])
            async with asyncio.timeout(SPAWN_TIMEOUT_S):
                pid, pidfd = await reply
        except BaseException:
            for fd in (our_in, our_out):
                os.close(fd)
            raise
        finally:
            self._pending.pop(seq, None)
            for fd in (child_in, child_out, err):  # the child has its own copies now
                os.close(fd)
        reader = asyncio.StreamReader(limit=2**16, loop=self._loop)  # as create_subprocess_exec
        await self._loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=self._loop),
            os.fdopen(our_out, "rb", 0),
        )
        transport, protocol = await self._loop.connect_write_pipe(
            lambda: asyncio.streams.FlowControlMixin(loop=self._loop),  # type: ignore[attr-defined]
            os.fdopen(our_in, "wb", 0),
        )
        writer = asyncio.StreamWriter(transport, protocol, None, self._loop)
        child = ForkedProcess(pid, pidfd, writer, reader)
        self._children[pid] = child
        if pid in self._exits:  # it ended before we got here
            child.exited(self._exits.pop(pid))
        return child

    async def close(self) -> None:
        """Stop the server (its children live on: the launcher stops them); idempotent."""
        self._lost("the launcher closed it")  # no longer read: its reader is removed
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(TimeoutError, ProcessLookupError):
            async with asyncio.timeout(5.0):
                await self._proc.wait()
            return
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        await self._proc.wait()

    # --- the socket ------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_MESSAGE, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._lost(f"its socket failed: {exc}")
                return
            if not data:
                self._lost("it exited")
                return
            try:
                self._handle(json.loads(data), fds)
            except (ValueError, KeyError, TypeError) as exc:  # our own server: a bug, said once
                log.error("prefork server: a message not understood (%r): %s", data[:200], exc)
                for fd in fds:
                    os.close(fd)

    def _handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        if "ready" in msg:
            if not self._ready.done():
                self._ready.set_result(int(msg["ready"]))
            return
        if "exited" in msg:
            pid, code = int(msg["exited"]), int(msg["code"])
            child = self._children.pop(pid, None)
            if child is not None:
                child.exited(code)
            else:
                self._exits[pid] = code
            return
        if not self._ready.done():  # the server refuses to serve at all
            self._ready.set_exception(RuntimeError(str(msg.get("error", msg))))
            return
        reply = self._pending.get(int(msg["seq"]))
        if "pid" in msg and fds:
            self._exits.pop(int(msg["pid"]), None)  # an earlier child's, its pid reused
            if reply is None or reply.done():  # its spawn gave up: the child must not run on
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fds[0], signal.SIGKILL)
                os.close(fds[0])
                return
            reply.set_result((int(msg["pid"]), fds[0]))
        elif reply is not None and not reply.done():
            reply.set_exception(RuntimeError(str(msg.get("error", "no pidfd came with it"))))

    def _lost(self, why: str) -> None:
        """The server is gone: spawns fail, and each live child's end is told by its pidfd."""
        if self._gone:
            return
        self._gone = True
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._sock.fileno())
        if not self._ready.done():
            self._ready.set_exception(RuntimeError(why))
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(RuntimeError(f"the prefork server is gone: {why}"))
        for child in list(self._children.values()):
            if child.returncode is None:
                self._watch_pidfd(child)

    def _watch_pidfd(self, child: ForkedProcess) -> None:
        """Without its parent, a child's exit code is lost; its pidfd still says when it ends."""

        def ended() -> None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(child._pidfd)
            child.exited(255)

        try:
            self._loop.add_reader(child._pidfd, ended)
        except (ValueError, OSError):
            child.exited(255)


# --- a blocking client, for code without an event loop ------------------------------------------
class ForkedChild:
    """A child of a ``ForkServer``, with the part of ``subprocess.Popen`` its callers use:
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, pid: int, pidfd: int, server: ForkServer) -> None:
        self.pid, self._pidfd, self._server = pid, pidfd, server
        self.returncode: int | None = None

    def poll(self, timeout: float | None = 0.0) -> int | None:
        """The exit code once the server reaped the child; with the server gone (and the code
        with it), 255 once the child's pidfd says it ended (as ``PreforkServer``'s children)."""
        if self.returncode is None:
            self.returncode = self._server.code_of(self.pid)
            ended = self.returncode is None and self._server.gone
            if ended and select.select([self._pidfd], [], [], timeout)[0]:
                self.returncode = 255
            if self.returncode is not None:
                os.close(self._pidfd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        if self.poll() is None:
            self._server.wait_for(self.pid, timeout)  # returns early if the server is gone
        code = self.poll(timeout)  # blocks (None: until the end) only with the server gone
        if code is None:
            raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The prefork server for callers without an event loop (the process-level tests start
    dozens of ``atoll`` children): requests sent under a lock, replies and exits read by a
    thread. ``spawn`` raises ``RuntimeError`` when the server cannot fork."""

    def __init__(self, log_path: Path, *, env: dict[str, str], cwd: Path) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with log_path.open("ab") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "node.run.prefork", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                pass_fds=(theirs.fileno(),),
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time, matched to its reply
        self._changed = threading.Condition()
        self._codes: dict[int, int] = {}
        self._reply: tuple[int, int] | str | None = None
        self._gone = False
        ours.settimeout(READY_TIMEOUT_S)
        try:
            data, fds, _flags, _addr = socket.recv_fds(ours, MAX_MESSAGE, 1)
            msg = json.loads(data) if data else {"error": "it exited"}
        except (OSError, ValueError) as exc:
            msg = {"error": repr(exc)}
        if "ready" not in msg:
            self.close()
            raise RuntimeError(f"the prefork server failed: {msg.get('error')} (log: {log_path})")
        ours.settimeout(None)
        threading.Thread(target=self._read, name="prefork-replies", daemon=True).start()

    def spawn(self, argv: Sequence[str], stdin: int, stdout: int, stderr: int) -> ForkedChild:
        """Fork ``atoll <argv>`` with these descriptors as its stdin, stdout and stderr."""
        with self._lock:
            with self._changed:
                if self._gone:
                    raise RuntimeError("the prefork server has exited")
                self._reply = None
            socket.send_fds(
                self._sock,
                [json.dumps({"seq": 0, "argv": list(argv)}).encode()],
                [stdin, stdout, stderr],
            )
            with self._changed:
                if not self._changed.wait_for(
                    lambda: self._reply is not None or self._gone, SPAWN_TIMEOUT_S
                ):
                    raise RuntimeError(f"no fork within {SPAWN_TIMEOUT_S:.0f} s")
                reply = self._reply
            if not isinstance(reply, tuple):
                raise RuntimeError(reply or "the prefork server has exited")
            return ForkedChild(reply[0], reply[1], self)

    @property
    def gone(self) -> bool:
        """The server has exited (or its socket failed): no exit code will come any more."""
        with self._changed:
            return self._gone

    def code_of(self, pid: int) -> int | None:
        with self._changed:
            return self._codes.get(pid)

    def wait_for(self, pid: int, timeout: float | None) -> None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes or self._gone, timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)
            return
        self._proc.kill()
        self._proc.wait()

    def _read(self) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_MESSAGE, 1)
                msg = json.loads(data) if data else None
            except (OSError, ValueError):
                msg = None
            with self._changed:
                if msg is None:
                    self._gone = True
                elif "exited" in msg:
                    self._codes[int(msg["exited"])] = int(msg["code"])
                elif "pid" in msg and fds:
                    self._codes.pop(int(msg["pid"]), None)  # an earlier child's, its pid reused
                    self._reply = (int(msg["pid"]), fds[0])
                else:
                    self._reply = str(msg.get("error", msg))
                self._changed.notify_all()
            if msg is None:
                return


# --- server side ---------------------------------------------------------------------------------
def _send(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(msg).encode()], list(fds))


def _child(argv: list[str], fds: list[int], close: Sequence[int]) -> NoReturn:
    """In the forked child: become ``atoll <argv>`` on the launcher's pipes, then exit."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in (*fds, *close):
            with contextlib.suppress(OSError):
                os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import setproctitle

        # ps and pgrep -f see the command line an exec'd peer has, not the server's
        setproctitle.setproctitle(" ".join([sys.executable, "-m", "node", *argv]))
        sys.argv = ["node", *argv]  # run_module puts the module's path first, as ``-m`` does
        runpy.run_module("node", run_name="__main__", alter_sys=True)  # ``python -m node ARGV``
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(fd: int) -> int:
    """The server's loop: import a peer's modules, say ready, fork on request, reap, until
    the launcher closes its end."""
    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    if sys.modules["torch"].cuda.is_initialized():  # a forked child could not use it
        _send(sock, {"seq": -1, "error": "CUDA was initialised by the imports: not forking"})
        return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops us
    children: set[int] = set()
    try:
        _send(sock, {"ready": os.getpid()})
        while True:
            readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
            if wake_r in readable:
                os.read(wake_r, 4096)
            _reap(sock, children)
            if sock.fileno() in readable and not _serve_one(sock, children, (wake_r, wake_w)):
                return 0  # the launcher is gone; the children live on in their own sessions
    except ConnectionError:  # the launcher went away while we wrote to it
        return 0


def _serve_one(sock: socket.socket, children: set[int], wake: tuple[int, int]) -> bool:
    """Read one request and fork its child, or say why not; False once the launcher is gone."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 3)
    if not data:
        return False
    try:
        request = json.loads(data)
        seq, argv = int(request["seq"]), [str(a) for a in request["argv"]]
    except (ValueError, KeyError, TypeError) as exc:
        for f in fds:
            os.close(f)
        _send(sock, {"seq": -1, "error": f"a request not understood: {exc}"})
        return True
    why = None
    if len(fds) != 3:
        why = "three descriptors expected"
    elif threading.active_count() != 1:
        why = "threads running"
    pid = -1
    if why is None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: the launcher execs it instead
            why = f"fork failed: {exc}"
        if pid == 0:
            _child(argv, fds, (sock.fileno(), *wake))
    for f in fds:
        os.close(f)
    if why is not None:
        _send(sock, {"seq": seq, "error": f"not forked: {why}"})
        return True
    children.add(pid)
    pidfd = os.pidfd_open(pid)  # before any reap: the pid is still this child's
    try:
        _send(sock, {"seq": seq, "pid": pid}, [pidfd])
    finally:
        os.close(pidfd)
    return True


if __name__ == "__main__":
    raise SystemExit(serve(int(sys.argv[1])))
