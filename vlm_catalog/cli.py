"""The `vlm-catalog` command line: one subcommand per front door or tool.

Each command module exposes `register(subparsers)`, which adds its parser and
sets `handler` to a function taking the parsed arguments and returning an exit
code. Modules are imported only for the command that runs, so `--help` stays
fast and nothing heavy is imported at start-up.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that registers it
COMMAND_MODULES: dict[str, str] = {
    "demo": "vlm_catalog.demo",
    "extract": "vlm_catalog.extract.command",
    "make-catalog": "vlm_catalog.data.synthetic.command",
    "eval": "vlm_catalog.evaluate.command",
    "check-parity": "vlm_catalog.model.command",
    "serve": "vlm_catalog.server.command",
    "bench": "vlm_catalog.bench.command",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-catalog",
        description="Structured product metadata from images and text with Qwen3-VL-MoE models.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMAND_MODULES.items():
        if only is None or name == only:
            importlib.import_module(module_name).register(subparsers)
        else:
            subparsers.add_parser(name, help=f"(run `vlm-catalog {name} --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMAND_MODULES else None
    args = build_parser(only=command).parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
