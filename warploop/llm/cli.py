"""`warploop generate`: one prompt through the engine, text streamed to stdout (or one JSON object)."""
from __future__ import annotations

import argparse
import json
import re
import sys

from warploop.args import positive_int
from warploop.llm.build import BACKEND_HELP, BACKENDS


def flag_error(e: Exception) -> str:
    """SamplingParams and the loaders name their Python fields; the user typed flags."""
    text = str(e)
    field = getattr(e, "field", None)      # SamplingParamsError: the message starts with the field's name
    if field and text.startswith(field):
        text = "--" + field.replace("_", "-") + text[len(field):]
    return re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), text)


def device_error(device: str | None) -> str | None:
    """One line naming --device or WARPLOOP_DEVICE when the backend asked for has no device here."""
    from warploop.target import DeviceNotFoundError, select_device

    try:
        select_device(device)
    except DeviceNotFoundError as e:
        if e.from_env:
            return str(e)
        return f"--device {device}: {e.reason}; pass --device cpu, or leave --device out to use what is found"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (the embedded model, the default), a Hugging Face-format directory, "
                             "or a .gguf file (or a directory holding one)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="most tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of tokens whose probability reaches this (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0 = off)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than this times the likeliest one's probability (0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="tokens already seen: positive logits divided by this, negative ones multiplied "
                             "(transformers' rule; 1 = off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="the sampler's seed: the same seed and prompt give the same tokens (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat for more)")
    parser.add_argument("--device", choices=("cpu", "cuda", "hip"), default=None,
                        help="default: WARPLOOP_DEVICE, else the first GPU, else the CPU")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="default: the model's own")
    parser.add_argument("--backend", choices=BACKENDS, default=None, help=BACKEND_HELP)
    parser.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                        help="split the model over N GPUs (N processes on the CPU); default 1. Runs per op, or with "
                             "--backend stream decodes on each rank's streaming kernel (docs/parallel.md)")
    parser.add_argument("--json", action="store_true",
                        help='print {"text", "token_ids", "ttft_ms", "ms_per_token", "backend"} instead of streaming')


def main(args: argparse.Namespace) -> int:
    from warploop.llm.engine import Engine, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                                repetition_penalty=args.repetition_penalty, stop=args.stop)
    except ValueError as e:
        print(f"warploop generate: error: {flag_error(e)}", file=sys.stderr)
        return 2
    problem = device_error(args.device)
    if problem:
        print(f"warploop generate: error: {problem}", file=sys.stderr)
        return 2
    try:
        engine = Engine.from_model(args.model, device=args.device, dtype=args.dtype, max_num_seqs=1,
                                   backend=args.backend, progress=not args.json and sys.stderr.isatty(),
                                   tensor_parallel=args.tensor_parallel)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"warploop generate: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.chat and engine.tokenizer.chat_template is None:
            print(f"warploop generate: error: --chat: {args.model} has no chat template; drop --chat",
                  file=sys.stderr)
            return 2
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat \
            else args.prompt
        ids = engine.tokenizer.encode(text)
        if args.json:
            out = engine.generate(ids, params)
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "ttft_ms": round(out.ttft_ms, 3),
                              "ms_per_token": round(out.ms_per_token, 3), "backend": engine.backend.name}))
            return 0 if out.error is None else 1
        for event in engine.stream(ids, params):
            sys.stdout.write(event.text_delta)
            sys.stdout.flush()
            if event.error:
                print(f"\nwarploop generate: error: {event.error}", file=sys.stderr)
                return 1
        sys.stdout.write("\n")
        return 0
    except ValueError as e:  # prompt too long for the context (--max-tokens), no chat template, ...
        print(f"warploop generate: error: {flag_error(e)}", file=sys.stderr)
        return 2
    finally:
        engine.close()
