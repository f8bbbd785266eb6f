"""``python -m focus_attention.cli ...``: the same as ``focus ...``."""

import sys

from . import main

sys.exit(main())
