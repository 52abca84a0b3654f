"""Plain bf16 decoding tokens/s with N torch threads, or with the engine's own choice (`auto`: the
measured count and, where the cores' load can be read, the governor that drops to one thread while
another process uses them), under the OpenMP wait policy of the environment. Run it idle and with
a busy process on another core (e.g. `python3 -c "while True: pass" &`).

    python scripts/busy_neighbour.py auto
    OMP_WAIT_POLICY=ACTIVE python scripts/busy_neighbour.py 2
    OMP_WAIT_POLICY=PASSIVE python scripts/busy_neighbour.py 1
"""

import os
import sys
import time

arg = sys.argv[1] if len(sys.argv) > 1 else "1"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 48
if arg != "auto":
    os.environ["ENTMTP_THREADS"] = str(int(arg))  # the count asked for, not the measured one
    os.environ.setdefault("ENTMTP_TUNE", "0")

import entmtp  # noqa: E402,F401  first, as the CLI and the app do: it sets OpenMP's wait policy before torch loads

import torch  # noqa: E402

from entmtp.decoding import DecodeConfig  # noqa: E402
from entmtp.models import load_engine  # noqa: E402

if arg != "auto":
    torch.set_num_threads(int(arg))
engine = load_engine("default", {}, dtype="bfloat16", progress=None)
ids = engine.tokenizer("Explain how a bicycle works in detail.")["input_ids"]
cfg = DecodeConfig(max_new_tokens=tokens, eos_token_ids=())
engine.run(ids, config=cfg)  # warm-up
t = time.perf_counter()
engine.run(ids, config=cfg)
rate = tokens / (time.perf_counter() - t)
gov = engine.governor
how = (f"governor: {gov.wide} threads while the cores are free, now {torch.get_num_threads()} (others used "
       f"{gov.others if gov.others is None else round(gov.others, 2)} cores)") if gov else f"{torch.get_num_threads()} threads"
print(f"threads={arg} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(OpenMP default)')}: {rate:.1f} tok/s ({how})")
