"""The `vlm-catalog` command line: one subcommand per front door or tool.

Each command module exposes `register(subparsers)`, which adds its parser and
sets `handler` to a function taking the parsed arguments and returning an exit
code. Only the module of the command that runs is imported: `vlm-catalog --help`
lists the commands from the table below, so it stays fast, and a command whose
module cannot be imported (an optional package missing) fails alone.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str  # registers the command's parser and handler
    summary: str  # its line in `vlm-catalog --help`


COMMANDS: dict[str, Command] = {
    "demo": Command("vlm_catalog.demo", "extract and score the shipped sample catalogue with the default model"),
    "extract": Command("vlm_catalog.extract.command",
                       "extract structured metadata for every record of a catalogue (resumable batch job)"),
    "make-catalog": Command("vlm_catalog.data.synthetic.command",
                            "generate a synthetic product catalogue (the columns of Shopify/product-catalogue)"),
    "eval": Command("vlm_catalog.evaluate.command", "score predictions with the benchmark's accuracy metric"),
    "check-parity": Command("vlm_catalog.model.command",
                            "compare our model's logits and greedy tokens with transformers on a checkpoint"),
    "serve": Command("vlm_catalog.server.command", "run the extraction service (REST + OpenAI-compatible API)"),
    "bench": Command("vlm_catalog.bench.command", "MLPerf LoadGen benchmark (Offline/Server) on the engine or a server"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line, with `only`'s parser in full (its module imported); the others as names."""
    parser = argparse.ArgumentParser(
        prog="vlm-catalog",
        description="Structured product metadata from images and text with Qwen3-VL-MoE models.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        if name == only:
            importlib.import_module(command.module).register(subparsers)
        else:
            subparsers.add_parser(name, help=command.summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only=command).parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
