"""Head checkpoints: our format round trips, and the published Medusa / Hydra / Hydra++ formats.

The published formats are tested against reference modules that rebuild the *original*
architectures here (list-multiplied shared blocks, Dropouts, a real 1-layer transformers
`LlamaModel` as the Hydra++ prefix layer), saved with `torch.save(module.state_dict())`
exactly as the original training code did.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import transformers

from entmtp.checkpoints import CheckpointError, load_heads, save_heads
from entmtp.heads import DraftHeads, HeadRunner, HeadsConfig, with_draft_vocab
from entmtp.published import HYDRA_FILE, MEDUSA_FILE
from entmtp.trees import Tree

H, V, T, B = 16, 40, 7, 2
INV_FREQ = "prefix_embeding_layer.layers.0.self_attn.rotary_emb.inv_freq"


def base_config(hidden: int = H, heads: int = 4, kv_heads: int = 2, theta: float = 500.0) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=24, num_hidden_layers=2,
                                    num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-6,
                                    rope_theta=theta, attn_implementation="eager")


# ----------------------------------------------------------------- the original architectures


class RefResBlock(nn.Module):
    """Hydra's / Medusa's ResBlock: res_connection(x) + SiLU(linear(x))."""

    def __init__(self, h: int, num_condition: int = 0):
        super().__init__()
        self.linear = nn.Linear(h * (num_condition + 1), h)
        self.res_connection = nn.Linear(h * (num_condition + 1), h) if num_condition > 0 else nn.Identity()
        self.act = nn.SiLU()

    def forward(self, x):
        return self.res_connection(x) + self.act(self.linear(x))


class RefHydra(nn.Module):
    """HydraMLP ("mlp") or HydraPrefixMLP ("prefix-mlp"), grounded or not, as published."""

    def __init__(self, K: int, L: int, grounded: bool, prefix: bool, embed: nn.Embedding, cfg=None, p: float = 0.1):
        super().__init__()
        h = embed.embedding_dim
        self.K, self.grounded, self.prefix = K, grounded, prefix
        self.input_embed_fn = embed  # registered as a sub-module: saved by accident
        if prefix:
            one = copy.deepcopy(cfg)
            one.num_hidden_layers = 1
            self.prefix_embeding_layer = transformers.LlamaModel(one)
            if grounded:
                mlps = [nn.Sequential(nn.Dropout(p), RefResBlock(h, k + 1), *([nn.Dropout(p), RefResBlock(h)] * (L - 1)))
                        for k in range(K)]
            else:
                mlps = [nn.Sequential(*([nn.Dropout(p), RefResBlock(h)] * L)) for _ in range(K)]
            self.hydra_lm_head = nn.ModuleList([nn.Sequential(nn.Dropout(p), nn.Linear(h, V)) for _ in range(K)])
        else:
            if grounded:
                mlps = [nn.Sequential(RefResBlock(h, k + 1), *([RefResBlock(h)] * (L - 1))) for k in range(K)]
            else:
                mlps = [nn.Sequential(*([RefResBlock(h)] * L)) for _ in range(K)]
            self.hydra_lm_head = nn.ModuleList([nn.Linear(h, V) for _ in range(K)])
        self.hydra_mlp = nn.ModuleList(mlps)

    def forward(self, hidden, input_ids):
        if self.prefix:
            mask = torch.ones(input_ids.shape, dtype=torch.long)
            hidden = self.prefix_embeding_layer(inputs_embeds=hidden, attention_mask=mask).last_hidden_state
        if self.grounded:
            emb = self.input_embed_fn(input_ids)
            parts = [hidden] + [torch.roll(emb, shifts=-(i + 1), dims=1) for i in range(self.K)]
            inputs = [torch.cat(parts[: i + 2], dim=-1) for i in range(self.K)]
        else:
            inputs = [hidden] * self.K
        return [self.hydra_lm_head[i](self.hydra_mlp[i](x)) for i, x in enumerate(inputs)]


def ref_medusa(K: int, L: int, h: int = H) -> nn.ModuleList:
    """Medusa v1's head module."""
    return nn.ModuleList([nn.Sequential(*([RefResBlock(h)] * L), nn.Linear(h, V, bias=False)) for _ in range(K)])


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():  # shared parameters are visited once
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return module.eval()


