"""Train the embedded `--model tiny`: a small Llama trained on the Python standard library's source.

Every machine with Python has this text, so the model can be rebuilt anywhere without a download.
The result is a standard Hugging Face Llama directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) that the engine loads like any other model.

    nice -n 10 python scripts/train_tiny.py --out warploop/llm/tiny   # defaults: the shipped run (~46 min, 2 cores)
    python scripts/train_tiny.py --device cuda --out warploop/llm/tiny  # the same run on a GPU (~1 min)
    python scripts/train_tiny.py --steps 20 --out /tmp/tiny-smoke     # quick smoke run

The data order and hyperparameters do not depend on the device; the result does depend on the Python
version (its stdlib is the data) and, in its last bits, on the device's numerics.
See docs/tiny-model.md for the shipped run's figures.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import pathlib
import random
import sysconfig
import time

BOS, EOS, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [BOS, EOS, IM_START, IM_END]

# Llama-3 conventions: the template writes the BOS itself, so callers encode its output without
# adding special tokens; plain `encode` adds the BOS through the tokenizer's post-processor.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Packages left out: tests and data-like modules (codec tables, generated topics) are not the
# Python we want the model to imitate; site-packages differs between machines.
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "pydoc_data", "turtledemo",
             "tkinter", "ensurepip", "__pycache__"}
MAX_FILE_BYTES = 200_000
CHAT_FUNC_MAX_CHARS = 1500


def collect_sources(stdlib: pathlib.Path) -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib's .py files, sorted so that every run sees the same order."""
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if SKIP_DIRS.intersection(rel.parts) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append((rel.as_posix(), path.read_text(encoding="utf-8", errors="replace")))
    if not out:
        raise SystemExit(f"no .py files under {stdlib}; pass --stdlib DIR pointing at a Python stdlib")
    return out


def render_chat(messages: list[dict]) -> str:
    """The chat template rendered the way jinja renders CHAT_TEMPLATE (kept in step by a test)."""
    body = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return BOS + body + f"{IM_START}assistant\n"


