"""The host server: one thread that answers the device's calls.

Each pass scans the STATE word of every port at once (one numpy compare) and answers every
POSTED request (dispatch.py: batched prints, vectorized and inline calls on this thread, slow
callbacks and file copies on a thread pool). Nothing here allocates GPU memory.

When idle the thread spins for `spin_us` (the device's next call usually comes within a few
microseconds), then sleeps on an event with a timeout that doubles up to `max_sleep_us`. The
device cannot wake a host thread, so the timeout is the doorbell: every wake-up re-scans all
ports, and a request posted at any moment is seen at the latest one timeout later.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import weakref
from collections.abc import Callable

from warploop.std import handlers as H
from warploop.std.dispatch import Dispatcher, ReplyHook, log
from warploop.std.files import FileTable
from warploop.std.memory import Buffers
from warploop.std.protocol import PORT_WORDS, Word

_servers: weakref.WeakSet[HostServer] = weakref.WeakSet()


def ring_doorbells() -> None:
    """Wake every running server now. Called by device code under the Triton interpreter, where the
    "device" is a thread of this process and can do what a GPU cannot."""
    for server in list(_servers):
        server.notify()


class HostServer(Dispatcher):
    """Answers device calls on `ports` (an int64 host tensor [n, PORT_WORDS], see protocol.py)."""

    def __init__(self, ports, *, files: FileTable | None = None, buffers: Buffers | None = None,
                 functions: dict[str, Callable | H.HostFunction] | None = None, out=None,
                 pool_workers: int = 8, spin_us: float | None = None, max_sleep_us: float = 1000.0,
                 on_reply: ReplyHook | None = None) -> None:
        if ports.dim() != 2 or ports.shape[1] != PORT_WORDS or ports.is_cuda:
            raise ValueError(f"ports must be a host int64 tensor [n, {PORT_WORDS}]; use protocol.allocate_ports()")
        super().__init__(ports.numpy(), H.Handlers(files or FileTable(), buffers or Buffers()), out, on_reply)
        self.ports = ports
        if spin_us is None:   # under the interpreter the device rings instead: spinning only steals the GIL
            spin_us = 0.0 if os.environ.get("TRITON_INTERPRET") == "1" else 200.0
        self.spin_s = spin_us * 1e-6
        self.max_sleep_s = max_sleep_us * 1e-6
        self.pool_workers = pool_workers
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        for name, fn in (functions or {}).items():
            self.register_function(name, fn)

    def register_function(self, name: str, fn: Callable | H.HostFunction, *, inline: bool = False,
                          vectorized: bool = False) -> int:
        """Make `fn` callable from device code as std.call(port, <the returned id>, ...)."""
        from warploop.std import strings

        if not isinstance(fn, H.HostFunction):
            fn = H.HostFunction(fn, inline=inline, vectorized=vectorized)
        fid = strings.intern(name)
        self.handlers.register(fid, fn)
        return fid

    def watch(self, ports: int) -> None:
        """Scan only the first `ports` ports (the ones callers own), when fewer than were allocated."""
        if not 1 <= ports <= len(self._words):
            raise ValueError(f"watch({ports}): there are {len(self._words)} ports")
        self._state = self._words[:ports, Word.STATE]

    @property
    def files(self) -> FileTable:
        return self.handlers.files

    @property
    def buffers(self) -> Buffers:
        return self.handlers.buffers

    def start(self) -> HostServer:
        if self._thread is not None:
            raise RuntimeError("this server is already running")
        self._stopping = False
        self._pool = concurrent.futures.ThreadPoolExecutor(self.pool_workers, thread_name_prefix="warploop-std")
        self._thread = threading.Thread(target=self._loop, name="warploop-std-server", daemon=True)
        _servers.add(self)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; first answer everything already posted (async prints included)."""
        if self._thread is None:
            return
        self._stopping = True
        self.notify()
        self._thread.join()
        self._pool.shutdown(wait=True)
        self._pool = None   # from here on serve_once does pooled work itself
        for _ in range(3):   # one pass takes everything posted; a kernel still running may post more
            if not self.serve_once():
                break
        _servers.discard(self)
        self._thread = None
        self.files.close_all()

    def __enter__(self) -> HostServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def notify(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        idle_since, sleep = None, 50e-6
        while not self._stopping:
            try:
                busy = self.serve_once()
            except Exception:   # a bug here must not leave every caller spinning forever
                log.exception("host server pass failed; serving on")
                busy = 0
            if busy:
                idle_since, sleep = None, 50e-6
                continue
            now = time.perf_counter()
            idle_since = idle_since or now
            if now - idle_since < self.spin_s:
                if self._inflight:
                    time.sleep(0)   # let pool threads take the GIL
                continue
            if self._wake.wait(sleep):
                idle_since, sleep = None, 50e-6
            else:
                sleep = min(sleep * 2, self.max_sleep_s)
            self._wake.clear()