def inv_freq(cfg) -> torch.Tensor:
    d = cfg.hidden_size // cfg.num_attention_heads
    return 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def write_hydra(d: Path, ref: RefHydra, arch: str, K: int, L: int, grounded: bool, **extra) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    state = ref.state_dict()
    if arch == "prefix-mlp":
        state[INV_FREQ] = inv_freq(ref.prefix_embeding_layer.config)  # persistent in transformers 4.33
    torch.save(state, d / HYDRA_FILE)
    cfg = {"hydra_num_heads": K, "hydra_num_layers": L, "hydra_head_arch": arch, "grounded_heads": grounded,
           "hidden_state_offset": 0, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
           "transformers_version": "4.33.2", **extra}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def write_medusa(d: Path, ref: nn.Module, K: int, L: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    torch.save(ref.state_dict(), d / MEDUSA_FILE)
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": K, "medusa_num_layers": L,
                                               "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}))
    return d


def inputs(seed: int = 1, h: int = H):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, h, generator=g), torch.randint(0, V, (B, T), generator=g)


def assert_same_logits(heads: DraftHeads, ref_logits: list[torch.Tensor], hidden, ids, embed, lm_weight=None):
    ours = heads.training_logits(hidden, ids, embed, lm_weight)
    assert len(ours) == len(ref_logits)
    for k, (a, b) in enumerate(zip(ours, ref_logits)):
        n = T - k - 1  # training_logits keeps the positions whose target exists
        assert a.shape == (B, n, b.shape[-1])
        torch.testing.assert_close(a, b[:, :n], rtol=1e-5, atol=1e-5)


def one_line_error(path, match: str, **kw) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_heads(path, **kw)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert match in msg, msg
    return msg


# ----------------------------------------------------------------- published Hydra / Hydra++


@pytest.mark.parametrize("arch,grounded,K,L", [
    ("mlp", True, 3, 3),
    ("mlp", True, 2, 1),
    ("mlp", False, 2, 3),
    ("prefix-mlp", True, 3, 3),
    ("prefix-mlp", False, 2, 2),
])
def test_hydra_published_matches_original(tmp_path, arch, grounded, K, L):
    torch.manual_seed(0)
    embed = nn.Embedding(V, H)
    cfg = base_config()
    ref = randomize(RefHydra(K, L, grounded, arch == "prefix-mlp", embed, cfg))
    d = write_hydra(tmp_path / "hydra", ref, arch, K, L, grounded)
    emb_before = embed.weight.clone()
    heads = load_heads(d, base_config=cfg)

    c = heads.config
    assert c.kind == ("hydra" if grounded else "medusa") and c.num_heads == K and c.num_layers == L
    assert c.prefix_layer == (arch == "prefix-mlp")
    assert not c.shared_lm_head and c.lm_head_bias and (c.hidden_size, c.vocab_size) == (H, V)
    # the list-multiplied blocks stay one module
    for k in range(K):
        blocks = list(heads.blocks[k])
        shared = blocks[1:] if grounded else blocks
        assert all(b is shared[0] for b in shared)
        if grounded:
            assert blocks[0].res_connection is not None
    hidden, ids = inputs()
    with torch.no_grad():
        want = ref(hidden, ids)
        assert_same_logits(heads, want, hidden, ids, embed)
    assert torch.equal(embed.weight, emb_before)  # the stored embedding copy is not written anywhere


def test_hydra_prefix_base_config_from_base_model_path(tmp_path):
    """Without base_config, a Hydra++ loader reads the base config named in config.json."""
    cfg = base_config()
    cfg.save_pretrained(tmp_path / "base")
    embed = nn.Embedding(V, H)
    ref = randomize(RefHydra(2, 2, True, True, embed, cfg))
    d = write_hydra(tmp_path / "hydra", ref, "prefix-mlp", 2, 2, True,
                    base_model_name_or_path=str(tmp_path / "base"))
    heads = load_heads(d)
    assert (heads.config.num_attention_heads, heads.config.num_key_value_heads) == (4, 2)
    assert heads.config.rope_theta == 500.0 and heads.config.rms_norm_eps == 1e-6
    hidden, ids = inputs()
    with torch.no_grad():
        assert_same_logits(heads, ref(hidden, ids), hidden, ids, embed)


def test_hydra_prefix_needs_base_config(tmp_path):
    cfg = base_config()
    ref = randomize(RefHydra(2, 1, True, True, nn.Embedding(V, H), cfg))
    d = write_hydra(tmp_path / "hydra", ref, "prefix-mlp", 2, 1, True,
                    base_model_name_or_path=str(tmp_path / "no-such-base"))
    one_line_error(d, "pass base_config")
    # a base config whose RoPE disagrees with the saved RoPE buffer (shapes alone cannot tell)
    print(one_line_error(d, INV_FREQ + " does not match", base_config=base_config(theta=10000.0)))
    # a base config with another number of attention heads
    print(one_line_error(d, "mis-shaped keys", base_config=base_config(heads=2, kv_heads=2)))


