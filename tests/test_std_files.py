"""File calls are confined: no root means no files; `..`, absolute paths and symlinks out are
refused; read-only refuses writes; bad fds, short reads and pointers outside registered buffers
come back as statuses."""
from __future__ import annotations

import os

import pytest
import torch

from warploop.std.files import FileTable
from warploop.std.memory import Buffers
from warploop.std.protocol import OpenMode, Status, StdError


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"0123456789")
    (root / "sub" / "b.txt").write_bytes(b"bee")
    (tmp_path / "secret.txt").write_bytes(b"secret")
    os.symlink(tmp_path / "secret.txt", root / "out_link")
    os.symlink(tmp_path, root / "out_dir")
    os.symlink(root / "sub" / "b.txt", root / "in_link")
    return root


def status_of(fn, *args) -> Status:
    with pytest.raises(StdError) as info:
        fn(*args)
    return info.value.status


def test_no_root_allows_nothing(tree):
    files = FileTable()
    assert status_of(files.open, "a.txt", OpenMode.READ) == Status.NOT_PERMITTED


@pytest.mark.parametrize("path", ["../secret.txt", "sub/../../secret.txt", "sub/../a.txt", "/etc/passwd",
                                  "out_link", "out_dir/secret.txt", ""])
def test_escapes_are_refused(tree, path):
    assert status_of(FileTable(tree).open, path, OpenMode.READ) == Status.NOT_PERMITTED


def test_reads_inside_the_root_including_links_that_stay_inside(tree):
    files = FileTable(tree)
    buf = bytearray(16)
    fd = files.open("in_link", OpenMode.READ)
    assert files.read_into(fd, memoryview(buf), 0) == 3 and bytes(buf[:3]) == b"bee"
    fd2 = files.open("sub/b.txt", OpenMode.READ)
    assert fd2 != fd and fd2 >= 3
    files.close(fd)
    files.close(fd2)


def test_read_only_refuses_writes(tree):
    files = FileTable(tree, read_only=True)
    for mode in (OpenMode.WRITE, OpenMode.APPEND):
        assert status_of(files.open, "new.txt", mode) == Status.NOT_PERMITTED
    assert not (tree / "new.txt").exists()
    assert status_of(files.open, "a.txt", 7) == Status.BAD_ARGUMENT


def test_write_append_and_errors(tree):
    files = FileTable(tree, max_open=2)
    fd = files.open("new.txt", OpenMode.WRITE)
    assert files.write_from(fd, memoryview(b"abc")) == 3
    files.close(fd)
    fd = files.open("new.txt", OpenMode.APPEND)
    files.write_from(fd, memoryview(b"def"))
    assert (tree / "new.txt").read_bytes() == b"abcdef"
    files.open("a.txt", OpenMode.READ)
    assert status_of(files.open, "a.txt", OpenMode.READ) == Status.TOO_MANY_FILES
    assert status_of(files.open, "missing.txt", OpenMode.READ) == Status.IO_ERROR
    files.close(fd)
    assert status_of(files.close, fd) == Status.BAD_FD
    assert status_of(files.read_into, 99, memoryview(bytearray(1)), 0) == Status.BAD_FD
    files.close_all()


def test_root_must_exist(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        FileTable(tmp_path / "nope")


def test_buffers_copy_only_inside_registered_tensors(tree):
    files = FileTable(tree)
    buffers = Buffers()
    t = torch.zeros(8, dtype=torch.uint8)
    buffers.register(t)
    fd = files.open("a.txt", OpenMode.READ)
    assert buffers.read_file(files, fd, t.data_ptr() + 2, 4, 3) == 4
    assert bytes(t.tolist()) == b"\0\x003456\0\0"
    assert buffers.read_file(files, fd, t.data_ptr(), 8, 6) == 4       # short: the file ends
    for ptr, n in ((t.data_ptr() + 4, 8), (t.data_ptr() - 1, 1), (12345, 1), (t.data_ptr(), -1)):
        assert status_of(buffers.read_file, files, fd, ptr, n, 0) == Status.BAD_ARGUMENT
    wfd = files.open("copy.txt", OpenMode.WRITE)
    assert buffers.write_file(files, wfd, t.data_ptr(), 4) == 4
    files.close_all()
    assert (tree / "copy.txt").read_bytes() == b"6789"
    buffers.unregister(t)
    assert status_of(buffers.locate, t.data_ptr(), 1) == Status.BAD_ARGUMENT
