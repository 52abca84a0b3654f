"""Loaders for the published head checkpoints: Medusa (v1) and Hydra / Hydra++.

Both formats are a directory with a ``config.json`` and one ``torch.save``d state dict of
the original head module. They are mapped onto `DraftHeads` exactly, quirks included:

* **Hydra** (``hydra_lm_head.pt``; ``hydra_head_arch`` "mlp" or "prefix-mlp"). Repeated
  blocks were built by list multiplication (``[ResBlock(h)] * n``), so they are one module
  stored under several keys. Grounded heads -> kind "hydra" with ``shared_block`` (one block
  applied L-1 times after the conditioning block); ungrounded heads -> kind "medusa" with
  ``shared_all_blocks`` (all L blocks one object). "prefix-mlp" (Hydra++) puts a Dropout
  before every block and LM head (so block keys sit at odd indices) and adds
  ``prefix_embeding_layer`` (sic), a 1-layer Llama model -> our `PrefixLayer`. Per-head LM
  heads with bias -> ``shared_lm_head=False, lm_head_bias=True``. The stored copy of the base
  embedding (``input_embed_fn.weight``) and the prefix model's own embedding and old RoPE
  buffer are checked and dropped; the base model is never modified.
* **Medusa** (``medusa_lm_head.pt``): ``ModuleList([Sequential(*[ResBlock(h)] * L,
  Linear(h, V, bias=False))] * K)`` -> kind "medusa", per-head LM heads without bias,
  ``shared_all_blocks`` when L > 1.

Loading is strict: unknown, missing or mis-shaped keys, copies of a shared block that
differ, and heads built for another base model raise `CheckpointError` with one line. Files
are read with ``torch.load(weights_only=True)`` only.

Weights keep the checkpoint's floating dtype (fp16 for the released heads; a fp32 copy of a
7B Hydra++ checkpoint would take ~5 GB). `HeadRunner` casts to the base model's dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .errors import one_line
from .heads import DraftHeads, HeadsConfig
from .heads_io import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, load_state_strict, name_list

HYDRA_FILE = "hydra_lm_head.pt"
MEDUSA_FILE = "medusa_lm_head.pt"
HYDRA_ARCHS = ("mlp", "prefix-mlp")
UNSUPPORTED_HYDRA_ARCHS = ("cross-attn", "eagle-attn")

# prefix_embeding_layer.<published name> -> prefix.<our name>
_PREFIX_NAMES = {
    "layers.0.self_attn.q_proj.weight": "q_proj.weight",
    "layers.0.self_attn.k_proj.weight": "k_proj.weight",
    "layers.0.self_attn.v_proj.weight": "v_proj.weight",
    "layers.0.self_attn.o_proj.weight": "o_proj.weight",
    "layers.0.mlp.gate_proj.weight": "gate_proj.weight",
    "layers.0.mlp.up_proj.weight": "up_proj.weight",
    "layers.0.mlp.down_proj.weight": "down_proj.weight",
    "layers.0.input_layernorm.weight": "input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "norm.weight": "norm.weight",
}
_PREFIX = "prefix_embeding_layer."
_INV_FREQ = _PREFIX + "layers.0.self_attn.rotary_emb.inv_freq"


def _load_error(path: Path, e: BaseException) -> str:
    """A short reason why torch.load(weights_only=True) failed."""
    import pickle
    import zipfile

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    if isinstance(e, pickle.UnpicklingError) and "weights only" in text.lower():
        why = next((ln.strip() for ln in text.splitlines() if "WeightsUnpickler error" in ln), "")
        why = why.replace("WeightsUnpickler error: ", "")
        why = why[:160] + ("..." if len(why) > 160 else "")
        return "it holds objects other than tensors, refused by weights_only loading" + (f": {why}" if why else "")
    if not zipfile.is_zipfile(path):
        return f"not a torch.save zip archive; {one_line(e, 200, typed=True)}"
    return one_line(e, 200, typed=True)


def _text_config(base_config):
    return base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config


def check_base(cfg: HeadsConfig, base_config, source: str) -> None:
    """One-line error when heads built for another model meet `base_config` (None: no check)."""
    if base_config is None:
        return
    txt = _text_config(base_config)
    hidden = getattr(txt, "hidden_size", None) or getattr(txt, "n_embd", None)
    vocab = getattr(txt, "vocab_size", None)
    if hidden is not None and cfg.hidden_size != hidden:
        raise CheckpointError(f"{source}: heads built for hidden size {cfg.hidden_size}, but the base model has "
                              f"hidden size {hidden}")
    if vocab is not None and cfg.vocab_size != vocab:
        raise CheckpointError(f"{source}: heads built for a vocabulary of {cfg.vocab_size}, but the base model has "
                              f"{vocab} tokens")


def load_published(d: Path, raw: dict, base_config=None) -> DraftHeads:
    """Load a published Hydra / Hydra++ or Medusa head directory (`raw` = its config.json)."""
    if str(raw.get("format", "")).startswith("entmtp-heads"):
        raise CheckpointError(f"{d}: no {WEIGHTS_FILE}")
    if any(k.startswith("hydra_") for k in raw):
        return load_hydra(d, raw, base_config)
    if any(k.startswith("medusa_") for k in raw):
        return load_medusa(d, raw, base_config)
    raise CheckpointError(f"{d / CONFIG_FILE}: not a head checkpoint (neither our format, Hydra's nor Medusa's)")


# --------------------------------------------------------------------------- helpers


def _torch_state(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: no {path.name}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt zip, pickle refusing non-tensor objects, truncated file...
        raise CheckpointError(f"{path}: unreadable torch checkpoint ({_load_error(path, e)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a state dict (holds a {type(state).__name__})")
    bad = sorted(str(k) for k, v in state.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor)))
    if bad:
        raise CheckpointError(f"{path}: entries that are not tensors: {name_list(bad)}")
    return state


def _int_field(raw: dict, name: str, default: int, source: Path) -> int:
    v = raw.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"{source}: {name} must be an integer >= 1, got {v!r}")
    return v


@dataclass
class _Key:
    """What one published key becomes: `ours` (None: dropped after a shape check)."""

    ours: Optional[str]
    shape: tuple
    optional: bool = False


def _map_state(state: dict[str, torch.Tensor], expected: dict[str, _Key], source: str) -> dict[str, torch.Tensor]:
    """Strict key check in the *published* names, then rename to ours."""
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise CheckpointError(f"{source}: unknown keys {name_list(unknown)}")
    missing = [k for k, e in expected.items() if not e.optional and k not in state]
    if missing:
        raise CheckpointError(f"{source}: missing keys {name_list(missing)}")
    bad = [f"{k} {tuple(state[k].shape)} != {e.shape}" for k, e in expected.items()
           if k in state and tuple(state[k].shape) != tuple(e.shape)]
    if bad:
        raise CheckpointError(f"{source}: mis-shaped keys {name_list(bad)} (heads built for another model size?)")
    notfloat = [k for k in state if not state[k].is_floating_point()]
    if notfloat:
        raise CheckpointError(f"{source}: non-floating-point tensors {name_list(notfloat)}")
    return {e.ours: state[k] for k, e in expected.items() if e.ours is not None and k in state}


def _check_copies(state: dict[str, torch.Tensor], groups: list[list[str]], source: str) -> None:
    """Keys in one group name one shared module of the original: their tensors must be equal."""
    for group in groups:
        first = state[group[0]]
        for k in group[1:]:
            t = state[k]
            same = t.data_ptr() == first.data_ptr() and t.stride() == first.stride()
            if not (same or torch.equal(t, first)):
                raise CheckpointError(f"{source}: {k} differs from {group[0]}, but the original model shares that "
                                      "block (one module stored under both keys)")


def _new_heads(cfg: HeadsConfig, dtype: torch.dtype) -> DraftHeads:
    """Heads with uninitialised storage (every parameter is then loaded): no costly random init."""
    with torch.device("meta"):
        heads = DraftHeads(cfg)
    return heads.to(dtype=dtype).to_empty(device="cpu")


def _own_shapes(cfg: HeadsConfig) -> dict[str, tuple]:
    with torch.device("meta"):
        heads = DraftHeads(cfg)
    return {k: tuple(v.shape) for k, v in heads.state_dict().items()}


def _finish(cfg: HeadsConfig, mapped: dict[str, torch.Tensor], dtype: torch.dtype, source: str,
            meta: dict[str, Any]) -> DraftHeads:
    heads = _new_heads(cfg, dtype)
    load_state_strict(heads, mapped, source)
    heads.meta = meta
    return heads.eval()


def _float_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.is_floating_point() else torch.float32


def _lm_shape(state: dict[str, torch.Tensor], key: str, source: str) -> tuple[int, int]:
    """(vocab, hidden) from head 0's LM-head weight: the checkpoint's own model size."""
    w = state.get(key)
    if w is None:
        raise CheckpointError(f"{source}: missing keys {key}")
    if w.dim() != 2:
        raise CheckpointError(f"{source}: mis-shaped keys {key} {tuple(w.shape)} (expected [vocab, hidden])")
    return int(w.shape[0]), int(w.shape[1])


def _check_counts(state: dict, pattern: str, what: str, want, cfg_name: str, cfg_value: int, source: str) -> None:
    """Friendlier than a list of missing / unknown keys when config.json and the weights disagree."""
    found = {int(m.group(1)) for k in state if (m := re.match(pattern, k))}
    if found and found != set(want):
        raise CheckpointError(f"{source}: config.json says {cfg_name}={cfg_value}, but the weights hold {what} "
                              f"{name_list([str(i) for i in sorted(found)])}")


# --------------------------------------------------------------------------- Hydra


def _prefix_fields(raw: dict, base_config, source: Path) -> tuple[dict, Any]:
    """HeadsConfig fields of the prefix layer, from the base model's config."""
    if base_config is None:
        name = raw.get("base_model_name_or_path") or ""
        why = "config.json names no base model"
        if name:
            try:
                from transformers import AutoConfig

                base_config = AutoConfig.from_pretrained(name)
            except Exception as e:  # offline, unknown repo, no such directory...
                why = f"could not load the config of {name!r}: {one_line(e, 200, typed=True)}"
        if base_config is None:
            raise CheckpointError(f"{source}: the Hydra++ prefix layer needs the base model's config; pass "
                                  f"base_config= (the base model's config) to load_heads ({why})")
    txt = _text_config(base_config)
    rp = getattr(txt, "rope_parameters", None) or getattr(txt, "rope_scaling", None)
    rope_type = (rp.get("rope_type") or rp.get("type")) if isinstance(rp, dict) else None
    if rope_type not in (None, "default"):
        raise CheckpointError(f"{source}: the base model uses {rope_type!r} RoPE scaling, which the Hydra++ prefix "
                              "layer does not support")
    act = getattr(txt, "hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: the base model's activation is {act!r}; the Hydra++ prefix layer needs 'silu'")
    ref = HeadsConfig.for_base(base_config, "hydra")
    nh = ref.num_attention_heads
    head_dim = getattr(txt, "head_dim", None)
    if not nh or (head_dim and head_dim * nh != ref.hidden_size):
        raise CheckpointError(f"{source}: the base model's attention shape (heads {nh}, head_dim {head_dim}) does "
                              "not fit the Hydra++ prefix layer (head_dim = hidden / heads)")
    fields = dict(num_attention_heads=nh, num_key_value_heads=ref.num_key_value_heads,
                  intermediate_size=ref.intermediate_size, rms_norm_eps=ref.rms_norm_eps, rope_theta=ref.rope_theta)
    return fields, base_config


