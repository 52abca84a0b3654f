"""Carry the recorded decoding defaults (`default_tree*`, `default_bank*`, `default_lookup*` keys
of config.json's meta) from one head checkpoint to its retrained successor.

    python scripts/carry_defaults.py OLD_HEADS_DIR NEW_HEADS_DIR

Retraining writes a fresh meta (recipe, data, metrics). The recorded trees are a warm start only:
`entmtp tune` chooses each machine's trees from the new heads' shipped acceptance statistics and
the step latency it measures there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PREFIXES = ("default_tree", "default_bank", "default_lookup")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/carry_defaults.py OLD_HEADS_DIR NEW_HEADS_DIR", file=sys.stderr)
        return 2
    old, new = (Path(a) / "config.json" for a in argv)
    for path in (old, new):
        if not path.is_file():
            print(f"error: no {path}", file=sys.stderr)
            return 1
    carried = {k: v for k, v in json.loads(old.read_text())["meta"].items() if k.startswith(PREFIXES)}
    cfg = json.loads(new.read_text())
    cfg.setdefault("meta", {}).update(carried)
    new.write_text(json.dumps(cfg, indent=1, default=str) + "\n")
    print(f"{new}: carried {len(carried)} defaults ({', '.join(sorted(carried))})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
