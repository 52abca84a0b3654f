"""Plain bf16 decoding tokens/s with N torch threads and the OpenMP wait policy of the environment:
run it idle and with a busy process on another core (e.g. `python3 -c "while True: pass" &`).

    OMP_WAIT_POLICY=ACTIVE python scripts/busy_neighbour.py 2
    OMP_WAIT_POLICY=PASSIVE python scripts/busy_neighbour.py 1
"""

import os
import sys
import time

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
os.environ["ENTMTP_THREADS"] = str(threads)  # the count asked for, not the measured one
os.environ.setdefault("ENTMTP_TUNE", "0")

import entmtp  # noqa: E402,F401  first, as the CLI and the app do: it sets OpenMP's wait policy before torch loads

import torch  # noqa: E402

from entmtp.decoding import DecodeConfig  # noqa: E402
from entmtp.models import load_engine  # noqa: E402

torch.set_num_threads(threads)
engine = load_engine("default", {}, dtype="bfloat16", progress=None)
ids = engine.tokenizer("Explain how a bicycle works in detail.")["input_ids"]
cfg = DecodeConfig(max_new_tokens=48, eos_token_ids=())
engine.run(ids, config=cfg)  # warm-up
t = time.perf_counter()
engine.run(ids, config=cfg)
print(f"threads={threads} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}: {48 / (time.perf_counter() - t):.1f} tok/s")