def _check_inv_freq(state: dict, cfg: HeadsConfig, source: str) -> None:
    """The saved RoPE buffer (old transformers) must agree with the base config's heads and theta."""
    inv = state.get(_INV_FREQ)
    if inv is None:
        return
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    want = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if tuple(inv.shape) != tuple(want.shape) or not torch.allclose(inv.double(), want, rtol=1e-2, atol=0):
        raise CheckpointError(f"{source}: {_INV_FREQ} does not match the base config (head_dim {head_dim}, rope_theta "
                              f"{cfg.rope_theta:g}): wrong base model?")


def load_hydra(d: Path, raw: dict, base_config=None) -> DraftHeads:
    """A published Hydra / Hydra++ head directory (`config.json` + `hydra_lm_head.pt`)."""
    cfg_path = d / CONFIG_FILE
    arch = raw.get("hydra_head_arch", "mlp")
    if arch in UNSUPPORTED_HYDRA_ARCHS:
        raise CheckpointError(f"{cfg_path}: hydra_head_arch {arch!r} is not supported (only 'mlp' and 'prefix-mlp')")
    if arch not in HYDRA_ARCHS:
        raise CheckpointError(f"{cfg_path}: unknown hydra_head_arch {arch!r} (supported: 'mlp', 'prefix-mlp')")
    K = _int_field(raw, "hydra_num_heads", 4, cfg_path)
    L = _int_field(raw, "hydra_num_layers", 1, cfg_path)
    grounded = raw.get("grounded_heads", False)
    if not isinstance(grounded, bool):
        raise CheckpointError(f"{cfg_path}: grounded_heads must be true or false, got {grounded!r}")
    offset = raw.get("hidden_state_offset", 0)
    if offset != 0:
        raise CheckpointError(f"{cfg_path}: hidden_state_offset {offset!r} is not supported (heads must read the "
                              "base model's final hidden state, offset 0)")
    prefix = arch == "prefix-mlp"
    src = str(d / HYDRA_FILE)
    state = _torch_state(d / HYDRA_FILE)

    # Published index of block j (0..L-1) in head k's Sequential, and the LM-head key prefix.
    blk = (lambda j: 2 * j + 1) if prefix else (lambda j: j)
    lm = (lambda k: f"hydra_lm_head.{k}.1.") if prefix else (lambda k: f"hydra_lm_head.{k}.")
    _check_counts(state, r"hydra_(?:mlp|lm_head)\.(\d+)\.", "heads", range(K), "hydra_num_heads", K, src)
    _check_counts(state, r"hydra_mlp\.0\.(\d+)\.linear\.weight$", "blocks at indices", [blk(j) for j in range(L)],
                  "hydra_num_layers", L, src)
    V, h = _lm_shape(state, lm(0) + "weight", src)

    fields: dict[str, Any] = {}
    if prefix:
        fields, base_config = _prefix_fields(raw, base_config, cfg_path)
    try:
        cfg = HeadsConfig(
            kind="hydra" if grounded else "medusa", num_heads=K, hidden_size=h, vocab_size=V, num_layers=L,
            prefix_layer=prefix, shared_lm_head=False, lm_head_bias=True, shared_block=L > 1,
            shared_all_blocks=(not grounded) and L > 1, base_model=str(raw.get("base_model_name_or_path") or ""),
            notes={"source": "hydra", "hydra_head_arch": arch, "grounded_heads": grounded}, **fields)
    except ValueError as e:
        raise CheckpointError(f"{cfg_path}: {one_line(e, 200, typed=True)}") from None
    check_base(cfg, base_config, src)
    own = _own_shapes(cfg)

    expected: dict[str, _Key] = {}
    groups: list[list[str]] = []
    for k in range(K):
        shared = []
        for j in range(L):
            pub, ours = f"hydra_mlp.{k}.{blk(j)}.", f"blocks.{k}.{j}."
            names = ["linear.weight", "linear.bias"]
            if grounded and j == 0:
                names += ["res_connection.weight", "res_connection.bias"]
            for n in names:
                expected[pub + n] = _Key(ours + n, own[ours + n])
            if j >= (1 if grounded else 0):
                shared.append(pub)
        if len(shared) > 1:
            groups += [[p + n for p in shared] for n in ("linear.weight", "linear.bias")]
        for n in ("weight", "bias"):
            expected[lm(k) + n] = _Key(f"lm_heads.{k}.{n}", own[f"lm_heads.{k}.{n}"])
    expected["input_embed_fn.weight"] = _Key(None, (V, h), optional=True)
    if prefix:
        for pub, ours in _PREFIX_NAMES.items():
            expected[_PREFIX + pub] = _Key("prefix." + ours, own["prefix." + ours])
        expected[_PREFIX + "embed_tokens.weight"] = _Key(None, (V, h), optional=True)
        expected[_INV_FREQ] = _Key(None, (h // cfg.num_attention_heads // 2,), optional=True)
    mapped = _map_state(state, expected, src)
    _check_copies(state, groups, src)
    if prefix:
        _check_inv_freq(state, cfg, src)
    meta = {"source": "hydra", "path": str(d), "hydra_head_arch": arch, "grounded_heads": grounded,
            "base_model_name_or_path": cfg.base_model}
    return _finish(cfg, mapped, _float_dtype(state[lm(0) + "weight"]), src, meta)


# --------------------------------------------------------------------------- Medusa


def load_medusa(d: Path, raw: dict, base_config=None) -> DraftHeads:
    """A published Medusa (v1) head directory (`config.json` + `medusa_lm_head.pt`)."""
    cfg_path = d / CONFIG_FILE
    K = _int_field(raw, "medusa_num_heads", 4, cfg_path)
    L = _int_field(raw, "medusa_num_layers", 1, cfg_path)
    wpath = d / MEDUSA_FILE
    if not wpath.is_file():
        raise CheckpointError(f"{d}: no {MEDUSA_FILE} (Medusa-2 full-model checkpoints are not supported)")
    src = str(wpath)
    state = _torch_state(wpath)
    _check_counts(state, r"(\d+)\.", "heads", range(K), "medusa_num_heads", K, src)
    _check_counts(state, r"0\.(\d+)\.linear\.weight$", "blocks", range(L), "medusa_num_layers", L, src)
    V, h = _lm_shape(state, f"0.{L}.weight", src)
    # All L blocks of a head are one module in the original (`[ResBlock(h)] * L`):
    # `shared_all_blocks` rebuilds exactly that, so fine-tuning keeps the tie.
    cfg = HeadsConfig(kind="medusa", num_heads=K, hidden_size=h, vocab_size=V, num_layers=L, shared_lm_head=False,
                      lm_head_bias=False, shared_block=L > 1, shared_all_blocks=L > 1,
                      base_model=str(raw.get("base_model_name_or_path") or ""), notes={"source": "medusa"})
    check_base(cfg, base_config, src)
    own = _own_shapes(cfg)
    expected: dict[str, _Key] = {}
    groups: list[list[str]] = []
    for k in range(K):
        for j in range(L):
            for n in ("linear.weight", "linear.bias"):
                expected[f"{k}.{j}.{n}"] = _Key(f"blocks.{k}.{j}.{n}", own[f"blocks.{k}.{j}.{n}"])
        if L > 1:
            groups += [[f"{k}.{j}.{n}" for j in range(L)] for n in ("linear.weight", "linear.bias")]
        expected[f"{k}.{L}.weight"] = _Key(f"lm_heads.{k}.weight", own[f"lm_heads.{k}.weight"])
    mapped = _map_state(state, expected, src)
    _check_copies(state, groups, src)
    meta = {"source": "medusa", "path": str(d), "base_model_name_or_path": cfg.base_model}
    return _finish(cfg, mapped, _float_dtype(state[f"0.{L}.weight"]), src, meta)


__all__ = ["load_published", "load_hydra", "load_medusa", "check_base", "HYDRA_FILE", "MEDUSA_FILE"]
