"""The method registry: one meaning per method name, whichever face asks."""

import pytest
import torch

from conftest import random_heads, tiny_model
from entmtp.decoding import Engine
from entmtp.methods import (CUSTOM, DEFAULT_LOOKUP, METHODS, OUR_METHODS, MethodError, get_method, heads_to_load,
                            make_runner, method_heads, method_lookup, parse_methods)
from entmtp.scheduler import Scheduler


def test_every_method_once_with_its_label():
    assert list(METHODS) == ["hf", "pld", "baseline", "lookup", "medusa", "hydra", "hydra++", "entmtp", "dynamic"]
    assert METHODS["hf"].label == "HF generate, greedy"
    assert len({m.label for m in METHODS.values()}) == len(METHODS)
    assert OUR_METHODS == ("baseline", "lookup", "medusa", "hydra", "hydra++", "entmtp", "dynamic")
    assert DEFAULT_LOOKUP == {"lookup": (8, 1), "entmtp": (4, 1)}
    assert [m for m, v in METHODS.items() if v.heads is None] == ["hf", "pld", "baseline", "lookup"]


def test_heads_follow_what_is_loaded():
    # the Hydra family takes the best loaded (Hydra++ first); without runners: what would be loaded
    assert method_heads("entmtp", ["medusa", "hydra"]) == "hydra"
    assert method_heads("entmtp", ["hydra", "hydra++"]) == "hydra++"
    assert method_heads("dynamic") == "hydra++" and method_heads("medusa", ["hydra"]) == "medusa"
    assert method_heads("baseline", ["hydra"]) is None and method_heads("hf") is None
    # user-supplied heads serve every method with heads, none without
    assert method_heads("medusa", [CUSTOM]) == CUSTOM and method_heads("lookup", [CUSTOM]) is None
    # a family method loads every Hydra-family kind, so that the fastest here can be chosen
    assert heads_to_load(["hf", "baseline", "medusa", "entmtp", "dynamic"]) == ["hydra", "hydra++", "medusa"]
    assert heads_to_load(["hydra", "medusa"]) == ["hydra", "medusa"]


def test_unknown_methods_are_one_line_errors():
    assert parse_methods(" hf, entmtp ,") == ["hf", "entmtp"]
    with pytest.raises(MethodError, match="unknown method\\(s\\) warp; choose from baseline, lookup"):
        parse_methods("baseline,warp", OUR_METHODS)
    with pytest.raises(MethodError, match="no methods"):
        parse_methods(" , ")
    with pytest.raises(MethodError, match="unknown method 'eagle'"):
        get_method("eagle")
    assert isinstance(MethodError("x"), ValueError)  # a user error wherever ValueErrors are


def test_runners_decode_what_the_registry_says():
    m = tiny_model("llama", vocab=64, seed=3)
    eng = Engine(m, None, {"hydra": random_heads(m, "hydra", num_heads=3, seed=2)})
    ids = list(range(5, 17))
    hf = make_runner(eng, "hf", 8)(ids)
    base = make_runner(eng, "baseline", 8)(ids)
    hydra = make_runner(eng, "hydra", 8, tree="binary_2x2", progress=None)
    assert type(hydra.scheduler) is Scheduler and hydra.heads == "hydra" and hydra.config.lookup == 0
    out = hydra(ids)
    assert hf.tokens == base.tokens == out.tokens and len(out.tokens) == 8  # greedy, float32: lossless
    assert hf.forwards == 8 and base.forwards == 8 and out.forwards <= 8 and out.result is not None
    assert "binary_2x2" in hydra.label and base.result.tau == 1.0
    entmtp = make_runner(eng, "entmtp", 8, tree="binary_2x2", scheduler="static", progress=None)
    assert entmtp.heads == "hydra" and entmtp.config.lookup == method_lookup("entmtp")["lookup"] == 4
    with pytest.raises(MethodError, match="medusa needs medusa heads"):
        make_runner(eng, "medusa", 8)
    assert torch.equal(torch.tensor(entmtp(ids).tokens), torch.tensor(base.tokens))


