"""The ``shmvec`` command. Subcommands: ``bench``; ``shmvec --version``."""

from __future__ import annotations

import argparse
import os
import sys

import shmvec
from shmvec.bench import command as bench_command

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    # A console script's sys.path holds its own folder, not the current one
    # (unlike `python -m`): add it, last so that it shadows no installed
    # package, for `module:callable` to find the user's code.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    parser = argparse.ArgumentParser(prog="shmvec", description="shmvec: fast vectorized RL environments")
    parser.add_argument("--version", action="version", version=f"%(prog)s {shmvec.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench_parser = commands.add_parser("bench", help="steps/s of shmvec and its installed peers here",
                                       description=bench_command.__doc__.split("\n\n")[0].replace("``", ""))
    bench_command.add_arguments(bench_parser)
    bench_parser.set_defaults(run=bench_command.run)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
