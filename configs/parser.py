"""The argument parser of every entry point: argparse, whose refusals follow meshtrain's bad-input
rule, one `error:` line and exit code 2 (argparse's own prints its usage block, then
`prog: error: ...`); --help is argparse's, the module docstring kept as written. It lives in
configs, the lowest layer, so that pipeline.schedule and sharding.xla_flags share it with the
tools, the benchmarks and train.py."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with a docstring description printed verbatim and one-line errors,
    e.g. `error: argument --steps: invalid int value: 'abc'`."""

    def __init__(self, description: str | None = None, prog: str | None = None) -> None:
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
