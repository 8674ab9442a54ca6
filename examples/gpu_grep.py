"""GPU-native grep: the device reads a directory of files through warploop.std file calls and
counts, on the device, the lines that contain a literal pattern (like `grep -c`, summed).

    python examples/gpu_grep.py PATTERN DIR

Each program of the kernel owns a share of the files. For each it opens the file (std.open, by
an interned path relative to DIR, which is the files root and read-only), reads it chunk by chunk
into its own device buffer (std.read), counts in blocks, prints one line per file with matches
(std.print, with a per-file format interned on the host), and closes it. The host prints a summary
and, on the last line, the number of matching lines. Runs on a GPU, or on the CPU under the Triton
interpreter (TRITON_INTERPRET=1 is set for you when no GPU is present).

Counting lines, not matches, in blocks: a match at position j is the first in its line when no
match starts between the line's start and j. With C the running count of match starts, that is
"C just before j equals C at the last newline before j"; both are prefix scans, carried from
block to block and chunk to chunk. Chunks overlap by len(PATTERN) - 1 bytes, so a match that
straddles two reads is seen once.
"""
from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

from warploop.std import FileTable, HostServer, allocate_ports, intern
from warploop.std import device as std

MAX_PATTERN = 64


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _count_block(buf, start, valid, got, pat, m, total, at_nl, BLOCK: tl.constexpr):
    """Lines whose first match starts in buf[start:start+BLOCK] at a position < valid, where the
    buffer holds `got` bytes; the new carries (match starts so far, match starts at the last newline)."""
    offs = start + tl.arange(0, BLOCK)
    live = offs < valid
    match = live & (offs + m <= got)
    k = 0
    while k < m:
        match = match & (tl.load(buf + offs + k, mask=match, other=0) == tl.load(pat + k))
        k += 1
    newline = live & (tl.load(buf + offs, mask=live, other=0) == 10)
    count = tl.cumsum(match.to(tl.int64), 0) + total                 # match starts <= j
    before = count - match.to(tl.int64)                             # match starts < j
    last_nl = tl.associative_scan(tl.where(newline, count, at_nl), 0, _max)
    firsts = tl.sum((match & (before == last_nl)).to(tl.int64), 0)
    return firsts, tl.max(count, 0), tl.max(last_nl, 0)


@triton.jit
def grep_kernel(ports, bufs, path_ids, fmt_ids, counts, nfiles, pat, m,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    port = std.port(ports, pid)
    buf = bufs + pid * CHUNK
    f = pid
    while f < nfiles:
        fd = std.open(port, tl.load(path_ids + f), std.O_READ)
        lines = tl.where(fd < 0, -1, 0).to(tl.int64)    # -1: the file could not be opened
        if fd >= 0:
            offset = tl.zeros((), tl.int64)
            total = tl.zeros((), tl.int64)
            at_nl = tl.zeros((), tl.int64)
            got = std.read(port, fd, buf, CHUNK, offset)
            while got > 0:
                # Positions whose whole window is in this chunk; the rest come again in the next one.
                valid = tl.where(got < CHUNK, got, got - m + 1)
                start = 0
                while start < valid:
                    firsts, total, at_nl = _count_block(buf, start, valid, got, pat, m, total, at_nl, BLOCK)
                    lines += firsts
                    start += BLOCK
                offset += valid
                if got < CHUNK:
                    got = got * 0
                else:
                    got = std.read(port, fd, buf, CHUNK, offset)
            std.close(port, fd)
            if lines > 0:
                std.print(port, tl.load(fmt_ids + f), lines)
        tl.store(counts + f, lines)
        f += tl.num_programs(0)


def list_files(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                out.append(os.path.relpath(path, root))
    return sorted(out)


def grep(pattern: str, root: str, programs: int | None = None, chunk: int = 1 << 16, out=None) -> int:
    """Count the lines under `root` that contain `pattern`, on the device; prints per-file lines."""
    data = pattern.encode()
    if not 0 < len(data) <= MAX_PATTERN or b"\n" in data:
        raise ValueError(f"the pattern must be 1-{MAX_PATTERN} bytes without a newline")
    if chunk < len(data):       # a read must advance past a window: a shorter chunk would read forever
        raise ValueError(f"chunk ({chunk} bytes) must hold the pattern ({len(data)} bytes)")
    files = list_files(root)
    if not files:
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if programs is None:
        programs = min(len(files), torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 2)
    ports = allocate_ports(programs)
    bufs = torch.empty(programs * chunk, dtype=torch.uint8, device=device)
    path_ids = torch.tensor([intern(f) for f in files], dtype=torch.int64, device=device)
    fmt_ids = torch.tensor([intern(f.replace("%", "%%") + ": %d") for f in files], dtype=torch.int64, device=device)
    counts = torch.zeros(len(files), dtype=torch.int64, device=device)
    pat = torch.tensor(list(data), dtype=torch.uint8, device=device)
    server = HostServer(ports, files=FileTable(root, read_only=True), out=out)
    server.buffers.register(bufs)
    with server:
        grep_kernel[(programs,)](ports, bufs, path_ids, fmt_ids, counts, len(files), pat, len(data),
                                 CHUNK=chunk, BLOCK=min(1024, triton.next_power_of_2(chunk)), num_warps=4)
        if device == "cuda":
            torch.cuda.synchronize()
    unreadable = int((counts < 0).sum())
    total = int(counts.clamp(min=0).sum())
    print(f"{total} matching lines in {int((counts > 0).sum())} of {len(files)} files"
          + (f" ({unreadable} unreadable)" if unreadable else "") + f", on {device}", file=out)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pattern", help="literal text (1-64 bytes, no newline)")
    parser.add_argument("dir", help="directory searched recursively; the device may read nothing else")
    parser.add_argument("--programs", type=int, default=None, help="kernel programs (default: one per SM)")
    parser.add_argument("--chunk", type=int, default=1 << 16, help="bytes per file read (default 64 KiB)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        parser.error(f"dir {args.dir!r}: not a directory (give the folder to search)")
    size = len(args.pattern.encode())
    if not 0 < size <= MAX_PATTERN or "\n" in args.pattern:
        parser.error(f"pattern: {size} bytes; it must be 1-{MAX_PATTERN} bytes without a newline")
    if args.programs is not None and args.programs < 1:
        parser.error(f"--programs {args.programs}: must be at least 1 (or left out: one per SM)")
    if args.chunk < size:
        parser.error(f"--chunk {args.chunk}: must be at least the pattern's {size} bytes (default 64 KiB)")
    total = grep(args.pattern, args.dir, programs=args.programs, chunk=args.chunk)
    print(total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
