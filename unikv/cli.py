"""`unikv` command line: a thin dispatcher; each subcommand lives with its component."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function taking argv); imported lazily so that
# `unikv inspect` needs neither transformers nor a GPU.
COMMANDS = {
    "inspect": ("unikv.inspect", "main"),
    "generate": ("unikv.engine.cli", "generate_main"),
    "demo": ("unikv.engine.cli", "demo_main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}; " if argv and argv[0] not in ("-h", "--help") else ""
        print(f"{given}usage: unikv {{{','.join(COMMANDS)}}} [options]  (unikv CMD --help)")
        return 0 if not given else 2
    module, function = COMMANDS[argv[0]]
    return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
