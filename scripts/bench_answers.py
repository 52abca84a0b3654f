"""Self-distillation's answering rate: `entmtp.train.answer_batch` beside transformers' `generate`.

    python scripts/bench_answers.py [--data FILE] [--n 64] [--batch 32] [--max-new-tokens 160] [--dtype bfloat16]

Both answer the same prompts (greedy, the default model, batches of --batch prompts sorted by length,
as `entmtp train --self-distill` does), in one run, one after the other after a warm-up of each;
prints tokens per second of each, their ratio, and how many answers are identical. `generate`
computes every row of a batch until its longest answer ends; `answer_batch` drops an answer's row
when it ends. Wall-clock figures: read them on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="entmtp/prompts/heldout_chat.jsonl", help="prompt file (any entmtp format)")
    ap.add_argument("--n", type=int, default=64, help="prompts to answer")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)

    import entmtp  # noqa: F401 - thread policy before torch
    import torch
    from entmtp.data import load_prompts, render_prompt
    from entmtp.models import load_base
    from entmtp.train import _eos_ids, answer_batch
    from entmtp.verify import left_padded

    model, tok = load_base("default", dtype=args.dtype)[:2]
    eos = _eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    prompts = sorted((render_prompt(p, tok) for p in load_prompts(args.data).prompts[: args.n]), key=len)
    if not prompts:
        print(f"error: no prompts in {args.data}", file=sys.stderr)
        return 1
    batches = [prompts[i: i + args.batch] for i in range(0, len(prompts), args.batch)]

    def ours(batch):
        return [a for a, _ in answer_batch(model, batch, [args.max_new_tokens] * len(batch), eos, pad)]

    @torch.inference_mode()
    def stock(batch):
        ids, att, _ = left_padded(batch, pad)
        L = ids.shape[1]
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=args.max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad)[:, L:].tolist()
        cut = [next((j + 1 for j, t in enumerate(row) if t in eos), len(row)) for row in out]
        return [row[:c] for row, c in zip(out, cut)]

    results = {}
    for name, fn in (("answer_batch", ours), ("generate", stock)):
        fn(batches[0][:4])  # warm-up: kernels for the shapes of a shrinking batch
        fn(batches[0])
        t = time.perf_counter()
        answers = [a for b in batches for a in fn(b)]
        results[name] = (answers, time.perf_counter() - t)
    (a, ta), (g, tg) = results["answer_batch"], results["generate"]
    n_tok = sum(len(x) for x in a)
    same = sum(x == y for x, y in zip(a, g))
    print(f"{len(prompts)} prompts, batch {args.batch}, {args.dtype}, {n_tok} answer tokens")
    print(f"answer_batch {n_tok / ta:.0f} tok/s; generate {sum(len(x) for x in g) / tg:.0f} tok/s; "
          f"ratio {tg / ta:.2f}x; identical answers {same}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
