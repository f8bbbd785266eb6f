"""Copy the gates a ``focus train --method head-gates`` run wrote (``head_gates.json``) into
the study's results, so the calibrate steps read them from there.

usage: python experiments/dense-heads/copy_gates.py RUN/head_gates.json results/gates.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from focus_attention.utils.io import write_json_atomic

if __name__ == "__main__":
    source, target = (Path(a) for a in sys.argv[1:3])
    data = json.loads(source.read_text())
    write_json_atomic(target, data)
    top = ", ".join(
        f"{a}:{b} {data['by_head'][f'{a}:{b}']:.3f}" for a, b in data["head_ranking"][:10]
    )
    print(f"wrote {target}: largest gates {top}")
