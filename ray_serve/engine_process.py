"""EngineProcess: a stage replica's engine, in a child process of the replica.

A Serve replica's process is busy besides the engine: its event loop answers Serve's calls and
relays emits, and Ray's own threads run beside it. An engine stepped by a thread of that
process shares the interpreter lock with all of it, and a small model's step (mostly Python)
ran about twice as long there as in an embedded worker (docs/scale-out.md). So the replica
starts the embedded worker's process entry point (`runtime.worker.worker_main`, the same
signal, thread and allocator settings) with a pipe, and only relays: messages to the worker
(Deliver, Abort, Shutdown, StatsQuery) down the pipe, its Ready/StartFailed/Emit/StatsReply
back to callbacks.

Emitted values travel in the pipe by value (ray_serve/portable_worker.py). The replica's own
process never imports torch: the engine's modules are loaded in the child only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import multiprocessing
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from omnistage.runtime import messages as msgs

STOP_JOIN_S = 10.0


class EngineProcess:
    """Starts the worker process, waits for its engine, relays messages both ways.

    `on_emits(list[Emit])` is called on the reader thread; `on_exit()` there too when the
    process goes away without having been asked to (it crashed or was killed)."""

    def __init__(
        self,
        source: dict,
        pipeline: str,
        stage: str,
        replica: int,
        on_emits: Callable[[list[msgs.Emit]], None],
        on_exit: Callable[[], None],
    ):
        self._on_emits = on_emits
        self._on_exit = on_exit
        self._started = threading.Event()
        self._start_error: str | None = None
        self._stopping = False
        self._send_lock = threading.Lock()
        self._seq = itertools.count()
        self._stats: dict[int, concurrent.futures.Future] = {}
        # a new interpreter, not a fork: a forked child gets gRPC's threads back (Ray's fork
        # handlers start them again), and with them the slow steps this process exists to avoid
        self._conn, child_conn = multiprocessing.Pipe(duplex=True)
        fd = child_conn.fileno()
        cmd = [sys.executable, "-P", "-m", "omnistage.ray_serve.portable_worker", str(fd)]
        self.proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL)
        child_conn.close()
        self.send((source, pipeline, stage, replica))
        self._reader = threading.Thread(target=self._read_loop, name=f"omnistage-relay-{stage}", daemon=True)
        self._reader.start()

    def wait_started(self) -> None:
        """Block until the engine is built; raise RuntimeError with its error if it failed."""
        self._started.wait()
        if self._start_error is not None:
            raise RuntimeError(self._start_error)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def send(self, msg) -> None:
        with self._send_lock:
            msgs.send_msg(self._conn, msg)

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        seq = next(self._seq)
        future = self._stats[seq] = concurrent.futures.Future()
        try:
            self.send(msgs.StatsQuery(seq))
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        finally:
            self._stats.pop(seq, None)

    def _read_loop(self) -> None:
        try:
            while True:
                msg = msgs.recv_msg(self._conn)
                if isinstance(msg, msgs.Emit):
                    self._on_emits([msg])
                elif isinstance(msg, msgs.EmitBatch):
                    self._on_emits(msg.emits)
                elif isinstance(msg, msgs.StatsReply):
                    future = self._stats.get(msg.seq)
                    if future is not None and not future.done():
                        future.set_result(msg.stats)
                elif isinstance(msg, msgs.Ready):
                    self._started.set()
                elif isinstance(msg, msgs.StartFailed):
                    self._start_error = msg.error
                    self._started.set()
                # the rest (memory reports, consumed-chunk counts) is the embedded hub's upkeep
        except (EOFError, OSError):
            pass
        if not self._started.is_set():
            try:
                code = self.proc.wait(1)
            except subprocess.TimeoutExpired:
                code = None
            self._start_error = f"the engine process exited (code {code}) while starting"
            self._started.set()
        elif self._start_error is None and not self._stopping:
            self._on_exit()

    def close(self) -> None:
        """Ask the worker to finish (it drains its inbox and closes the engine), then reap it."""
        self._stopping = True
        try:
            self.send(msgs.Shutdown())
        except OSError:
            pass
        try:
            self.proc.wait(STOP_JOIN_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._conn.close()
