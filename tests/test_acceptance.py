"""Acceptance rules: warping matches transformers, and speculative sampling preserves the
base model's distribution (a chi-square test with a negative control)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import random_heads, tiny_model
from entmtp.acceptance import GreedyRule, Sampling, SpeculativeSamplingRule, TypicalRule, make_rule, warp
from entmtp.decoding import DecodeConfig, Engine
from entmtp.trees import Tree


@pytest.mark.parametrize("t,k,p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8), (0.6, 7, 0.5), (1.0, 1, 1.0)])
def test_warp_matches_transformers(t, k, p):
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    ref = logits.clone()
    ref = TemperatureLogitsWarper(t)(None, ref)
    if k:
        ref = TopKLogitsWarper(k)(None, ref)
    if p < 1:
        ref = TopPLogitsWarper(p)(None, ref)
    assert torch.allclose(warp(logits, Sampling(t, p, k)), ref.softmax(-1), atol=1e-6)


def test_greedy_walk_picks_the_matching_branch_not_the_first():
    tree = Tree.from_paths([[0], [1], [1, 0], [1, 1]])
    tokens = [7, 3, 4, 9, 5]  # root 7; children 3 (rank 0) and 4 (rank 1); under 4: 9 and 5
    logits = torch.full((5, 12), -5.0)
    logits[0, 4] = 5  # after root the base emits 4 -> node 2
    logits[2, 5] = 5  # after 4 it emits 5 -> node 4
    logits[4, 11] = 5  # then 11: the bonus
    acc = GreedyRule().accept(tree, tokens, logits)
    assert acc.path == [0, 2, 4] and acc.bonus == 11


def test_rule_factory():
    assert isinstance(make_rule("auto", Sampling()), GreedyRule)
    assert isinstance(make_rule("auto", Sampling(0.8)), SpeculativeSamplingRule)
    assert isinstance(make_rule("typical", Sampling(0.8)), TypicalRule)
    with pytest.raises(ValueError):
        make_rule("nope")
    with pytest.raises(ValueError):
        Sampling(top_p=0)


def _exact_joint(model, prompt, s: Sampling):
    """P(t1, t2) under the base model's warped distribution, by enumeration. [V, V]."""
    V = model.config.vocab_size
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1], s)
        seqs = torch.tensor([prompt + [t] for t in range(V)])
        p2 = warp(model(seqs).logits[:, -1], s)
    joint = (p1[:, None] * p2).double().numpy()
    return joint / joint.sum()


def _sampled_joint(eng, prompt, s, rule=None, n=2500):
    V = eng.model.config.vocab_size
    counts = np.zeros((V, V))
    accepted = 0
    tree = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    for seed in range(n):
        r = eng.run(prompt, heads="hydra", tree=tree, rule=rule,
                    config=DecodeConfig(max_new_tokens=2, sampling=s, seed=seed, eos_token_ids=()))
        counts[r.tokens[0], r.tokens[1]] += 1
        accepted += r.steps[0].accept_length > 0
    return counts, accepted / n


def _chi2_p(counts, probs):
    mask = probs.flatten() * counts.sum() >= 5  # pool sparse cells, as chi-square needs
    obs = np.append(counts.flatten()[mask], counts.flatten()[~mask].sum())
    exp = np.append(probs.flatten()[mask], probs.flatten()[~mask].sum()) * counts.sum()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.fixture(scope="module")
def sampling_engine():
    m = tiny_model("llama", vocab=6, seed=11)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(0.35)  # a spread-out distribution over 6 tokens
    heads = random_heads(m, "hydra", num_heads=3, seed=5)
    return Engine(m, None, {"hydra": heads})


@pytest.mark.parametrize("s", [Sampling(temperature=0.9), Sampling(temperature=1.2, top_p=0.8), Sampling(temperature=0.8, top_k=3)])
def test_speculative_sampling_preserves_the_distribution(sampling_engine, s):
    prompt = [2, 3, 4]
    exact = _exact_joint(sampling_engine.model, prompt, s)
    counts, accept_rate = _sampled_joint(sampling_engine, prompt, s)
    assert accept_rate > 0.2  # the second token often came through the tree, not the bonus
    assert _chi2_p(counts, exact) > 1e-3
    tv = 0.5 * np.abs(counts / counts.sum() - exact).sum()
    assert tv < 0.06


def test_typical_acceptance_is_detected_as_biased(sampling_engine):
    """Negative control: the same test rejects a rule that does not preserve the distribution."""
    s = Sampling(temperature=0.9)
    prompt = [2, 3, 4]
    exact = _exact_joint(sampling_engine.model, prompt, s)
    counts, _ = _sampled_joint(sampling_engine, prompt, s, rule=TypicalRule(s, epsilon=0.3, alpha=0.6))
    assert _chi2_p(counts, exact) < 1e-4
