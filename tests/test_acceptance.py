"""Acceptance rules: warping matches transformers, and speculative sampling preserves the
base model's distribution: the joint of the first three emitted tokens, by a chi-square test
whose power is shown by negative controls (a sampler biased below the root, typical acceptance)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import random_heads, tiny_model
from entmtp.acceptance import GreedyRule, Sampling, SpeculativeSamplingRule, TypicalRule, _walk, make_rule, warp
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


VOCAB = 4  # 64 joint cells for three tokens; the root's three drafted children cover most of each distribution
SAMPLES = 1000  # runs per distribution: about 2.5 forwards each
PROMPT = [2, 3, 1]
TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0]])


def _exact_joint(model, prompt, s: Sampling):
    """P(t1, t2, t3) of plain sampling from the base model's warped distribution, by
    enumeration. [V, V, V]."""
    V = model.config.vocab_size
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1], s)
        p2 = warp(model(torch.tensor([prompt + [a] for a in range(V)])).logits[:, -1], s)
        p3 = warp(model(torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])).logits[:, -1], s)
    joint = (p1[:, None, None] * p2[:, :, None] * p3.view(V, V, V)).double().numpy()
    return joint / joint.sum()


def _sampled_joint(eng, prompt, s, rule=None, n=SAMPLES):
    """Counts [V, V, V] of the first three tokens of n seeded speculative runs, and the share
    of runs whose second token was a drafted one (so the third was sampled at a node below the root)."""
    V = eng.model.config.vocab_size
    counts = np.zeros((V, V, V))
    deep = 0
    for seed in range(n):
        r = eng.run(prompt, heads="hydra", tree=TREE, rule=rule,
                    config=DecodeConfig(max_new_tokens=3, sampling=s, seed=seed, eos_token_ids=()))
        counts[tuple(r.tokens)] += 1
        deep += r.steps[0].accept_length >= 1
    return counts, deep / n


def _chi2_p(counts, probs):
    mask = probs.flatten() * counts.sum() >= 5  # pool sparse cells, as chi-square needs
    obs = np.append(counts.flatten()[mask], counts.flatten()[~mask].sum())
    exp = np.append(probs.flatten()[mask], probs.flatten()[~mask].sum()) * counts.sum()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


class DeepBiasedRule(SpeculativeSamplingRule):
    """Speculative sampling that samples at drafted nodes below the root at half the temperature:
    the first two tokens are right, the third is wrong whenever the second was a drafted one."""

    def accept(self, tree, tokens, logits, rng=None):
        return _walk(tree, tokens, lambda node: self._sample(logits[node] * (1.0 if node == 0 else 2.0), rng))


@pytest.fixture(scope="module")
def sampling_engine():
    m = tiny_model("llama", vocab=VOCAB, seed=11)
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(4.0)  # entropy about 1 nat of log(4): sharpening moves it
    heads = random_heads(m, "hydra", num_heads=3, seed=5)
    return Engine(m, None, {"hydra": heads})


@pytest.mark.parametrize("s", [Sampling(temperature=0.9), Sampling(temperature=1.2, top_p=0.9, top_k=3)])
def test_speculative_sampling_preserves_the_joint_of_three_tokens(sampling_engine, s):
    exact = _exact_joint(sampling_engine.model, PROMPT, s)
    counts, deep = _sampled_joint(sampling_engine, PROMPT, s)
    assert deep > 0.4  # the third token often came from a drafted node, not only from the root
    assert _chi2_p(counts, exact) > 1e-3
    assert 0.5 * np.abs(counts / counts.sum() - exact).sum() < 0.12  # total variation: noise alone gives about 0.07


def test_bias_below_the_root_is_detected(sampling_engine):
    """Negative control: the same statistic rejects a sampler wrong only below the root (whose first
    two tokens, all that a test of two tokens sees, are right)."""
    s = Sampling(temperature=0.9)
    exact = _exact_joint(sampling_engine.model, PROMPT, s)
    counts, deep = _sampled_joint(sampling_engine, PROMPT, s, rule=DeepBiasedRule(s))
    assert deep > 0.4
    two = counts.sum(-1)
    assert _chi2_p(two, exact.sum(-1)) > 1e-3  # the first two tokens look right
    assert _chi2_p(counts, exact) < 1e-6


def test_typical_acceptance_is_detected_as_biased(sampling_engine):
    """Negative control: typical acceptance does not preserve the distribution."""
    s = Sampling(temperature=0.9)
    exact = _exact_joint(sampling_engine.model, PROMPT, s)
    counts, _ = _sampled_joint(sampling_engine, PROMPT, s, rule=TypicalRule(s, epsilon=0.3, alpha=0.6))
    assert _chi2_p(counts, exact) < 1e-6
