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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

__all__ = ["ForkServer", "ForkedChild", "ForkedProcess", "PreforkServer", "fork_supported"]

log = logging.getLogger(__name__)
T = TypeVar("T")

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


# --- the client: one, used from any thread --------------------------------------------------------
class ForkedChild:
    """A child of a ``ForkServer``, with the part of ``subprocess.Popen`` its callers use:
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``.
    ``returncode`` is set by the server's reader thread: the code the server reaped, or 255 once
    the child's pidfd says it ended after the server (its parent, which held the code) died."""

    def __init__(self, pid: int, pidfd: int, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd  # closed by the reader thread, under the server's lock, at the end
        self._server = server

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        with self._server._changed:
            if not self._server._changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0.0)
            assert self.returncode is not None
            return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal it through its pidfd, never a pid another process may have taken since;
        nothing once it has ended, as ``Popen``."""
        with self._server._changed:
            if self.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The prefork server and its client, safe to call from any thread: the process-level tests
    call it directly, the launcher (``PreforkServer``) from its event loop through a thread.
    Requests go out under a lock, each matched to its reply by number; one reader thread takes
    the replies and the children's exits, and once the server is gone, watches the live
    children's pidfds. Every failure to start or to fork raises ``RuntimeError``."""

    def __init__(
        self,
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        on_exit: Callable[[ForkedChild], None] | None = None,
    ) -> None:
        """Start the server and wait until it has imported what a peer needs. ``on_exit`` is
        called on the reader thread with each child once its ``returncode`` is set."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
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
        except OSError as exc:
            ours.close()
            raise RuntimeError(f"the prefork server did not start: {exc}") from exc
        finally:
            theirs.close()
        self._sock = ours
        self._on_exit = on_exit
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()  # guards what follows, and the children's ends
        self._seq = 0
        self._pending: dict[int, ForkedChild | str | None] = {}  # a spawn's reply, once it came
        self._live: dict[int, ForkedChild] = {}
        self._gone: str | None = None  # why, once the server is gone
        self._closing = False
        ours.settimeout(READY_TIMEOUT_S)
        try:
            data, fds, _flags, _addr = socket.recv_fds(ours, MAX_MESSAGE, 1)
            msg = json.loads(data) if data else {"error": "it exited"}
        except TimeoutError:
            msg = {"error": f"not ready within {READY_TIMEOUT_S:.0f} s"}
        except (OSError, ValueError) as exc:
            msg = {"error": repr(exc)}
        if "ready" not in msg:
            self.close()
            ours.close()
            raise RuntimeError(f"the prefork server failed: {msg.get('error')} (log: {log_path})")
        ours.settimeout(None)
        threading.Thread(target=self._read, name="prefork-replies", daemon=True).start()

    @property
    def pid(self) -> int:
        """The server process's pid."""
        return self._proc.pid

    @property
    def gone(self) -> bool:
        """The server has exited (or its socket failed): no fork and no exit code will come."""
        with self._changed:
            return self._gone is not None

    def spawn(self, argv: Sequence[str], stdin: int, stdout: int, stderr: int) -> ForkedChild:
        """Fork ``atoll <argv>`` with these descriptors as its stdin, stdout and stderr."""
        with self._changed:
            if self._gone is not None:
                raise RuntimeError(f"the prefork server is gone: {self._gone}")
            self._seq += 1
            seq = self._seq
            self._pending[seq] = None
        try:
            with self._send_lock:
                message = json.dumps({"seq": seq, "argv": list(argv)}).encode()
                socket.send_fds(self._sock, [message], [stdin, stdout, stderr])
        except OSError as exc:
            with self._changed:
                self._pending.pop(seq, None)
            raise RuntimeError(f"the prefork server is gone: {exc}") from exc
        with self._changed:
            self._changed.wait_for(
                lambda: self._pending[seq] is not None or self._gone is not None, SPAWN_TIMEOUT_S
            )
            reply = self._pending.pop(seq)  # a reply after this kills its child (``_handle``)
            gone = self._gone
        if isinstance(reply, ForkedChild):
            return reply
        if reply is not None:
            raise RuntimeError(reply)
        if gone is not None:
            raise RuntimeError(f"the prefork server is gone: {gone}")
        raise RuntimeError(f"the prefork server forked nothing within {SPAWN_TIMEOUT_S:.0f} s")

    def close(self) -> None:
        """Stop the server; idempotent. Its children live on in their own sessions (their
        owners stop them), and their ends are still told."""
        with self._changed:
            self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)
            return
        self._proc.kill()
        self._proc.wait()

    # --- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        why = self._read_replies()
        self._sock.close()  # only now: no descriptor number reused under a blocked recv
        with self._changed:
            self._gone = "the launcher closed it" if self._closing else why
            self._changed.notify_all()
        self._watch_orphans()

    def _read_replies(self) -> str:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_MESSAGE, 1)
            except OSError as exc:
                return f"its socket failed: {exc}"
            if not data:
                return "it exited"
            try:
                self._handle(json.loads(data), fds)
            except (ValueError, KeyError, TypeError) as exc:  # our own server: a bug, said once
                log.error("prefork server: a message not understood (%r): %s", data[:200], exc)
                for fd in fds:
                    os.close(fd)

    def _handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        if "exited" in msg:
            self._ended(int(msg["exited"]), int(msg["code"]))
            return
        seq = int(msg["seq"])
        with self._changed:
            waiting = seq in self._pending and self._pending[seq] is None
            if "pid" in msg and fds:
                child = ForkedChild(int(msg["pid"]), fds[0], self)
                if waiting:
                    self._live[child.pid] = child
                    self._pending[seq] = child
                else:  # its spawn gave up: the child must not run on
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(fds[0], signal.SIGKILL)
                    os.close(fds[0])
            elif waiting:
                self._pending[seq] = str(msg.get("error", "no pidfd came with it"))
            self._changed.notify_all()

    def _ended(self, pid: int, code: int) -> None:
        with self._changed:
            child = self._live.pop(pid, None)
            if child is None:  # one whose spawn gave up
                return
            child.returncode = code
            os.close(child._pidfd)
            self._changed.notify_all()
        if self._on_exit is not None:
            self._on_exit(child)

    def _watch_orphans(self) -> None:
        """Without their parent, the live children's exit codes are lost; each one's pidfd still
        says when it ends (told as 255). No child is added once the server is gone."""
        while True:
            with self._changed:
                pidfds = {child._pidfd: child.pid for child in self._live.values()}
            if not pidfds:
                return
            readable, _, _ = select.select(list(pidfds), [], [])
            for fd in readable:
                self._ended(pidfds[fd], 255)


