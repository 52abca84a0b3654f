import json

import pytest
import torch

from entmtp.trees import TREES_DIR, Tree, TreeError, canonical_paths, load_tree, resolve_tree


def test_canonical_order_and_structure():
    t = Tree.from_paths([[1, 0], [0], [2], [1], [0, 3]], "t")
    assert t.paths == ((0,), (1,), (2,), (0, 3), (1, 0))
    assert t.parent_list == [-1, 0, 0, 0, 1, 2]
    assert t.children == [[1, 2, 3], [4], [5], [], [], []]
    assert t.depth == 2 and t.n_nodes == 5 and t.size == 6
    assert t.depth_counts == [3, 2]
    assert t.leaves == [3, 4, 5]


@pytest.mark.parametrize("paths,needle", [
    ([[0], [0, 1, 2]], "[0, 1, 2] has no parent [0, 1]"),
    ([[0], [0]], "[0] appears twice"),
    ([[0], [-1]], "non-negative"),
    ([[0], []], "non-empty"),
    ([[0], "ab"], "non-empty list"),
    ([[0], [0.5]], "non-negative integers"),
])
def test_invalid_trees_name_the_path(paths, needle):
    with pytest.raises(TreeError) as e:
        Tree.from_paths(paths)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_buffers_mask_positions_retrieve_levels():
    # gaps in ranks, and the expanded sibling (rank 2) is not the lowest ranked
    t = Tree.from_paths([[0], [2], [0, 1], [2, 0], [2, 0, 3]])
    b = t.buffers("cpu")
    assert b.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert b.parents.tolist() == [-1, 0, 0, 1, 2, 4]
    anc = b.ancestor.int().tolist()
    assert anc[5] == [1, 0, 1, 0, 1, 1]  # node 5 = [2,0,3]: root, [2], [2,0], itself
    assert anc[3] == [1, 1, 0, 1, 0, 0]
    assert b.retrieve.tolist() == [[0, 1, 3, -1], [0, 2, 4, 5]]
    assert b.level_nodes[1].tolist() == [1, 2] and b.level_ranks[1].tolist() == [0, 2]
    assert b.level_topk[1] == 3 and b.level_topk[3] == 4
    assert b.level_expand[1].tolist() == [0, 1]
    assert b.level_parent_row[2].tolist() == [0, 1]
    assert b.level_parent_row[3].tolist() == [0]  # [2,0] is the only expanded node of level 2
    bias = b.attention_bias(torch.float32)
    assert bias[5, 3] == torch.finfo(torch.float32).min and bias[5, 4] == 0
    assert t.buffers("cpu") is b  # built once per device


def test_root_only_and_chain():
    r = Tree.from_paths([])
    assert r.size == 1 and r.depth == 0 and r.buffers().ancestor.shape == (1, 1)
    c = Tree.chain(4)
    assert c.paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))


def test_json_roundtrip_and_networkx(tmp_path):
    t = Tree.from_paths([[0], [1], [0, 0]], "x")
    p = tmp_path / "x.json"
    t.save(p, {"note": "hi"})
    t2 = load_tree(p)
    assert t2 == t and json.loads(p.read_text())["note"] == "hi"
    g = t.to_networkx()
    assert sorted(g.edges) == [(0, 1), (0, 2), (1, 3)]
    assert g.nodes[3]["path"] == (0, 0)


def test_shipped_trees():
    mc = resolve_tree("mc_sim_7b_63")
    assert mc.n_nodes == 63 and mc.depth_counts == [10, 28, 23, 2] and len(mc.leaves) == 42
    for k in range(1, 6):
        assert resolve_tree(f"chain_{k}").n_nodes == k
    files = [p for p in TREES_DIR.glob("*.json") if not p.name.endswith("-bank.json")]  # banks: test_scheduler
    assert {"binary_2x2", "gappy_5", "wide3_chain2"} <= {p.stem for p in files}
    for p in files:
        load_tree(p)


@pytest.mark.parametrize("content,needle", [
    ("{\"paths\": [[0], [0, 1, 2]]}", "no parent"),
    ("[[0], [1]", "invalid JSON"),
    ("{\"nodes\": 3}", "no 'paths'"),
    ("\"abc\"", "must be a list"),
])
def test_malformed_tree_files_one_line(tmp_path, content, needle):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(TreeError) as e:
        load_tree(p)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_binary_tree_file(tmp_path):
    p = tmp_path / "bin.json"
    p.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(TreeError, match="not a UTF-8"):
        load_tree(p)


def test_unknown_tree_name():
    with pytest.raises(TreeError, match="unknown tree"):
        resolve_tree("no_such_tree")


def test_canonical_paths_is_order_independent():
    a = canonical_paths([[0], [1], [0, 0], [1, 3]])
    b = canonical_paths([[1, 3], [0, 0], [1], [0]])
    assert a == b
