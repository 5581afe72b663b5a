"""`unikv` command line: a thin dispatcher; each subcommand lives with its component.

Failures a user can fix print one line, never a traceback: a missing optional
dependency names the extra that installs it, and a closed output pipe
(``unikv inspect ... | head``) ends quietly.
"""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, function taking argv); imported lazily so that
# `unikv inspect` needs neither transformers nor a GPU.
COMMANDS = {
    "inspect": ("unikv.inspect", "main"),
    "generate": ("unikv.engine.cli", "generate_main"),
    "serve": ("unikv.serving.cli", "serve_main"),
    "demo": ("unikv.engine.cli", "demo_main"),
}

# top-level module of an optional dependency -> the extra that installs it
EXTRAS = {
    "transformers": "models",
    "safetensors": "models",
    "tokenizers": "models",
    "tqdm": "models",
    "matplotlib": "plot",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "starlette": "serve",
}


def _missing_extra(err: ModuleNotFoundError) -> str | None:
    """The install hint for a missing optional dependency, else None."""
    top = (err.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return f"this command needs {top!r} (the {extra!r} extra): pip install 'unikv[{extra}]'"


def _quiet_broken_pipe() -> None:
    """The reader of stdout went away: drop what is left, as a shell tool does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}; " if argv and argv[0] not in ("-h", "--help") else ""
        print(f"{given}usage: unikv {{{','.join(COMMANDS)}}} [options]  (unikv CMD --help)")
        return 0 if not given else 2
    module, function = COMMANDS[argv[0]]
    try:
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    except ModuleNotFoundError as err:
        hint = _missing_extra(err)
        if hint is None:
            raise
        print(f"unikv {argv[0]}: error: {hint}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _quiet_broken_pipe()
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
