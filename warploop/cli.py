"""The `warploop` command. Each subcommand lives in its own module, imported only when used,
so `warploop info` never pays for torch or Triton and `warploop serve` never pays for the compiler.

A command module provides `add_arguments(parser)` and `main(args) -> int | None`.

Errors reach the user as one line that names the flag or variable to change; `--debug` (anywhere on
the line) or WARPLOOP_DEBUG=1 shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from warploop.args import positive_int  # noqa: F401  (re-exported: warploop.llm.server_cli takes it from here)

# name -> (module, one-line help). Nested commands use a space: "bundle build".
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("warploop.commands.info", "show the devices warploop sees and the one it would use"),
    "bundle build": ("warploop.bundle.cli", "compile every exported kernel of a file for many targets"),
    "bundle inspect": ("warploop.bundle.cli", "list the kernels and variants in a bundle file"),
    "generate": ("warploop.llm.cli", "generate text with a model (default: the embedded tiny model)"),
    "serve": ("warploop.llm.server_cli", "serve a model over an OpenAI-compatible HTTP API"),
    "bench bundle": ("warploop.bench.bundle", "cold start and launch overhead of bundles vs Triton JIT"),
    "bench runtime": ("warploop.bench.runtime", "resident runtime: hop latency, throughput, MLP stack"),
    "bench hostcall": ("warploop.bench.hostcall", "GPU->host calls: round trip, throughput, print, files"),
    "bench decode": ("warploop.bench.decode", "LLM decode speed vs HF transformers and torch.compile"),
    "bench prefill": ("warploop.bench.prefill", "LLM prefill speed vs torch.compile; streams' latency while a long "
                      "prompt arrives"),
    "bench stream": ("warploop.bench.stream", "streaming executor (Hopper): weight stream vs floor, stage latency"),
}


def _module_handler(module_name: str, command: str):
    module = importlib.import_module(module_name)
    suffix = command.split(" ")[-1]
    add = getattr(module, f"add_{suffix}_arguments", None) or module.add_arguments
    run = getattr(module, f"main_{suffix}", None) or module.main
    return add, run


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at --help, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = OneLineParser(
        prog="warploop",
        description="GPU-native Python: ahead-of-time kernel bundles, a resident GPU runtime, "
                    "and an LLM engine. Set WARPLOOP_DEVICE=cpu|cuda|hip to force a backend.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also WARPLOOP_DEBUG=1)")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    groups: dict[str, argparse._SubParsersAction] = {}
    handlers = {}
    for name, (module_name, help_text) in COMMANDS.items():
        parts = name.split(" ")
        if len(parts) == 2:
            if parts[0] not in groups:
                group_parser = top.add_parser(parts[0], help=f"{parts[0]} commands")
                groups[parts[0]] = group_parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND",
                                                               parser_class=OneLineParser)
            sub = groups[parts[0]].add_parser(parts[1], help=help_text, description=help_text)
        else:
            sub = top.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_command=name)
        handlers[name] = (module_name, sub)
    return parser, handlers


def _debug_wanted(argv: list[str]) -> bool:
    from warploop import config

    return "--debug" in argv or config.debug_wanted()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = _debug_wanted(argv)
    argv = [a for a in argv if a != "--debug"]
    parser, handlers = build_parser()
    # Let the chosen subcommand's module add its own arguments before the real parse.
    # (without -h, which would print the help before those arguments exist)
    known, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    name = getattr(known, "_command", None)
    if name is None:
        parser.parse_args(argv)  # no command chosen: prints the help asked for, or the usage error
        parser.print_help()
        return 0 if not argv else 2
    module_name, sub = handlers[name]
    add, run = _module_handler(module_name, name)
    add(sub)
    args = parser.parse_args(argv)
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every failure a user can cause ends here as one line
        if debug:
            raise
        print(f"warploop {name}: error: {one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 1


def one_line(e: BaseException) -> str:
    """The exception as one line: the message alone for the errors user input raises (ValueError, OSError,
    RuntimeError and their kin), prefixed with the type for the rest, whose bare message (a KeyError's
    'x') says little."""
    text = " ".join(str(e).split())
    plain = isinstance(e, (ValueError, OSError, RuntimeError)) and not isinstance(e, UnicodeError)
    return text if text and plain else f"{type(e).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
