"""Record in each embedded head checkpoint which calibrated tree and entropy bank it uses by default.

After `entmtp search ... --save-trees-to assets/search/trees/` for every head kind
(scripts/reproduce_embedded.sh): the best tokens/s tree of at most 64 nodes (`<name>-b64.json`) becomes
the heads' default tree and `<name>-bank.json` their entropy bank (`meta.default_tree` /
`meta.default_bank` in config.json); both are copied into the package's shipped trees (entmtp/trees/).
With `--dtype float32 --tag fp32 --kinds hydrapp`: `<name>-fp32-b64.json` / `<name>-fp32-bank.json`
become `meta.default_tree_float32` / `meta.default_bank_float32` (used when the base runs in float32).
With `--hardware cpu-avx2` as well: `meta.default_tree_float32@cpu-avx2` (used only on CPUs of that
class, `entmtp.hardware.hardware_class`; `--hardware here` = this machine's class).
With `--lookup-min-ngram K` (and --dtype / --hardware): records only the shortest context match that
grafts a prompt-lookup branch for methods using these heads (`meta.default_lookup_min_ngram...`;
measure it first with scripts/compare_lookup.py). The recorded AVX2 bf16 setting:
`python scripts/record_default_trees.py --kinds hydrapp --dtype bfloat16 --hardware cpu-avx2 --lookup-min-ngram 2`.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"medusa": "medusa", "hydra": "hydra", "hydrapp": "hydra++"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads-dir", default=str(ROOT / "assets" / "heads"))
    ap.add_argument("--trees-dir", default=str(ROOT / "assets" / "search" / "trees"), help="where the search saved its trees")
    ap.add_argument("--package-trees", default=str(ROOT / "entmtp" / "trees"), help="the package's shipped trees")
    ap.add_argument("--name", default="smollm2-135m")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--dtype", default=None, help="record as the default for this dtype only (e.g. float32)")
    ap.add_argument("--hardware", default=None,
                    help="record for this hardware class only (needs --dtype), e.g. cpu-avx2; 'here' = this machine's")
    ap.add_argument("--tag", default="", help="tag in the tree file names, e.g. fp32 for <name>-fp32-b64.json")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: medusa,hydra,hydrapp")
    ap.add_argument("--lookup-min-ngram", type=int, default=None, choices=(1, 2, 3),
                    help="record only this shortest grafted lookup match (no trees)")
    args = ap.parse_args()
    key_suffix = f"_{args.dtype}" if args.dtype else ""
    if args.hardware:
        if not args.dtype:
            print("error: --hardware needs --dtype", file=sys.stderr)
            return 2
        if args.hardware == "here":
            sys.path.insert(0, str(ROOT))
            from entmtp.hardware import hardware_class

            args.hardware = hardware_class("cpu")
        key_suffix += f"@{args.hardware}"
    tag = f"-{args.tag}" if args.tag else ""
    for suffix in [k.strip() for k in args.kinds.split(",") if k.strip()]:
        if suffix not in KINDS:
            print(f"error: unknown kind {suffix!r} (medusa, hydra, hydrapp)", file=sys.stderr)
            return 2
        cfg_path = Path(args.heads_dir) / f"{args.name}-{suffix}" / "config.json"
        if args.lookup_min_ngram is not None:
            if not cfg_path.is_file():
                print(f"error: missing {cfg_path}", file=sys.stderr)
                return 2
            cfg = json.loads(cfg_path.read_text())
            cfg.setdefault("meta", {})[f"default_lookup_min_ngram{key_suffix}"] = args.lookup_min_ngram
            cfg_path.write_text(json.dumps(cfg, indent=1) + "\n")
            print(f"{cfg_path}: default_lookup_min_ngram{key_suffix} {args.lookup_min_ngram}")
            continue
        tree = f"{args.name}-{suffix}{tag}-b{args.budget}.json"
        bank = f"{args.name}-{suffix}{tag}-bank.json"
        missing = [p for p in (cfg_path, Path(args.trees_dir) / tree, Path(args.trees_dir) / bank) if not p.is_file()]
        if missing:
            print(f"error: missing {', '.join(map(str, missing))}", file=sys.stderr)
            return 2
        for name in (tree, bank):  # the package ships what the heads record
            shutil.copyfile(Path(args.trees_dir) / name, Path(args.package_trees) / name)
        cfg = json.loads(cfg_path.read_text())
        cfg.setdefault("meta", {}).update({f"default_tree{key_suffix}": tree, f"default_bank{key_suffix}": bank})
        cfg_path.write_text(json.dumps(cfg, indent=1) + "\n")
        print(f"{cfg_path}: default_tree{key_suffix} {tree}, default_bank{key_suffix} {bank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
