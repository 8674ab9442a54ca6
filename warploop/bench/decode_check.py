"""The fidelity check `warploop bench decode` runs before timing a backend: its decode-step logits
and greedy tokens against HF transformers on the same weights, with transformers in float32 as the
reference (and transformers in the model's dtype as the peer the error is compared with)."""
from __future__ import annotations


def _decode_logits(backend, prompt: list[int], fed: list[int]):
    """float32 logits of the prompt's last token (a prefill) and then of one decode step per token
    of `fed`, each its own forward: the path a decode step takes (the megakernel's graph, the
    per-op backend's CUDA graph)."""
    import torch

    from warploop.llm.backend import ModelBatch

    bs = backend.layout.block_size
    table = list(range(-(-(len(prompt) + len(fed)) // bs)))
    n = len(prompt)
    rows = [backend.forward(ModelBatch(prompt, list(range(n)), [n], [n], [table])).float()[-1:].clone()]
    for i, tok in enumerate(fed):
        pos = n + i
        rows.append(backend.forward(ModelBatch([tok], [pos], [1], [pos + 1], [table])).float().clone())
    return torch.cat(rows)


def check_logits(engine, hf, hf32, prompt: list[int]) -> dict:
    """The backend against transformers on the same weights, both against transformers in float32
    (the reference): logits of the prompt's last token and of 8 decode steps fed the same tokens,
    and how many of 16 greedy tokens agree with transformers' in the same dtype."""
    import torch

    from warploop.llm.params import SamplingParams

    out = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).token_ids
    n = len(prompt)
    with torch.no_grad():
        ids = torch.tensor([prompt + out[:8]], device=hf.device)
        ref = hf32(ids).logits[0, n - 1:].float()
        theirs = hf(ids).logits[0, n - 1:].float()
        ref_tokens = hf.generate(ids[:, :n], attention_mask=torch.ones_like(ids[:, :n]), max_new_tokens=16,
                                 min_new_tokens=16, do_sample=False)[0, n:].tolist()
    # the engine is idle between requests: its pool's first blocks are free
    ours = _decode_logits(engine.backend, prompt, out[:8])

    def err(a, b):
        return round(((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item(), 5)

    agree = next((i for i, (a, b) in enumerate(zip(out, ref_tokens, strict=True)) if a != b), len(out))
    return {"rel_err_vs_fp32": err(ours, ref), "hf_same_dtype_rel_err_vs_fp32": err(theirs, ref),
            "rel_err_vs_hf_same_dtype": err(ours, theirs), "positions": ours.shape[0],
            "greedy_tokens_equal_to_transformers": agree, "of": len(out)}