def test_family_heads_are_the_fastest_tuned_here(monkeypatch):
    """With an engine, entmtp's Hydra-family heads are the ones this machine's tuning predicts
    fastest (Hydra's cheaper draft can beat Hydra++'s higher tau); untuned, the registry order."""
    from types import SimpleNamespace

    from entmtp import autotune, methods
    from entmtp.autotune import best_speedup

    engine = SimpleNamespace(runners={"hydra": object(), "hydra++": object(), "medusa": object()})
    predicted = {"hydra": SimpleNamespace(predicted_speedup=1.9, bank_speedup=None),
                 "hydra++": SimpleNamespace(predicted_speedup=1.6, bank_speedup=1.7)}
    monkeypatch.setattr(autotune, "tuned_trees", lambda eng, h, progress=None, prefills=None: predicted[h])
    timed_apart = {"hydra": 1.0, "hydra++": 1.0}  # the side-by-side timing's correction of each prediction
    monkeypatch.setattr(methods, "compared_speedups",
                        lambda eng, tuned, progress=None: {h: best_speedup(t) * timed_apart[h] for h, t in tuned.items()})
    assert methods.fastest_family(engine) == "hydra"
    timed_apart["hydra++"] = 1.2  # timed beside Hydra, Hydra++'s steps were cheaper than its own model said
    assert methods.fastest_family(engine) == "hydra++"
    timed_apart["hydra++"] = 1.0
    assert method_heads("entmtp", engine=engine) == "hydra" and method_heads("hydra++", engine=engine) == "hydra++"
    predicted["hydra++"] = SimpleNamespace(predicted_speedup=1.6, bank_speedup=2.1)  # its bank wins
    assert method_heads("entmtp", engine=engine) == "hydra++"
    monkeypatch.setattr(autotune, "tuned_trees", lambda eng, h, progress=None, prefills=None: None)  # ENTMTP_TUNE=0
    assert methods.fastest_family(engine) is None and method_heads("entmtp", engine=engine) == "hydra++"
    assert methods.fastest_family(SimpleNamespace(runners={"hydra": object()})) is None


def test_generate_gets_its_own_fastest_thread_count(monkeypatch):
    """A bench times transformers' methods with the thread count they run fastest with (1 or all
    cores), not the one measured for our kernels; the process's count is restored after each call."""
    import time

    from entmtp import methods

    m = tiny_model("llama", vocab=64, seed=3)
    eng = Engine(m, None, {})
    monkeypatch.setattr(methods, "default_threads", lambda: 2)
    seen = []

    def fake_generate(engine, ids, max_new_tokens, **extra):  # 2 threads twice as slow as 1, then the reverse
        n = torch.get_num_threads()
        seen.append(n)
        time.sleep(0.02 * (n if slow_with_more else 3 - n))
        return methods.Output([7] * max_new_tokens, max_new_tokens)

    monkeypatch.setattr(methods, "hf_generate", fake_generate)
    before = torch.get_num_threads()
    for slow_with_more, want in ((True, 1), (False, 2)):
        hf = make_runner(eng, "hf", 4)
        seen.clear()
        assert methods.fit_stock_threads(hf, [5, 6, 7]) == want == hf.threads
        assert seen == [1, 2, 2, 1]  # the counts timed in turns, the order alternated
        assert torch.get_num_threads() == before
        seen.clear()
        hf([5, 6, 7])
        assert seen == [want] and torch.get_num_threads() == before
    base = make_runner(eng, "baseline", 4)
    assert methods.fit_stock_threads(base, [5, 6, 7]) is None and base.threads is None  # ours: the engine's count


def test_entmtp_lookup_branch_is_the_one_tuned_here(monkeypatch):
    """entmtp's prompt-lookup branch follows this machine's tuning (`autotune.choose_lookup`): off,
    or after the shortest match that pays here; explicit values win; untuned, the registry's."""
    from types import SimpleNamespace

    from entmtp import methods

    engine = SimpleNamespace(runners={"hydra++": SimpleNamespace(heads=SimpleNamespace(meta={}))}, dtype="bfloat16",
                             device="cpu")
    tuned = SimpleNamespace(lookup_min_ngram=2)
    monkeypatch.setattr(methods, "tuned_trees", lambda eng, h, progress=None: tuned)
    assert method_lookup("entmtp", engine, "hydra++") == {"lookup": 4, "lookup_min_ngram": 2}
    tuned.lookup_min_ngram = 0  # the branch does not pay here
    assert method_lookup("entmtp", engine, "hydra++") == {"lookup": 0, "lookup_min_ngram": 1}
    assert method_lookup("entmtp", engine, "hydra++", lookup=6, min_ngram=3) == {"lookup": 6, "lookup_min_ngram": 3}
    assert method_lookup("hydra", engine, "hydra++") == {"lookup": 0, "lookup_min_ngram": 1}  # pure heads
    tuned.lookup_min_ngram = None  # statistics without tokens: the registry's default
    assert method_lookup("entmtp", engine, "hydra++") == {"lookup": 4, "lookup_min_ngram": 1}
    monkeypatch.setattr(methods, "tuned_trees", lambda eng, h, progress=None: None)  # ENTMTP_TUNE=0
    assert method_lookup("entmtp", engine, "hydra++") == {"lookup": 4, "lookup_min_ngram": 1}
