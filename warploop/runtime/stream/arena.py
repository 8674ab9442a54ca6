"""A streaming program's arenas: named regions of one dtype (the fp32 arena of activations, norms,
biases and tables; the int32 arena of step words), each starting at a multiple of ALIGN elements,
and the values they start with. program.py declares them; the executors and the reference read a
region's offset by name."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

ALIGN = 16                      # arena regions start at a multiple of 16 elements (64 B)


class Region(NamedTuple):
    offset: int
    size: int


@dataclasses.dataclass
class Space:
    """One arena: named regions of one dtype, each starting at a multiple of ALIGN elements, and the
    values they start with."""
    dtype: str
    what: str                                   # how errors name its regions
    regions: dict = dataclasses.field(default_factory=dict)
    inits: dict = dataclasses.field(default_factory=dict)
    size: int = 0

    def add(self, name: str, size: int, init=None) -> Region:
        if name in self.regions:
            raise ValueError(f"{self.what} {name!r} declared twice")
        if size <= 0:
            raise ValueError(f"{self.what} {name!r}: size must be positive, got {size}")
        if init is not None and int(np.prod(np.shape(init))) != size:
            raise ValueError(f"{self.what} {name!r}: init has {int(np.prod(np.shape(init)))} values, size is {size}")
        r = self.regions[name] = Region(self.size, size)
        self.size += -(-size // ALIGN) * ALIGN
        if init is not None:
            self.inits[name] = init
        return r

    def tensor(self, device="cpu"):
        """Zeros, with every region's init copied in."""
        import torch
        dtype = getattr(torch, self.dtype)
        a = torch.zeros(max(self.size, ALIGN), dtype=dtype, device=device)
        for name, init in self.inits.items():
            r = self.regions[name]
            a[r.offset:r.offset + r.size] = torch.as_tensor(init).reshape(-1).to(device=device, dtype=dtype)
        return a
