"""transformers' `generate` tokens/s under OpenMP's default (spinning) waiting and under the
passive waiting entmtp sets, with 1 thread and with all cores: what a bench's `generate` row gives
up by running in entmtp's process. Each policy runs in its own process (OpenMP reads the policy
once, when torch loads); the processes alternate for `--rounds` rounds; medians.

    .venv/bin/python scripts/generate_wait_policy.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, os, sys, time
if os.environ.get("WAIT_POLICY_UNDER_TEST") == "default":
    import torch  # before entmtp: OpenMP starts with its own default policy
import entmtp  # noqa: F401  (otherwise: passive waiting, as the CLI and the app run)
import torch
from entmtp.models import load_engine
dtype, n_new, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = load_engine("default", {}, dtype=dtype, progress=None)
ids = torch.tensor([engine.tokenizer("Explain how a bicycle works in detail.")["input_ids"]])
kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
counts = sorted({1, os.cpu_count() or 1})
out = {n: [] for n in counts}
with torch.inference_mode():
    for n in counts:
        torch.set_num_threads(n); engine.model.generate(ids, **kw)
    for _ in range(reps):
        for n in counts:
            torch.set_num_threads(n)
            t0 = time.perf_counter(); engine.model.generate(ids, **kw)
            out[n].append(n_new / (time.perf_counter() - t0))
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY", "default"), "tokens_per_s": out}))
"""


def run(policy: str, dtype: str, n_new: int, reps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "ENTMTP_THREADS")}
    env.update(WAIT_POLICY_UNDER_TEST=policy, ENTMTP_TUNE="0", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", WORKER, dtype, str(n_new), str(reps)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="processes per policy, alternated")
    ap.add_argument("--repeats", type=int, default=5, help="timed generations per thread count in each process")
    a = ap.parse_args()
    got: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.rounds):
        for policy in ("default", "passive"):
            for n, v in run(policy, a.dtype, a.max_new_tokens, a.repeats).items():
                got.setdefault((policy, n), []).extend(v)
    print(f"transformers' generate, {a.dtype}, {a.max_new_tokens} new tokens, {os.cpu_count()} cores; "
          f"median tokens/s of {a.rounds} x {a.repeats} runs")
    print("| OpenMP waiting | threads | tokens/s |\n|---|---:|---:|")
    for (policy, n), v in got.items():
        label = "OpenMP's default (spin)" if policy == "default" else "passive (entmtp)"
        print(f"| {label} | {n} | {statistics.median(v):.1f} |")


if __name__ == "__main__":
    main()
