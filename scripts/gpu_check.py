"""The CUDA check: one short run on a GPU machine, no weights carried (a random tiny Llama and
random heads built here). Prints and writes (to $OUT or --out) JSON with:

* float32: every method's greedy tokens against transformers' `generate` (identity per prompt; Medusa,
  Hydra, Hydra++ and EAGLE heads, one-layer and multi-layer);
* bfloat16: every method's tokens against our own plain loop (match rate: CUDA's bf16 kernels are
  not row-invariant in general, and the kernel probe says whether they are here);
* the kernel probe on CUDA: step latency by tree rows (up to 128) and bitwise row invariance;
* flash attention refused with one line; `device_map="auto"` decoding with heads.

    python scripts/gpu_check.py [--out DIR]      (exit 1 when a float32 identity fails)
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def tiny(dtype, seed=0):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked logits: few float near-ties
    return model.to(dtype)


def random_heads(model, kind, prefix=False, seed=0, feature_layers=()):
    import torch

    from entmtp.heads import DraftHeads, HeadsConfig

    torch.manual_seed(seed)
    heads = DraftHeads(HeadsConfig.for_base(model.config, kind, num_heads=4, prefix_layer=prefix,
                                            feature_layers=list(feature_layers)))
    with torch.no_grad():
        for p in heads.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 / p.shape[1] ** 0.5)
    return heads.eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-check"))
    ap.add_argument("--device", default="cuda", help="cuda (the check); cpu runs the same script here, to test it")
    args = ap.parse_args()
    import entmtp  # noqa: F401
    import torch

    from entmtp.decoding import DecodeConfig, Engine
    from entmtp.trees import resolve_tree
    from entmtp.tuning import probe_kernels
    from entmtp.verify import UnsupportedModelError

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    t0, out = time.time(), {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 2048, (n,), generator=g).tolist() for n in (12, 40, 90, 200)]
    tree = resolve_tree("mc_sim_7b_63").truncated(4)
    n_new = 48
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny(dtype).to(dev)
        heads = {"medusa": random_heads(model, "medusa"), "hydra": random_heads(model, "hydra"),
                 "hydra++": random_heads(model, "hydra", prefix=True), "eagle": random_heads(model, "eagle"),
                 "eagle-layers": random_heads(model, "eagle", feature_layers=(1, 3))}
        eng = Engine(model, None, heads, kernels="stock")
        cfg = DecodeConfig(max_new_tokens=n_new, eos_token_ids=())
        name = str(dtype).removeprefix("torch.")
        res = {}
        for p in prompts:
            ref = model.generate(torch.tensor([p], device=dev), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
            ref = ref[0, len(p):].tolist()
            plain = eng.run(p, config=cfg).tokens
            res.setdefault("baseline", []).append(plain == ref)
            for h in heads:
                got = eng.run(p, heads=h, tree=tree, config=cfg).tokens
                res.setdefault(h, []).append(got == (ref if dtype == torch.float32 else plain))
        out[name] = {m: f"{sum(v)}/{len(v)}" for m, v in res.items()}
        out[name]["compared_with"] = "generate" if dtype == torch.float32 else "our plain loop (baseline: generate)"
        if dtype == torch.float32:
            ok = ok and all(all(v) for v in res.values())
        prof = probe_kernels(model, sets=("stock",), rows=(1, 2, 4, 8, 16, 32, 64, 128), repeats=5, check_rows=(4, 16, 64))
        t = prof.trial("stock")
        out[name]["step_ms_by_rows"] = {r: round(ms, 3) for r, ms in t.ms_by_rows.items()}
        out[name]["row_invariant"] = t.invariant_rows
        del eng, model
    flash = tiny(torch.bfloat16).to(dev)
    flash.config._attn_implementation = "flash_attention_2"
    try:
        Engine(flash, None, {}, kernels="stock")
        out["flash_refused"] = False
        ok = False
    except UnsupportedModelError as e:
        out["flash_refused"] = str(e)
    with tempfile.TemporaryDirectory() as d:
        import transformers

        tiny(torch.float32).save_pretrained(d)
        mapped = transformers.AutoModelForCausalLM.from_pretrained(d, device_map="auto", attn_implementation="sdpa").eval()
        eng = Engine(mapped, None, {"hydra": random_heads(mapped, "hydra")}, kernels="stock")
        eng.runners["hydra"].heads.to(eng.runners["hydra"].device)
        cfg = DecodeConfig(max_new_tokens=n_new, eos_token_ids=())
        first = next(mapped.parameters()).device
        same = [eng.run(p, heads="hydra", tree=tree, config=cfg).tokens == eng.run(p, config=cfg).tokens for p in prompts]
        out["device_map_auto"] = {"devices": sorted({str(p.device) for p in mapped.parameters()}), "first": str(first),
                                  "heads_on": str(eng.runners["hydra"].device), "identical": f"{sum(same)}/{len(same)}"}
        ok = ok and all(same)
    out["seconds"] = round(time.time() - t0, 1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