def chat_examples(text: str) -> list[str]:
    """Teach the chat format: 'write function X' answered by the module-level function X, then <|im_end|>."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        source = ast.get_source_segment(text, node)
        if not source or len(source) > CHAT_FUNC_MAX_CHARS:
            continue
        doc = (ast.get_docstring(node) or "").strip().splitlines()
        ask = f"Write a Python function named {node.name}." + (f" {doc[0]}" if doc else "")
        out.append(render_chat([{"role": "user", "content": ask}]) + source + IM_END + "\n")
    return out


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # A space joins the word before it ("import ", "def "), not the one after as in GPT-2, so that
    # prompts ending in a space ("import ", "x = ") split the way the training text did.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[\p{L}\p{N}_]+ ?|[^\s\p{L}\p{N}_]+ ?|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]),
    ])
    return tok


def encode_docs(tok, docs: list[str]):
    """One flat stream: each raw file is BOS + text + EOS; chat docs carry their own BOS."""
    import torch

    ids: list[int] = []
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    for enc, doc in zip(tok.encode_batch(docs, add_special_tokens=False), docs, strict=True):
        ids.extend(enc.ids if doc.startswith(BOS) else [bos, *enc.ids, eos])
    return torch.tensor(ids, dtype=torch.long)


def make_model(args, vocab_size: int, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.ctx, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS), eos_token_id=[tok.token_to_id(EOS), tok.token_to_id(IM_END)],
        pad_token_id=tok.token_to_id(EOS),
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def batch(stream, ctx: int, size: int, gen, device: str):
    """Random windows drawn by a CPU generator, so the data order is the same on every device."""
    import torch

    starts = torch.randint(0, len(stream) - ctx - 1, (size,), generator=gen)
    x = torch.stack([stream[s:s + ctx + 1] for s in starts.tolist()]).to(device)
    return x[:, :-1], x[:, 1:]


def autocast(args):
    """bf16 matmuls with fp32 master weights: 1.5x faster on CPUs with AVX512-BF16 or AMX."""
    import torch

    return torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.amp)


def evaluate(model, stream, args) -> float:
    import torch

    gen = torch.Generator().manual_seed(1234)  # the same held-out windows every time
    model.eval()
    with torch.no_grad():
        losses = []
        for _ in range(args.eval_batches):
            x, y = batch(stream, args.ctx, args.batch, gen, args.device)
            with autocast(args):
                logits = model(input_ids=x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def train(model, train_stream, val_stream, args) -> dict:
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    t0 = time.time()
    smooth = None
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = batch(train_stream, args.ctx, args.batch, gen, args.device)
        with autocast(args):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.9 * smooth + 0.1 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t0
            eta = el / (step + 1) * (args.steps - step - 1)
            tps = (step + 1) * args.batch * args.ctx / el
            print(f"step {step:5d}/{args.steps}  loss {smooth:.3f}  lr {lr_at(step, args):.2e}  "
                  f"{tps:,.0f} tok/s  elapsed {el / 60:.1f} min  eta {eta / 60:.1f} min", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            print(f"step {step:5d}  val loss {evaluate(model, val_stream, args):.3f}", flush=True)
    return {"train_loss": round(smooth, 4), "val_loss": round(evaluate(model, val_stream, args), 4),
            "train_minutes": round((time.time() - t0) / 60, 2)}


def save(model, tok, out: pathlib.Path, dtype: str) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.to("cpu", getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    # Written by hand so that transformers 4.x and 5.x both read it (PreTrainedTokenizerFast).
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "add_bos_token": True, "add_eos_token": False, "model_max_length": model.config.max_position_embeddings,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")


def show_samples(out: pathlib.Path, prompts: list[str]) -> None:
    """Load the saved directory the way a user would, and print greedy and sampled continuations."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt", add_special_tokens=not prompt.startswith(BOS)).input_ids
        for label, kw in (("greedy", {"do_sample": False}), ("T=0.8", {"do_sample": True, "temperature": 0.8})):
            torch.manual_seed(0)
            gen = model.generate(ids, max_new_tokens=80, top_k=0, top_p=1.0, **kw)
            text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
            print(f"--- {label} | {prompt!r}\n{prompt}{text}\n", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("warploop/llm/tiny"))
    p.add_argument("--stdlib", type=pathlib.Path, default=pathlib.Path(sysconfig.get_paths()["stdlib"]))
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=512, help="training window = max_position_embeddings")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it slightly)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda gives the same data order and hyperparameters, with GPU numerics")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=8)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t0 = time.time()
    files = collect_sources(args.stdlib)
    # Every 25th file is held out, so the validation loss measures Python the model has not seen.
    train_files = [t for i, (_, t) in enumerate(files) if i % 25]
    val_files = [t for i, (_, t) in enumerate(files) if i % 25 == 0]
    chats = [c for t in train_files for c in chat_examples(t)]
    tok = train_tokenizer(train_files, args.vocab)
    train_stream = encode_docs(tok, train_files + chats)
    val_stream = encode_docs(tok, val_files)
    print(f"{len(files)} files ({sum(map(len, train_files)) / 1e6:.1f} MB train), {len(chats)} chat examples; "
          f"tokens: {len(train_stream):,} train, {len(val_stream):,} val; setup {time.time() - t0:.0f} s", flush=True)
    model = make_model(args, tok.get_vocab_size(), tok).to(args.device)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    stats = train(model, train_stream, val_stream, args)
    stats["train_tokens_seen"] = args.steps * args.batch * args.ctx
    save(model, tok, args.out, args.dtype)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(json.dumps({**stats, "dir_bytes": size}), flush=True)
    show_samples(args.out, ["import ", "def ", "class ", render_chat([{"role": "user", "content":
                 "Write a Python function named escape."}])])


if __name__ == "__main__":
    main()