# --- the launcher's side: the same client on its event loop -----------------------------------------
class ForkedProcess:
    """A peer the server forked, with the part of ``asyncio.subprocess.Process`` the launcher
    uses: ``pid``, ``stdin``, ``stdout``, ``returncode``, ``wait``, ``kill``, ``send_signal``."""

    def __init__(
        self, child: ForkedChild, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader
    ) -> None:
        self.pid = child.pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None  # set on the loop, as asyncio's own processes'
        self._child = child
        self._exited = asyncio.Event()

    def send_signal(self, sig: int) -> None:
        """Signal the child through its pidfd; ``ProcessLookupError`` once it has exited."""
        if self._child.returncode is not None:
            raise ProcessLookupError(self.pid)
        self._child.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def exited(self) -> None:
        """On the loop: take the child's exit code once it has one."""
        if self.returncode is None and self._child.returncode is not None:
            self.returncode = self._child.returncode
            self._exited.set()
            self.stdin.close()


class PreforkServer:
    """The launcher's handle on a ``ForkServer``: ``start`` it, ``spawn`` peers, ``close``. Its
    blocking calls run on worker threads; exits reach the loop by ``call_soon_threadsafe``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._server: ForkServer | None = None
        self._children: dict[ForkedChild, ForkedProcess] = {}

    @classmethod
    async def start(cls, log_path: Path) -> PreforkServer:
        """Start the server and wait until it has imported what a peer needs. Raises
        ``RuntimeError`` (what went wrong, and the server's log)."""
        self = cls(asyncio.get_running_loop())
        self._server = await _in_thread(
            lambda: ForkServer(log_path, on_exit=self._on_exit), undo=ForkServer.close
        )
        return self

    @property
    def pid(self) -> int:
        assert self._server is not None
        return self._server.pid

    @property
    def gone(self) -> bool:
        return self._server is None or self._server.gone

    async def spawn(self, argv: Sequence[str], stderr_path: Path) -> ForkedProcess:
        """Fork ``atoll`` with ``argv`` (``["peer", ...]``), its stderr written to
        ``stderr_path`` (from its start, as the exec'd peer's is). Raises ``RuntimeError`` when
        the server cannot fork it."""
        child, our_in, our_out = await _in_thread(
            lambda: self._fork(argv, stderr_path), undo=_abandon
        )
        try:
            reader = asyncio.StreamReader(limit=2**16, loop=self._loop)  # as create_subprocess_exec
            await self._loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader, loop=self._loop),
                os.fdopen(our_out, "rb", 0),
            )
            transport, protocol = await self._loop.connect_write_pipe(
                lambda: asyncio.streams.FlowControlMixin(loop=self._loop),  # type: ignore[attr-defined]
                os.fdopen(our_in, "wb", 0),
            )
        except BaseException:
            child.kill()
            raise
        proc = ForkedProcess(
            child, asyncio.StreamWriter(transport, protocol, None, self._loop), reader
        )
        self._children[child] = proc
        proc.exited()  # it may have ended before it was ours to be told of
        return proc

    async def close(self) -> None:
        """Stop the server (its children live on: the launcher stops them); idempotent."""
        if self._server is not None:
            await asyncio.to_thread(self._server.close)

    def _fork(self, argv: Sequence[str], stderr_path: Path) -> tuple[ForkedChild, int, int]:
        """On a worker thread: the child's pipes and log, and the fork."""
        assert self._server is not None
        child_in, our_in = os.pipe()
        our_out, child_out = os.pipe()
        try:
            err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                child = self._server.spawn(argv, child_in, child_out, err)
            finally:
                os.close(err)
        except BaseException:
            os.close(our_in)
            os.close(our_out)
            raise
        finally:
            os.close(child_in)  # the child has its own copies now
            os.close(child_out)
        return child, our_in, our_out

    def _on_exit(self, child: ForkedChild) -> None:
        """On the reader thread."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._told, child)

    def _told(self, child: ForkedChild) -> None:
        proc = self._children.pop(child, None)
        if proc is not None:
            proc.exited()


def _abandon(forked: tuple[ForkedChild, int, int]) -> None:
    """A fork whose spawn was cancelled while it was made: the child must not run on."""
    child, our_in, our_out = forked
    child.kill()
    os.close(our_in)
    os.close(our_out)


async def _in_thread(call: Callable[[], T], undo: Callable[[T], None]) -> T:
    """``call()`` on a worker thread. If we are cancelled meanwhile, the call still ends (a
    thread cannot be stopped), and ``undo`` is given its result."""
    future = asyncio.get_running_loop().run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:

        def later(done: asyncio.Future[T]) -> None:
            if not done.cancelled() and done.exception() is None:
                undo(done.result())

        future.add_done_callback(later)
        raise


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