def test_hydra_fp16_keeps_dtype(tmp_path):
    ref = randomize(RefHydra(2, 2, True, False, nn.Embedding(V, H))).half()
    d = write_hydra(tmp_path / "hydra", ref, "mlp", 2, 2, True)
    heads = load_heads(d)
    assert heads.blocks[1][0].linear.weight.dtype == torch.float16
    assert torch.equal(heads.blocks[1][0].res_connection.weight, ref.hydra_mlp[1][0].res_connection.weight)
    assert torch.equal(heads.lm_heads[0].bias, ref.hydra_lm_head[0].bias)


@pytest.mark.parametrize("grounded", [True, False])
def test_hydra_prefix_drafts_like_original(tmp_path, grounded):
    """Loaded Hydra++ heads bound to a base model draft the original's greedy chain."""
    cfg = base_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    embed = model.get_input_embeddings()
    ref = randomize(RefHydra(3, 2, grounded, True, embed, cfg), seed=3)  # also randomizes the base embedding
    heads = load_heads(write_hydra(tmp_path / "h", ref, "prefix-mlp", 3, 2, grounded), base_config=cfg)
    runner = HeadRunner(heads, model)
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        root = model.lm_head(hidden[0, -1]).argmax()
        state, feature = runner.start(hidden[0])
        got = runner.draft(Tree.chain(3), feature, root).tokens
        # the original: prefix model over the hidden states, then heads along the greedy path
        h = ref.prefix_embeding_layer(inputs_embeds=hidden).last_hidden_state[:, -1]
        x, want = torch.cat([h, embed(root.view(1))], -1), [root]
        for k in range(3):
            tok = ref.hydra_lm_head[k](ref.hydra_mlp[k](x if grounded else h)).argmax(-1)
            want.append(tok[0])
            x = torch.cat([x, embed(tok)], -1)
    assert got.tolist() == torch.stack(want).tolist()


# ----------------------------------------------------------------- published Medusa


@pytest.mark.parametrize("K,L", [(3, 1), (2, 3)])
def test_medusa_published_matches_original(tmp_path, K, L):
    ref = randomize(ref_medusa(K, L))
    d = write_medusa(tmp_path / "medusa", ref, K, L)
    heads = load_heads(d, base_config=base_config())
    c = heads.config
    assert c.kind == "medusa" and (c.num_heads, c.num_layers) == (K, L)
    assert not c.shared_lm_head and not c.lm_head_bias and c.shared_all_blocks == (L > 1)
    for k in range(K):
        assert all(b is heads.blocks[k][0] for b in heads.blocks[k])  # all L blocks one module
    hidden, ids = inputs()
    with torch.no_grad():
        want = [ref[k](hidden) for k in range(K)]
        assert_same_logits(heads, want, hidden, ids, None)

    # ... and it survives a round trip through our format, sharing included
    heads2 = load_heads(save_heads(heads, tmp_path / "ours"))
    assert heads2.config == heads.config
    assert all(b is heads2.blocks[k][0] for k in range(K) for b in heads2.blocks[k])
    with torch.no_grad():
        assert_same_logits(heads2, want, hidden, ids, None)


# ----------------------------------------------------------------- our format


def random_heads(cfg: HeadsConfig, seed: int = 0) -> DraftHeads:
    heads = randomize(DraftHeads(cfg), seed)
    if heads.draft_vocab is not None:
        heads.draft_vocab.copy_(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[: cfg.draft_vocab_size])
    return heads


PREFIX = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, rms_norm_eps=1e-6, rope_theta=500.0)


