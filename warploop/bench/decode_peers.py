"""The two peers of `warploop bench decode`, measured the same way as the engine.

- HF transformers eager: what a user gets from `model.generate`. Decode time is the difference
  between generating n + 1 tokens and 1 token, so prefill stays out of the per-token figure.
- gpt-fast style: a minimal Llama (q/k norm for Qwen3 shapes) with a static KV cache, its decode step compiled with
  torch.compile(mode="reduce-overhead") (CUDA graphs), one static compile per batch size; prefill
  compiled separately without CUDA graphs, as gpt-fast does.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from warploop.llm.config import ModelConfig
from warploop.llm.rope import cos_sin_table

HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def hf_config(cfg: ModelConfig):
    import transformers

    rope = {"rope_type": cfg.rope.rope_type, "rope_theta": cfg.rope.theta}
    if cfg.rope.rope_type == "llama3":
        rope.update(factor=cfg.rope.factor, low_freq_factor=cfg.rope.low_freq_factor,
                    high_freq_factor=cfg.rope.high_freq_factor,
                    original_max_position_embeddings=cfg.rope.original_max_position_embeddings)
    extra = {"attention_bias": cfg.o_bias} if cfg.family != "qwen2" else {}
    return getattr(transformers, HF_CLASSES[cfg.family][0])(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters=rope, bos_token_id=0, eos_token_id=1,
        pad_token_id=0, **extra)


def hf_model(cfg: ModelConfig, device, dtype):
    import transformers

    # seeded: the same random weights every run, so the check against transformers (greedy tokens
    # on nearly flat random logits) compares run to run
    with torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(0)
        with torch.device(device):
            model = getattr(transformers, HF_CLASSES[cfg.family][1])(hf_config(cfg))
    return model.to(dtype).eval()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate_s(model, prompts: torch.Tensor, new_tokens: int) -> float:
    with torch.no_grad():
        _sync(prompts.device)
        t0 = time.perf_counter()
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
        _sync(prompts.device)
        return time.perf_counter() - t0


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.wqkv = nn.Linear(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=False)
        self.wo = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.w13 = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.n1, self.n2 = nn.RMSNorm(d, eps=cfg.rms_norm_eps), nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        # Qwen3: RMSNorm over head_dim on q and k before RoPE
        self.qn = nn.RMSNorm(hd, eps=cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.kn = nn.RMSNorm(hd, eps=cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, pos, mask):
        c, hd = self.cfg, self.cfg.head_dim
        b, t, _ = x.shape
        q, k, v = self.wqkv(self.n1(x)).split([c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], -1)
        q = self.qn(q.view(b, t, c.num_heads, hd)).transpose(1, 2)
        k = self.kn(k.view(b, t, c.num_kv_heads, hd)).transpose(1, 2)
        v = v.view(b, t, c.num_kv_heads, hd).transpose(1, 2)

        def rope(u):
            u1, u2 = u[..., : hd // 2], u[..., hd // 2:]
            return torch.cat([u1 * cos - u2 * sin, u2 * cos + u1 * sin], -1)

        q, k = rope(q), rope(k)
        self.kc.index_copy_(2, pos, k)
        self.vc.index_copy_(2, pos, v)
        o = F.scaled_dot_product_attention(q, self.kc, self.vc, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, c.num_heads * hd))
        g, u = self.w13(self.n2(x)).chunk(2, -1)
        return x + self.w2(F.silu(g) * u)


class GptFastLlama(nn.Module):
    """Static-cache Llama after gpt-fast (and shared/probes/gptfast_baseline.py)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def setup_caches(self, batch: int, max_len: int) -> None:
        """Registered buffers, as in gpt-fast: CUDA graphs treat them as static and may mutate them.
        Kept when the shape is unchanged, so a repeat run replays the graphs already recorded."""
        c, p = self.cfg, self.emb.weight
        shape = (batch, c.num_kv_heads, max_len, c.head_dim)
        if getattr(self.layers[0], "kc", None) is not None and tuple(self.layers[0].kc.shape) == shape:
            return
        for layer in self.layers:
            layer.register_buffer("kc", torch.zeros(shape, dtype=p.dtype, device=p.device), persistent=False)
            layer.register_buffer("vc", torch.zeros(shape, dtype=p.dtype, device=p.device), persistent=False)
        cos, sin = cos_sin_table(c.rope, c.head_dim, max_len, p.device)
        self.register_buffer("cos", cos.to(p.dtype), persistent=False)
        self.register_buffer("sin", sin.to(p.dtype), persistent=False)
        causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=p.device))
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, idx, pos):
        x = self.emb(idx)
        cos, sin, mask = self.cos[pos][None, None], self.sin[pos][None, None], self.causal[pos][None, None]
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return F.linear(self.norm(x), self.emb.weight)


def gptfast_model(cfg: ModelConfig, device, dtype) -> GptFastLlama:
    with torch.device(device):
        model = GptFastLlama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


class CompiledDecoder:
    """One static compile per batch size for decode (CUDA graphs), one for the 1,024-token prefill.
    The compiled functions close over the model, as in the probe that measured 1.29 ms/token."""

    def __init__(self, model: GptFastLlama, use_cuda_graphs: bool) -> None:
        self.model = model

        def decode_token(tok, pos):
            return model(tok, pos)[:, -1].argmax(-1, keepdim=True)

        def prefill_token(tok, pos):  # a separate function, so a separate compile cache
            return model(tok, pos)[:, -1].argmax(-1, keepdim=True)

        self.eager = decode_token
        self.step = torch.compile(decode_token, mode="reduce-overhead" if use_cuda_graphs else None,
                                  fullgraph=True, dynamic=False)
        self.prefill = torch.compile(prefill_token, fullgraph=True, dynamic=False)

    def decode_s(self, prompts: torch.Tensor, steps: int, max_len: int) -> float:
        """Seconds for `steps` decode steps after an (eager, untimed) prefill of `prompts` [batch, n]."""
        device = prompts.device
        with torch.no_grad():
            self.model.setup_caches(prompts.shape[0], max_len)
            n = prompts.shape[1]
            tok = self.eager(prompts, torch.arange(n, device=device))
            positions = [torch.tensor([n + i], device=device) for i in range(steps)]
            _sync(device)
            t0 = time.perf_counter()
            for pos in positions:
                tok = self.step(tok, pos).clone()
            _sync(device)
            return time.perf_counter() - t0

    def ttft_s(self, prompt: torch.Tensor, max_len: int) -> float:
        device = prompt.device
        with torch.no_grad():
            self.model.setup_caches(1, max_len)
            positions = torch.arange(prompt.shape[1], device=device)
            _sync(device)
            t0 = time.perf_counter()
            self.prefill(prompt, positions).item()
            return time.perf_counter() - t0
