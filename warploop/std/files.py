"""Files that device code may open: confined to one root directory, optionally read-only.

Device code only ever names a path relative to the root (as a string id) and holds small
integers from this table, never the process's own file descriptors. Without a root, every
open is refused.

A path is walked one component at a time from a descriptor of the root directory taken when the
table is made, each component opened relative to its parent's descriptor with O_NOFOLLOW. A
symlink met on the way is read and followed here, and only while its target stays under the root
(the rule of Linux's RESOLVE_BENEATH). So nothing is ever opened, created or truncated through a
name that a concurrent rename or symlink swap could point elsewhere: the directory a file is
created in is already proven to be inside. The final open is O_NONBLOCK (a FIFO cannot block the
server) and is refused unless it is a regular file; truncation (WRITE) happens after that check.
Hard links: a file with more than one link may be read but not opened for writing (its other name
may be outside the root). docs/std.md states these rules.
"""
from __future__ import annotations

import errno
import os
import stat
import threading
import weakref

from warploop.std.protocol import OpenMode, Status, StdError

_FLAGS = {   # no O_TRUNC: WRITE truncates with ftruncate once the file is proven a lone regular file
    OpenMode.READ: os.O_RDONLY,
    OpenMode.WRITE: os.O_WRONLY | os.O_CREAT,
    OpenMode.APPEND: os.O_WRONLY | os.O_CREAT | os.O_APPEND,
}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# O_PATH needs no read permission on the directory (only search), as path resolution itself does.
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
MAX_SYMLINKS = 40   # Linux's own limit on symlinks followed in one path


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


class FileTable:
    """Open files of the device program. Thread-safe: the server's pool reads files in parallel."""

    def __init__(self, root: str | os.PathLike | None = None, read_only: bool = False,
                 max_open: int = 1024) -> None:
        if root is not None and not os.path.isdir(root):
            raise ValueError(f"files root {os.fspath(root)!r} is not a directory; create it or pass another")
        if root is not None and (not _NOFOLLOW or os.open not in os.supports_dir_fd):
            raise ValueError("file calls need O_NOFOLLOW and dir_fd opens (Linux, macOS); pass files_root=None")
        self.root = os.path.realpath(root) if root is not None else None
        self.read_only = read_only
        self.max_open = max_open
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}   # device fd -> OS fd
        self._next_fd = 3                 # 0-2 look like stdio to C programmers; never hand them out
        self._root_fd = None
        if self.root is not None:   # held for the table's life: renaming the root's path cannot redirect it
            self._root_fd = os.open(self.root, _DIR_FLAGS)
            weakref.finalize(self, os.close, self._root_fd)

    def _check_path(self, path: str) -> list[str]:
        """The components of a path device code may name, or StdError."""
        if self.root is None:
            raise StdError(Status.NOT_PERMITTED, "file calls are disabled: give the runtime a files_root")
        if "\0" in path:
            raise StdError(Status.BAD_ARGUMENT, f"path {path!r} contains a NUL byte; intern the path without it")
        if not path or os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
            raise StdError(Status.NOT_PERMITTED, f"path {path!r} must be relative to the files root, without '..'")
        return [p for p in path.split("/") if p not in ("", ".")]

    def _beneath(self, target: str, path: str) -> list[str] | None:
        """A symlink's absolute target as components under the root (None: relative target)."""
        if not os.path.isabs(target):
            return None
        prefix = self.root.rstrip(os.sep) + os.sep
        if target != self.root and not target.startswith(prefix):
            raise StdError(Status.NOT_PERMITTED, f"path {path!r} leads outside the files root (symlink)")
        return [p for p in target[len(prefix):].split("/") if p not in ("", ".")]

    def _open_beneath(self, path: str, flags: int) -> int:
        """The OS fd of `path` opened with `flags`, every component opened O_NOFOLLOW from the root's fd."""
        parts = self._check_path(path)
        stack = [os.dup(self._root_fd)]   # descriptors of the directories from the root down
        links = 0
        try:
            while parts:
                name = parts.pop(0)
                if name == "..":   # only from a symlink's target: a user's '..' was refused above
                    if len(stack) == 1:
                        raise StdError(Status.NOT_PERMITTED, f"path {path!r} leads outside the files root (symlink)")
                    os.close(stack.pop())
                    continue
                try:
                    if not parts:
                        return os.open(name, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o644, dir_fd=stack[-1])
                    stack.append(os.open(name, _DIR_FLAGS, dir_fd=stack[-1]))
                    continue
                except OSError as e:   # ELOOP (O_NOFOLLOW on a link) or ENOTDIR (O_DIRECTORY on one)
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    try:
                        target = os.readlink(name, dir_fd=stack[-1])
                    except OSError:
                        raise e from None   # not a symlink after all: the original error stands
                links += 1
                if links > MAX_SYMLINKS:
                    raise StdError(Status.NOT_PERMITTED,
                                   f"path {path!r} goes through more than {MAX_SYMLINKS} symlinks")
                absolute = self._beneath(target, path)
                if absolute is not None:
                    for fd in stack[1:]:
                        os.close(fd)
                    del stack[1:]
                parts = (absolute if absolute is not None else
                         [p for p in target.split("/") if p not in ("", ".")]) + parts
            raise StdError(Status.NOT_PERMITTED, f"path {path!r} names a directory, not a file")
        finally:
            for fd in stack:
                os.close(fd)

    def open(self, path: str, mode: int) -> int:
        if mode not in _FLAGS:
            raise StdError(Status.BAD_ARGUMENT, f"open mode {mode}: use OpenMode.READ, WRITE or APPEND")
        if self.read_only and mode != OpenMode.READ:
            raise StdError(Status.NOT_PERMITTED, f"cannot open {path!r} for writing: the files are read-only")
        try:
            os_fd = self._open_beneath(path, _FLAGS[OpenMode(mode)])
        except FileNotFoundError as e:
            raise StdError(Status.IO_ERROR, f"no such file {path!r}") from e
        except OSError as e:
            raise StdError(Status.IO_ERROR, f"cannot open {path!r}: {e.strerror}") from e
        try:
            self._check_opened(os_fd, path, mode)
        except BaseException:
            os.close(os_fd)
            raise
        with self._lock:
            if len(self._open) >= self.max_open:
                os.close(os_fd)
                raise StdError(Status.TOO_MANY_FILES, f"{self.max_open} files already open; close some")
            fd = self._next_fd
            self._next_fd += 1
            self._open[fd] = os_fd
        return fd

    def _check_opened(self, os_fd: int, path: str, mode: int) -> None:
        """Refuse what is not a regular file, or a hard-linked one for writing; then truncate (WRITE)."""
        st = os.fstat(os_fd)
        if not stat.S_ISREG(st.st_mode):
            raise StdError(Status.NOT_PERMITTED, f"path {path!r} is {_kind(st.st_mode)}; only regular files open")
        if mode != OpenMode.READ and st.st_nlink > 1:
            raise StdError(Status.NOT_PERMITTED, f"path {path!r} has {st.st_nlink} hard links, which may lead "
                                                 f"outside the files root; write to a file with one link")
        if mode == OpenMode.WRITE:
            os.ftruncate(os_fd, 0)
        os.set_blocking(os_fd, True)

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
