"""``python -m focus_attention.bench ...``: the same as ``focus bench ...``."""

import sys

from ..cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
