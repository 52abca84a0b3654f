"""Rewrite head checkpoints in the compact int8 storage (large matrices per-row int8, the rest
bfloat16): half the bytes of bfloat16.

    python scripts/compact_heads.py assets/heads/smollm2-135m-hydra [more directories]

Each directory is read, written to a temporary sibling, reloaded and compared (every weight
within half a quantization step of the original), and only then put in place of the original.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from entmtp.checkpoints import load_heads, save_heads  # noqa: E402
from entmtp.heads_io import WEIGHTS_FILE  # noqa: E402


def compact(d: Path) -> str:
    heads = load_heads(d)
    tmp = d.with_name(d.name + ".int8-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(d, tmp)
    save_heads(heads, tmp, heads.meta, dtype="int8")
    again = load_heads(tmp)
    for (k, a), b in zip(heads.state_dict().items(), again.state_dict().values()):
        step = a.float().abs().amax(dim=-1, keepdim=True) / 127.0 if a.dim() == 2 else a.float().abs().max() / 127.0
        if not ((a.float() - b.float()).abs() <= 0.5 * step + 1e-6).all():
            shutil.rmtree(tmp)
            raise SystemExit(f"{d}: {k} does not round-trip within half a quantization step")
    before, after = (d / WEIGHTS_FILE).stat().st_size, (tmp / WEIGHTS_FILE).stat().st_size
    shutil.rmtree(d)
    tmp.rename(d)
    return f"{d}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB"


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python scripts/compact_heads.py HEADS_DIR [HEADS_DIR ...]", file=sys.stderr)
        return 2
    for arg in argv:
        d = Path(arg)
        if not (d / WEIGHTS_FILE).is_file():
            print(f"error: {d} has no {WEIGHTS_FILE}", file=sys.stderr)
            return 1
        print(compact(d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
