"""scripts/mutants.py stays meaningful: every mutant's patch still applies to the current
sources (a refactor that moves the text must update the mutant, not silently neuter it), changes
them into valid Python, and names tests that exist."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("entmtp_mutants_script", ROOT / "scripts" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


mutants = load_script()


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_patch_applies_to_the_current_sources(m):
    text = (ROOT / m.path).read_text()
    out = mutants.patched(m, text)
    assert out != text and m.new in out
    if m.path.endswith(".py"):
        ast.parse(out)  # still Python: a failing test then means the bug was caught, not a syntax error


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_named_tests_exist(m):
    assert m.tests
    for node in m.tests:
        path, _, name = node.partition("::")
        source = (ROOT / path).read_text()
        assert f"def {name}(" in source, f"{node} is not a test any more"


def test_a_moved_target_fails_loudly(tmp_path):
    m = mutants.MUTANTS[0]
    (tmp_path / m.path).parent.mkdir(parents=True)
    (tmp_path / m.path).write_text("# the code moved elsewhere\n")
    with pytest.raises(mutants.PatchError, match=m.name):
        mutants.apply(m, tmp_path)
    twice = mutants.MUTANTS[1]
    with pytest.raises(mutants.PatchError, match="2 times"):
        mutants.patched(twice, twice.old * 2)


def test_copy_is_the_working_tree_without_ignored_files(tmp_path):
    files = mutants.working_tree_files(ROOT)
    assert "scripts/mutants.py" in files and "entmtp/decoding.py" in files
    assert not any(f.startswith((".venv/", ".git/")) or "__pycache__" in f for f in files)
