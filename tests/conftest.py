"""Shared test helpers: tiny random causal LMs of several families and random draft heads."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# kernels and trees from the unmeasured defaults, so tests do not depend on this machine's timings;
# tests of the self-tuning turn it on (tests/test_tuning.py)
os.environ.setdefault("ENTMTP_TUNE", "0")

import entmtp  # noqa: F401,E402 - first: sets OpenMP's wait policy before torch loads OpenMP
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from entmtp.heads import DraftHeads, HeadsConfig

transformers.logging.set_verbosity_error()

FAMILIES = ("llama", "qwen2", "gpt2")


def tiny_model(family: str = "llama", vocab: int = 64, seed: int = 0, max_pos: int = 256,
               attn: str = "sdpa", dtype=torch.float32):
    """A tiny randomly initialised causal LM of `family` (built in code, nothing downloaded)."""
    torch.manual_seed(seed)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                                       bos_token_id=0, eos_token_id=1, pad_token_id=1)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                                       bos_token_id=0, eos_token_id=1, pad_token_id=1)
        cls = transformers.Qwen2ForCausalLM
    elif family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=max_pos,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
        cls = transformers.GPT2LMHeadModel
    else:
        raise ValueError(family)
    cfg._attn_implementation = attn
    model = cls(cfg).eval().to(dtype)
    # Sharper logits: a random tiny model is otherwise nearly uniform, which makes greedy
    # near-ties (and so float-noise flips) common and acceptance rare.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def random_heads(model, kind: str = "hydra", num_heads: int = 4, prefix: bool = False, seed: int = 0,
                 std: float = 0.5, **kw) -> DraftHeads:
    """Draft heads with random (non-zero) weights for `model`."""
    torch.manual_seed(seed)
    cfg = HeadsConfig.for_base(model.config, kind, num_heads=num_heads, prefix_layer=prefix, **kw)
    heads = DraftHeads(cfg)
    with torch.no_grad():
        for p in heads.parameters():
            if p.dim() > 1:
                p.normal_(0, std / p.shape[1] ** 0.5)
    return heads.eval()


def tokens_before_near_tie(model, prompt: list[int], tokens: list[int], rel: float = 2.0 ** -6) -> int:
    """How many of `tokens` (model's greedy continuation of `prompt`) come before the first step
    whose top-2 logits are within `rel` of the logit scale: up to there another kernel's rounding
    cannot change the greedy choice; from there on it may (bf16 ties are common on tiny models)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    top2 = logits.topk(2, -1).values
    near = ((top2[:, 0] - top2[:, 1]) <= rel * logits.abs().amax(-1)).nonzero()
    return int(near[0, 0]) if len(near) else len(tokens)


def assert_lossless_and_near_stock(engine, stock, model, heads: str, tree, n: int = 40, lookup: int = 0) -> None:
    """On two prompts: `engine`'s plain greedy tokens are `stock`'s up to the first near-tie of
    the stock logits, and speculation with `heads` and `tree` emits exactly `engine`'s own plain
    tokens (lossless whatever the kernels round)."""
    from entmtp.decoding import DecodeConfig

    cfg = DecodeConfig(max_new_tokens=n, eos_token_ids=(), lookup=lookup)
    for prompt in ([5, 9, 11, 5, 9], [7] * 3 + list(range(20, 40))):
        want = stock.run(prompt, config=cfg).tokens
        plain = engine.run(prompt, config=cfg).tokens
        agree = tokens_before_near_tie(model, prompt, want)
        assert agree >= 5 and plain[:agree] == want[:agree]
        got = engine.run(prompt, heads=heads, tree=tree, config=cfg)
        assert got.tokens == plain and len(got.tokens) == n


@pytest.fixture
def llama():
    return tiny_model("llama")


TINY_CORPUS = ["hello world, how are you today?", "the cat sat on the mat.", "what is the capital of france?",
               "paris is the capital.", "one two three four five six seven eight nine ten"]


def tiny_bpe(corpus: list[str], alphabet: list[str], size: int, specials: list[str]) -> tuple[dict, list]:
    """(vocab, merges) of a byte-level BPE learnt from `corpus`, deterministically: the most frequent
    adjacent pair first, ties broken by the pair itself. (tokenizers' BpeTrainer breaks ties in hash
    order, so its vocabulary -- and every tiny model's outputs -- changed from run to run.)"""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = [list(w) for text in corpus for w, _ in pre.pre_tokenize_str(text)]
    symbols = sorted(set(alphabet) | {c for w in words for c in w})
    vocab = {t: i for i, t in enumerate(specials + symbols)}
    merges = []
    while len(vocab) < size:
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        a, b = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append((a, b))
        vocab[a + b] = len(vocab)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i:i + 2] = [a + b]
                i += 1
    return vocab, merges


def tiny_tokenizer():
    """A small byte-level BPE tokenizer (90 tokens) with a ChatML chat template, built in memory
    (nothing downloaded), the same on every run (the byte alphabet comes in hash order: sorted)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = tiny_bpe(TINY_CORPUS, sorted(pre_tokenizers.ByteLevel.alphabet())[:40], 90,
                             ["<unk>", "<|im_end|>", "<|im_start|>"])
    tk = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", chat_template=template)


def save_tiny_base(directory, family: str = "llama", seed: int = 0):
    """Save a tiny model + tokenizer (vocab sized to the tokenizer) with save_pretrained."""
    tok = tiny_tokenizer()
    model = tiny_model(family, vocab=len(tok), seed=seed)
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    import torch

    with torch.no_grad():  # keep EOS rare so that generations have several steps
        model.get_output_embeddings().weight[tok.eos_token_id] = -model.get_output_embeddings().weight.abs().mean()
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model, tok
