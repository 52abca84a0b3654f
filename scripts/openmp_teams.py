"""Plain decoding tokens/s of the embedded model alone, and while a second live thread has run one
torch operation (so the process holds two OpenMP teams), and after that thread ended. With GNU
OpenMP (torch's Linux CPU wheels) more OpenMP threads alive than CPUs cut every team's
spin-waiting short, so each parallel region wakes its workers through the kernel: why the app runs
its models on one thread (`entmtp/compute_thread.py`). No asserts.

    python scripts/openmp_teams.py [--dtype bfloat16] [--tokens 64] [--repeats 3]
"""

import argparse
import threading
import time

import entmtp  # noqa: F401  first: sets OpenMP's wait policy before torch loads, as the CLI and the app do


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per case; the fastest is kept")
    args = ap.parse_args()

    import torch

    from entmtp.decoding import DecodeConfig
    from entmtp.models import load_engine

    engine = load_engine("default", {}, dtype=args.dtype, progress=None)
    ids = engine.tokenizer("Explain how a bicycle works in detail.")["input_ids"]
    cfg = DecodeConfig(max_new_tokens=args.tokens, eos_token_ids=())
    engine.run(ids, config=cfg)  # warm-up

    def rate() -> float:
        best = 0.0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.run(ids, config=cfg)
            best = max(best, args.tokens / (time.perf_counter() - t0))
        return best

    print(f"{args.dtype}, {torch.get_num_threads()} torch threads, {args.tokens} tokens, best of {args.repeats}")
    alone = rate()
    print(f"  one thread runs torch:                        {alone:6.1f} tok/s")
    release = threading.Event()

    def second_team():
        torch.mm(torch.randn(256, 256), torch.randn(256, 256))  # one parallel region: a team of its own
        release.wait()

    other = threading.Thread(target=second_team, name="second-team")
    other.start()
    time.sleep(0.3)
    two = rate()
    print(f"  while a second live thread has run torch:     {two:6.1f} tok/s ({two / alone:.2f}x)")
    release.set()
    other.join()
    after = rate()
    print(f"  after that thread ended:                      {after:6.1f} tok/s ({after / alone:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
