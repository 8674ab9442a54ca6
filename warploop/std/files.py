"""Files that device code may open: confined to one root directory, optionally read-only.

Device code only ever names a path relative to the root (as a string id) and holds small
integers from this table, never the process's own file descriptors. Without a root, every
open is refused. A path is refused when it is absolute, has a `..` part, or resolves (through
symlinks) to somewhere outside the root; on Linux the opened file's real path is checked again
after opening, so a symlink swapped in between the check and the open does not escape either.
"""
from __future__ import annotations

import os
import threading

from warploop.std.protocol import OpenMode, Status, StdError

_FLAGS = {
    OpenMode.READ: os.O_RDONLY,
    OpenMode.WRITE: os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    OpenMode.APPEND: os.O_WRONLY | os.O_CREAT | os.O_APPEND,
}


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class FileTable:
    """Open files of the device program. Thread-safe: the server's pool reads files in parallel."""

    def __init__(self, root: str | os.PathLike | None = None, read_only: bool = False,
                 max_open: int = 1024) -> None:
        if root is not None and not os.path.isdir(root):
            raise ValueError(f"files root {os.fspath(root)!r} is not a directory; create it or pass another")
        self.root = os.path.realpath(root) if root is not None else None
        self.read_only = read_only
        self.max_open = max_open
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}   # device fd -> OS fd
        self._next_fd = 3                 # 0-2 look like stdio to C programmers; never hand them out

    def resolve(self, path: str) -> str:
        """The absolute path `path` names under the root, or StdError(NOT_PERMITTED)."""
        if self.root is None:
            raise StdError(Status.NOT_PERMITTED, "file calls are disabled: give the runtime a files_root")
        if not path or os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
            raise StdError(Status.NOT_PERMITTED, f"path {path!r} must be relative to the files root, without '..'")
        real = os.path.realpath(os.path.join(self.root, path))
        if not _inside(real, self.root):
            raise StdError(Status.NOT_PERMITTED, f"path {path!r} leads outside the files root (symlink?)")
        return real

    def open(self, path: str, mode: int) -> int:
        if mode not in _FLAGS:
            raise StdError(Status.BAD_ARGUMENT, f"open mode {mode}: use OpenMode.READ, WRITE or APPEND")
        if self.read_only and mode != OpenMode.READ:
            raise StdError(Status.NOT_PERMITTED, f"cannot open {path!r} for writing: the files are read-only")
        real = self.resolve(path)
        try:
            os_fd = os.open(real, _FLAGS[OpenMode(mode)] | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileNotFoundError as e:
            raise StdError(Status.IO_ERROR, f"no such file {path!r}") from e
        except OSError as e:
            raise StdError(Status.IO_ERROR, f"cannot open {path!r}: {e.strerror}") from e
        opened = f"/proc/self/fd/{os_fd}"
        if os.path.exists(opened) and not _inside(os.path.realpath(opened), self.root):
            os.close(os_fd)
            raise StdError(Status.NOT_PERMITTED, f"path {path!r} changed to lead outside the files root")
        with self._lock:
            if len(self._open) >= self.max_open:
                os.close(os_fd)
                raise StdError(Status.TOO_MANY_FILES, f"{self.max_open} files already open; close some")
            fd = self._next_fd
            self._next_fd += 1
            self._open[fd] = os_fd
        return fd

    def _os_fd(self, fd: int) -> int:
        os_fd = self._open.get(fd)
        if os_fd is None:
            raise StdError(Status.BAD_FD, f"fd {fd} is not open")
        return os_fd

    def read_into(self, fd: int, view: memoryview, offset: int) -> int:
        """pread into `view` until it is full or the file ends; the number of bytes read."""
        if offset < 0:
            raise StdError(Status.BAD_ARGUMENT, f"read offset {offset} is negative")
        os_fd = self._os_fd(fd)
        done = 0
        try:
            while done < len(view):
                n = os.preadv(os_fd, [view[done:]], offset + done)
                if n == 0:
                    break
                done += n
        except OSError as e:
            raise StdError(Status.IO_ERROR, f"read of fd {fd} failed: {e.strerror}") from e
        return done

    def write_from(self, fd: int, view: memoryview) -> int:
        os_fd = self._os_fd(fd)
        done = 0
        try:
            while done < len(view):
                done += os.write(os_fd, view[done:])
        except OSError as e:
            raise StdError(Status.IO_ERROR, f"write to fd {fd} failed: {e.strerror}") from e
        return done

    def close(self, fd: int) -> None:
        with self._lock:
            os_fd = self._open.pop(fd, None)
        if os_fd is None:
            raise StdError(Status.BAD_FD, f"fd {fd} is not open")
        os.close(os_fd)

    def close_all(self) -> None:
        with self._lock:
            fds, self._open = list(self._open.values()), {}
        for os_fd in fds:
            os.close(os_fd)
