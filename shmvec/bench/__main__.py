"""``python -m shmvec.bench``: the same as ``shmvec bench``."""

import sys

from shmvec.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
