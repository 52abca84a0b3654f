"""Where entmtp's files live: the embedded heads it ships, and what it computes once per machine
(converted models, built kernels, tuning profiles, latency models)."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

# the embedded heads of the default model: kind -> directory under DEFAULT_HEADS_DIR
DEFAULT_HEADS_DIR = Path(__file__).resolve().parent.parent / "assets" / "heads"
HEAD_KINDS = {
    "medusa": "smollm2-135m-medusa",
    "hydra": "smollm2-135m-hydra",
    "hydra++": "smollm2-135m-hydrapp",
}


def cache_dir() -> Path:
    """``$ENTMTP_CACHE`` if set, else ``$XDG_CACHE_HOME/entmtp``, else ``~/.cache/entmtp``."""
    env = os.environ.get("ENTMTP_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "entmtp"
    return Path.home() / ".cache" / "entmtp"


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w", *, fsync: bool = False) -> Iterator[IO]:
    """A file opened for writing in place of `path` (its directory created): a temporary file
    beside it that replaces `path` with `os.replace` when the block ends, so a reader (another
    process loading the same cache) sees the old file or the new one, never half of one. fsync:
    flush to disk before the rename, for files that mark other files complete. On an error the
    temporary is removed and the error propagates."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any, *, indent: int = 1, sort_keys: bool = False, fsync: bool = False,
                      default: Optional[Callable[[Any], Any]] = None) -> None:
    """Write `data` as JSON (and a final newline) to `path` through `atomic_file`: whole or not at all."""
    with atomic_file(path, fsync=fsync) as f:
        json.dump(data, f, indent=indent, sort_keys=sort_keys, default=default)
        f.write("\n")


__all__ = ["DEFAULT_HEADS_DIR", "HEAD_KINDS", "cache_dir", "atomic_file", "write_json_atomic"]