@pytest.mark.parametrize("name,kw", [
    ("medusa", dict(kind="medusa", num_heads=3, num_layers=2)),
    ("hydra", dict(kind="hydra", num_heads=3, num_layers=3, shared_block=True, shared_lm_head=False,
                   lm_head_bias=True)),
    ("hydra++", dict(kind="hydra", num_heads=2, num_layers=2, prefix_layer=True, **PREFIX)),
    ("draft-vocab", dict(kind="hydra", num_heads=2, draft_vocab_size=12, shared_lm_head=False)),
    ("shared-lm-head", dict(kind="hydra", num_heads=2, num_layers=2, draft_vocab_size=12)),
    ("eagle", dict(kind="eagle", num_heads=3, draft_vocab_size=12, **PREFIX)),
    ("eagle-layers", dict(kind="eagle", num_heads=2, feature_layers=[3, 1], **PREFIX)),
])
def test_our_format_round_trip(tmp_path, name, kw):
    cfg = HeadsConfig(hidden_size=H, vocab_size=V, **kw)
    heads = random_heads(cfg)
    d = save_heads(heads, tmp_path / name, meta={"recipe": name})
    back = load_heads(d, base_config=base_config())
    assert back.config == cfg and back.meta == {"recipe": name}
    own, got = heads.state_dict(), back.state_dict()
    assert own.keys() == got.keys() and all(torch.equal(own[k], got[k]) for k in own)
    embed = randomize(nn.Embedding(V, H))
    lm = torch.randn(cfg.draft_vocab_size or V, H) if cfg.shared_lm_head else None
    hidden, ids = inputs(h=cfg.feature_width)
    with torch.no_grad():
        for a, b in zip(heads.training_logits(hidden, ids, embed, lm), back.training_logits(hidden, ids, embed, lm)):
            assert torch.equal(a, b)


def test_int8_storage_halves_the_file_and_keeps_the_drafts(tmp_path):
    h = 128  # the last heads' input matrices ([128, 128 * (k + 1)]) are large enough for int8
    cfg = HeadsConfig(hidden_size=h, vocab_size=V, kind="hydra", num_heads=4)
    heads = random_heads(cfg)
    half = save_heads(heads, tmp_path / "bf16", dtype=torch.bfloat16) / "heads.safetensors"
    small = save_heads(heads, tmp_path / "int8", dtype="int8") / "heads.safetensors"
    assert small.stat().st_size < 0.7 * half.stat().st_size
    from safetensors import safe_open
    with safe_open(str(small), "pt") as f:
        int8 = [k for k in f.keys() if f.get_slice(k).get_dtype() == "I8"]
        assert int8 and all(k + ".row_scale" in f.keys() for k in int8)
    back = load_heads(small.parent)
    for k, a in heads.state_dict().items():
        b = back.state_dict()[k]
        if k in int8:  # within half a step of its row's scale
            step = a.abs().amax(dim=1, keepdim=True) / 127
            assert ((a - b).abs() <= 0.5 * step + 1e-7).all(), k
            assert not torch.equal(a, b)
        else:
            assert torch.equal(b, a.to(torch.bfloat16).float()), k
    embed = randomize(nn.Embedding(V, h))
    lm = torch.randn(V, h)
    hidden, ids = inputs(h=h)
    with torch.no_grad():
        for a, b in zip(heads.training_logits(hidden, ids, embed, lm), back.training_logits(hidden, ids, embed, lm)):
            assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_error_row_scale_without_matrix(tmp_path):
    from safetensors.torch import load_file, save_file
    cfg = HeadsConfig(hidden_size=128, vocab_size=V, kind="hydra", num_heads=4)
    d = save_heads(random_heads(cfg), tmp_path / "int8", dtype="int8")
    state = load_file(str(d / "heads.safetensors"))
    scaled = next(k for k in state if k.endswith(".row_scale"))
    state["nothing.here.row_scale"] = state[scaled].clone()
    save_file(state, str(d / "heads.safetensors"), metadata={"format": "entmtp-heads/1"})
    one_line_error(d, "row scales without their matrix: nothing.here.row_scale")


# ----------------------------------------------------------------- one-line errors


@pytest.fixture
def hydra_dir(tmp_path):
    ref = randomize(RefHydra(2, 3, True, False, nn.Embedding(V, H)))
    return write_hydra(tmp_path / "hydra", ref, "mlp", 2, 3, True)


def edit_state(d: Path, fn) -> Path:
    state = torch.load(d / HYDRA_FILE, weights_only=True)
    fn(state)
    torch.save(state, d / HYDRA_FILE)
    return d


def test_error_missing_key(hydra_dir):
    edit_state(hydra_dir, lambda s: s.pop("hydra_mlp.1.0.res_connection.weight"))
    one_line_error(hydra_dir, "missing keys hydra_mlp.1.0.res_connection.weight")


def test_error_unknown_key(hydra_dir):
    edit_state(hydra_dir, lambda s: s.update({"hydra_mlp.0.0.gate.weight": torch.zeros(3)}))
    one_line_error(hydra_dir, "unknown keys hydra_mlp.0.0.gate.weight")


def test_error_mis_shaped_key(hydra_dir):
    edit_state(hydra_dir, lambda s: s.update({"hydra_mlp.1.0.linear.weight": torch.zeros(H, 3 * 24)}))
    one_line_error(hydra_dir, "mis-shaped keys hydra_mlp.1.0.linear.weight")


