"""Where entmtp keeps its files, and how it writes the ones other processes read."""

import json

import pytest

from entmtp.paths import write_json_atomic


def test_json_is_written_whole_or_not_at_all(tmp_path):
    """A cache file is replaced in one step: a write that fails half way (data JSON cannot hold)
    leaves the old file as it was and no temporary file beside it."""
    path = tmp_path / "machine" / "profile.json"
    write_json_atomic(path, {"b": 2, "a": [1, 2]}, sort_keys=True)
    assert json.loads(path.read_text()) == {"a": [1, 2], "b": 2}
    assert path.read_text().index('"a"') < path.read_text().index('"b"') and path.read_text().endswith("\n")
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": [1, 2], "b": 2}
    assert [p.name for p in path.parent.iterdir()] == ["profile.json"]
    write_json_atomic(path, {"when": object()}, default=lambda o: "object", fsync=True)
    assert json.loads(path.read_text()) == {"when": "object"}
