"""The streaming program's weight pools: every matrix of a model in bfloat16, packed into one pool
per input width, in the order the program records them (llm/stream_step.py), so one TMA
descriptor a width serves every GEMV of that width. The per-op backend can read the same pools
(share=True): one copy of the model on the device, not two."""
from __future__ import annotations

import dataclasses

from warploop.llm.weights import ModelWeights

MATRICES = ("qkv", "o", "gate_up", "down")       # a layer's matrices, in the order the program records them


@dataclasses.dataclass
class Packed:
    pools: dict                        # input width -> bf16 [rows, width] pool
    at: list                           # (width, first row) of each matrix, in recording order
    copied_bytes: int                  # bytes of matrices the pools copy rather than replace


def pack_pools(weights: ModelWeights, device, share: bool = False) -> Packed:
    """Every matrix in bfloat16, packed into one pool per input width (each layer's qkv, o, gate_up
    [gate; up] and down, then lm_head). share: each matrix of `weights` already bfloat16 on `device`
    becomes a view of its pool (a per-op backend over the same weights then reads the pools: one copy
    of the model, not two), the tied embedding too; what could not be shared is counted in
    copied_bytes (the memory a caller sets aside for the copy)."""
    import torch
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:    # "cuda" is the current device: compare as cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    owners = [(lw, name) for lw in weights.layers for name in MATRICES] + [(weights, "lm_head")]
    tied = weights.embed is weights.lm_head
    rows, at = {}, []
    for owner, name in owners:
        m = getattr(owner, name)
        at.append((m.shape[1], rows.get(m.shape[1], 0)))
        rows[m.shape[1]] = rows.get(m.shape[1], 0) + m.shape[0]
    pools = {k: torch.empty(n, k, dtype=torch.bfloat16, device=device) for k, n in rows.items()}
    copied = 0
    for (owner, name), (k, row) in zip(owners, at, strict=True):
        m = getattr(owner, name)
        view = pools[k][row:row + m.shape[0]]
        view.copy_(m.detach())
        if share and m.dtype == torch.bfloat16 and m.device == device:
            setattr(owner, name, view)           # the original is freed once nothing else holds it
        else:
            copied += view.numel() * 2
    if share and tied and weights.lm_head.device == device and weights.lm_head.dtype == torch.bfloat16:
        weights.embed = weights.lm_head
    return Packed(pools, at, copied)
