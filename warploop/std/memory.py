"""Moving file bytes to and from the buffers device code names by raw pointer.

A READ or WRITE request carries a bare address. The host only touches memory inside tensors
registered here (the runtime registers the buffers it hands to tasks), so a wrong pointer from
device code is an error status, not a corrupted process.

Host (CPU or pinned) buffers are read into directly. GPU buffers go through preallocated pinned
staging lanes, each with its own non-blocking stream: the file is read into one half of a lane
while the other half is copied to the GPU. Non-blocking streams never wait for the resident kernel
(which never ends), and nothing is allocated on the GPU while it runs.
"""
from __future__ import annotations

import bisect
import queue
import threading

from warploop.std.files import FileTable
from warploop.std.protocol import Status, StdError


class _Lane:
    """One stream and two pinned staging buffers: read into one while the other is copied."""

    def __init__(self, torch, nbytes: int, device) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.events = [torch.cuda.Event() for _ in range(2)]
        for e in self.events:
            e.record(self.stream)


class Buffers:
    """Registered tensors, found by address; copies between them and files."""

    def __init__(self, staging_lanes: int = 4, staging_bytes: int = 8 << 20) -> None:
        self.staging_lanes = staging_lanes
        self.staging_bytes = staging_bytes
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._tensors: list = []
        self._lanes: queue.Queue[_Lane] | None = None

    def register(self, tensor) -> None:
        """Allow file calls to read into and write from `tensor` (kept alive while registered)."""
        if not tensor.is_contiguous():
            raise ValueError("register a contiguous tensor: file calls copy flat byte ranges")
        with self._lock:
            i = bisect.bisect(self._starts, tensor.data_ptr())
            self._starts.insert(i, tensor.data_ptr())
            self._tensors.insert(i, tensor)
        if tensor.is_cuda and self._lanes is None:
            self.prepare(tensor.device)

    def unregister(self, tensor) -> None:
        with self._lock:
            for i, t in enumerate(self._tensors):
                if t is tensor:
                    del self._starts[i], self._tensors[i]
                    return
        raise ValueError("that tensor is not registered")

    def prepare(self, device) -> None:
        """Allocate the staging lanes now, before the resident kernel starts."""
        import torch

        with self._lock:
            if self._lanes is None:
                lanes: queue.Queue[_Lane] = queue.Queue()
                for _ in range(self.staging_lanes):
                    lanes.put(_Lane(torch, self.staging_bytes, device))
                self._lanes = lanes

    def locate(self, ptr: int, nbytes: int):
        """The registered bytes [ptr, ptr + nbytes) as a flat uint8 tensor view."""
        import torch

        if nbytes < 0:
            raise StdError(Status.BAD_ARGUMENT, f"byte count {nbytes} is negative")
        with self._lock:
            i = bisect.bisect(self._starts, ptr) - 1
            tensor = self._tensors[i] if i >= 0 else None
        if tensor is not None:
            flat = tensor.reshape(-1).view(torch.uint8)
            start = ptr - tensor.data_ptr()
            if start + nbytes <= flat.numel():
                return flat[start:start + nbytes]
        raise StdError(Status.BAD_ARGUMENT,
                       f"[{ptr:#x}, +{nbytes}) is not inside a registered buffer; register the tensor first")

    def read_file(self, files: FileTable, fd: int, ptr: int, nbytes: int, offset: int) -> int:
        dst = self.locate(ptr, nbytes)
        if not dst.is_cuda:
            return files.read_into(fd, memoryview(dst.numpy()), offset)
        lane = self._take_lane()
        done, k = 0, 0
        try:
            while done < nbytes:
                half = k % 2
                lane.events[half].synchronize()   # its previous copy has left the staging buffer
                want = min(self.staging_bytes, nbytes - done)
                got = files.read_into(fd, lane.views[half][:want], offset + done)
                if got:
                    with _stream(lane.stream):
                        dst[done:done + got].copy_(lane.buffers[half][:got], non_blocking=True)
                        lane.events[half].record(lane.stream)
                done += got
                k += 1
                if got < want:
                    break
            lane.stream.synchronize()
        finally:
            self._lanes.put(lane)
        return done

    def write_file(self, files: FileTable, fd: int, ptr: int, nbytes: int) -> int:
        src = self.locate(ptr, nbytes)
        if not src.is_cuda:
            return files.write_from(fd, memoryview(src.numpy()))
        lane = self._take_lane()
        done = 0
        try:
            while done < nbytes:
                n = min(self.staging_bytes, nbytes - done)
                with _stream(lane.stream):
                    lane.buffers[0][:n].copy_(src[done:done + n], non_blocking=True)
                lane.stream.synchronize()
                done += files.write_from(fd, lane.views[0][:n])
        finally:
            self._lanes.put(lane)
        return done

    def _take_lane(self) -> _Lane:
        if self._lanes is None:
            raise StdError(Status.IO_ERROR, "no staging lanes: call Buffers.prepare() before the kernel starts")
        return self._lanes.get()


def _stream(stream):
    import torch

    return torch.cuda.stream(stream)