def test_error_other_hidden_size(tmp_path, hydra_dir):
    one_line_error(hydra_dir, "hidden size 16", base_config=base_config(hidden=32))
    ours = save_heads(random_heads(HeadsConfig(kind="medusa", num_heads=2, hidden_size=H, vocab_size=V)),
                      tmp_path / "ours")
    one_line_error(ours, "hidden size 32", base_config=base_config(hidden=32))


def test_error_shared_copies_differ(hydra_dir):
    edit_state(hydra_dir, lambda s: s.update({"hydra_mlp.0.2.linear.bias": s["hydra_mlp.0.2.linear.bias"] + 1}))
    one_line_error(hydra_dir, "hydra_mlp.0.2.linear.bias differs from hydra_mlp.0.1.linear.bias")


def test_error_head_count(hydra_dir):
    raw = json.loads((hydra_dir / "config.json").read_text())
    (hydra_dir / "config.json").write_text(json.dumps({**raw, "hydra_num_heads": 3}))
    one_line_error(hydra_dir, "hydra_num_heads=3")


class NotATensor:
    pass


def test_error_unreadable_pt(hydra_dir):
    (hydra_dir / HYDRA_FILE).write_bytes(b"this is not a torch file\n" * 4)
    one_line_error(hydra_dir, f"{HYDRA_FILE}: unreadable torch checkpoint")
    # weights_only: arbitrary pickled objects are refused, not executed
    torch.save({"hydra_lm_head.0.weight": NotATensor()}, hydra_dir / HYDRA_FILE)
    one_line_error(hydra_dir, "unreadable torch checkpoint")
    # a truncated file
    torch.save({"x": torch.zeros(1000)}, hydra_dir / HYDRA_FILE)
    data = (hydra_dir / HYDRA_FILE).read_bytes()
    (hydra_dir / HYDRA_FILE).write_bytes(data[: len(data) // 2])
    one_line_error(hydra_dir, "unreadable torch checkpoint")
    # a tensor, not a state dict
    torch.save(torch.zeros(3), hydra_dir / HYDRA_FILE)
    one_line_error(hydra_dir, "not a state dict")


def test_error_missing_files(tmp_path, hydra_dir):
    (hydra_dir / "config.json").unlink()
    one_line_error(hydra_dir, "no config.json")
    d = write_medusa(tmp_path / "medusa", randomize(ref_medusa(2, 1)), 2, 1)
    (d / MEDUSA_FILE).unlink()
    one_line_error(d, f"no {MEDUSA_FILE}")


@pytest.mark.parametrize("field,value,match", [
    ("hydra_head_arch", "cross-attn", "'cross-attn' is not supported"),
    ("hydra_head_arch", "eagle-attn", "'eagle-attn' is not supported"),
    ("hidden_state_offset", 1, "hidden_state_offset 1 is not supported"),
])
def test_error_unsupported(hydra_dir, field, value, match):
    raw = json.loads((hydra_dir / "config.json").read_text())
    (hydra_dir / "config.json").write_text(json.dumps({**raw, field: value}))
    one_line_error(hydra_dir, match)


@pytest.mark.parametrize("prefix", [False, True])
def test_heads_scored_over_another_vocabulary_keep_their_scores(prefix):
    """with_draft_vocab: the same blocks scored against other lm_head rows; the old rows' scores stay."""
    cfg = HeadsConfig(hidden_size=H, vocab_size=V, kind="hydra", num_heads=3, draft_vocab_size=12,
                      prefix_layer=prefix, **(PREFIX if prefix else {}))
    heads = random_heads(cfg)
    embed = randomize(nn.Embedding(V, H))
    lm = torch.randn(V, H)
    hidden, ids = inputs()
    full = with_draft_vocab(heads, None)
    other = torch.arange(V - 1, V - 13, -1)
    moved = with_draft_vocab(heads, other)
    assert full.draft_vocab is None and moved.config.draft_vocab_size == 12 and heads.draft_vocab.numel() == 12
    with torch.no_grad():
        old = heads.training_logits(hidden, ids, embed, lm[heads.draft_vocab])
        wide = full.training_logits(hidden, ids, embed, lm)
        new = moved.training_logits(hidden, ids, embed, lm[other])
        for a, b, c in zip(old, wide, new):
            torch.testing.assert_close(b[..., heads.draft_vocab], a)
            torch.testing.assert_close(c, b[..., other])
    published = copy.deepcopy(cfg)
    published.shared_lm_head = False
    with pytest.raises(ValueError, match="share the base lm_head"):
        with_draft_vocab(DraftHeads(published), None)
