"""The screened float32 lm_head: exact greedy targets from a bf16 screen plus an fp32 recheck."""

import pytest
import torch

from conftest import tiny_model
from entmtp.decoding import DecodeConfig, Engine
from entmtp.hardware import fast_bf16_matmul
from entmtp.verify import ScreenedGreedyHead

needs_bf16 = pytest.mark.skipif(not fast_bf16_matmul(), reason="this CPU has no bf16 matrix units")


def test_targets_equal_fp32_argmax_even_for_near_ties():
    g = torch.Generator().manual_seed(0)
    V, h = 3000, 64
    W = torch.randn(V, h, generator=g) * 0.2
    # near-duplicates far below bf16 resolution, and exact duplicates (ties -> lowest id)
    W[1000:1100] = W[0:100] + 1e-4 * torch.randn(100, h, generator=g)
    W[2000:2100] = W[0:100]
    head = ScreenedGreedyHead(W)
    for trial in range(20):
        x = torch.randn(17, h, generator=g) * 3
        x[:8] = W[torch.randint(0, 100, (8,), generator=g)] * 10  # rows aimed at the near-tied tokens
        ref = (x @ W.T).argmax(-1).tolist()
        got, screen = head.targets(x)
        assert got == ref
        assert screen.shape == (17, V) and screen.dtype == torch.float32
        # the screen is the bf16 logits: close to, but not the same as, the fp32 logits
        assert torch.allclose(screen, x @ W.T, atol=0.5)


def test_bias_is_included():
    g = torch.Generator().manual_seed(1)
    W, b = torch.randn(500, 32, generator=g), torch.randn(500, generator=g) * 5
    x = torch.randn(9, 32, generator=g)
    got, _ = ScreenedGreedyHead(W, b).targets(x)
    assert got == (x @ W.T + b).argmax(-1).tolist()


@needs_bf16
def test_for_model_only_where_exact():
    m = tiny_model("llama", vocab=24, seed=3)
    assert ScreenedGreedyHead.for_model(m) is not None
    assert ScreenedGreedyHead.for_model(tiny_model("llama", vocab=24, seed=3).to(torch.bfloat16)) is None

    class Scaled(torch.nn.Module):  # logits = 0.5 * W h: not a plain linear head
        def __init__(self, lin):
            super().__init__()
            self.lin = lin
            self.weight = lin.weight

        def forward(self, x):
            return 0.5 * self.lin(x)

    scaled = tiny_model("llama", vocab=24, seed=3)
    scaled.lm_head = Scaled(scaled.lm_head)
    assert ScreenedGreedyHead.for_model(scaled) is None


@needs_bf16
def test_engine_uses_it_for_greedy_summary_traces_only():
    m = tiny_model("qwen2", vocab=24, seed=3)
    eng, plain = Engine(m), Engine(m, screened_head=False)
    assert eng.screened is not None and plain.screened is None
    prompt = [5, 9, 2, 7]
    calls = []
    real = eng.screened.targets
    eng.screened.targets = lambda h: calls.append(h.shape[0]) or real(h)
    a = eng.run(prompt, config=DecodeConfig(max_new_tokens=30, eos_token_ids=()))
    assert calls and a.tokens == plain.run(prompt, config=DecodeConfig(max_new_tokens=30, eos_token_ids=())).tokens
    calls.clear()
    eng.run(prompt, config=DecodeConfig(max_new_tokens=5, eos_token_ids=(), trace="full"))
    assert not calls  # full traces need every node's full distribution


def test_last_k_logits_are_indexed_rows_of_the_full_forward():
    """forward(logits_to_keep=k) passes the last k positions as indices (a contiguous gather, not
    the strided slice for which CPU matmul copies the whole lm_head) and returns exactly those rows."""
    from transformers import DynamicCache

    from entmtp.verify import forward, last_positions

    assert last_positions(7, 2).tolist() == [5, 6]
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    seen = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw.get("logits_to_keep")), with_kwargs=True)
    with torch.inference_mode():
        full, _ = forward(model, ids, DynamicCache(config=model.config))
        last2, _ = forward(model, ids, DynamicCache(config=model.config), logits_to_keep=2)
        one, _ = forward(model, ids[:, :1], DynamicCache(config=model.config), logits_to_keep=1)
    hook.remove()
    assert last2.shape == (2, 64) and torch.allclose(last2, full[-2:], atol=1e-6)
    assert one.shape == (1, 64)
    assert isinstance(seen[1], torch.Tensor) and seen[1].tolist() == [7, 8]
    assert seen[2] == 1  # a one-token input keeps the int (its slice is already contiguous)
