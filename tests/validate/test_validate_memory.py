"""validate's accuracy pass holds one window's logits per model, whatever the number of tokens, and
for dsquant's own models (hidden_states + logits) only CHUNK positions' logits at a time (issue 20,
item 5: 16K tokens of a 135M model with a 49K vocabulary took 9.5 GB before)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from dsquant.validate.accuracy import compare

SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from dsquant.validate.accuracy import compare
    torch.manual_seed(0)
    V, H, WINDOW = 49152, 16, 2048  # a 135M Llama's vocabulary (SmolLM-class), window 2048
    emb, head = torch.randn(V, H), torch.randn(H, V) / 4
    noise = 0.05 * torch.randn(WINDOW, H)

    class Split:  # a dsquant-style model: hidden states, then the head on a few positions at a time
        config = type("C", (), {"num_attention_heads": 9})
        def __init__(self, eps): self.eps = eps
        def hidden_states(self, ids): return emb[ids] + self.eps * noise[: ids.shape[1]]
        def logits(self, h): return h @ head
        def __call__(self, ids): return self.logits(self.hidden_states(ids))
    if sys.argv[2] == "split":
        base, art = Split(0.0), Split(1.0)
    else:  # plain callables returning [B, T, V] float32 logits
        base = lambda ids: emb[ids] @ head
        art = lambda ids: (emb[ids] + noise[: ids.shape[1]]) @ head
    tokens = torch.randint(0, V, (int(sys.argv[1]),))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    b, r = compare(base, {"art": art}, tokens, "s", WINDOW, WINDOW // 2, "cpu")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mb": (after - before) / 1024, "kl": r["art"].kl_mean.value}))
""")


def _growth_mb(tokens: int, kind: str = "logits") -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tokens), kind], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["growth_mb"]


@pytest.mark.slow
def test_accuracy_memory_is_bounded_by_one_window():
    """Peak memory of compare() over 12K tokens of a 49K-vocabulary model at window 2048: two
    models' logits of one window (2 x 403 MB) plus chunk temporaries; the old batch-of-4 code
    held about 6.4 GB here. Twice the tokens must not grow it."""
    small, large = _growth_mb(6144), _growth_mb(12288)
    assert small < 1400, f"{small:.0f} MB for 6144 tokens"
    assert large < small + 150, f"{large:.0f} MB for 12288 tokens against {small:.0f} MB for 6144"


@pytest.mark.slow
def test_accuracy_memory_of_a_split_model_is_chunks_only():
    """A model with hidden_states / logits never holds a window's [T, V] logits: the growth is the
    CHUNK-row temporaries (2 x 50 MB here), far under the two windows of full logits above."""
    small, large = _growth_mb(6144, "split"), _growth_mb(12288, "split")
    assert small < 500, f"{small:.0f} MB for 6144 tokens"
    assert large < small + 150, f"{large:.0f} MB for 12288 tokens against {small:.0f} MB for 6144"


class _Split:
    """hidden_states [B, T, H] and a head, as dsquant's CausalLM exposes them; `full` hides the
    split so compare() takes the full-logits path."""

    def __init__(self, emb, head, noise, full=False):
        self.emb, self.head, self.noise, self.full = emb, head, noise, full
        self.config = type("C", (), {"num_attention_heads": 2})

    def run_hidden(self, ids):
        return self.emb[ids] + self.noise[: ids.shape[1]]

    def __call__(self, ids):
        return self.run_hidden(ids) @ self.head


class _SplitModel(_Split):
    def hidden_states(self, ids):
        return self.run_hidden(ids)

    def logits(self, h):
        return h @ self.head


def test_split_and_full_logits_agree_in_window_order():
    """The chunked head (batches of windows, a shorter last window) and full logits (one window at
    a time) give the same perplexity, KL and agreement, window by window, also mixed."""
    gen = torch.Generator().manual_seed(0)
    v, h = 300, 8
    emb, head = torch.randn(v, h, generator=gen), torch.randn(h, v, generator=gen)
    noise = 0.3 * torch.randn(256, h, generator=gen)
    tokens = torch.randint(0, v, (1000,), generator=gen)  # windows of 256 every 128: the last is shorter
    zero = torch.zeros_like(noise)
    split_b, split_a = _SplitModel(emb, head, zero), _SplitModel(emb, head, noise)
    full_b, full_a = _Split(emb, head, zero), _Split(emb, head, noise)
    ref_b, ref = compare(full_b, {"a": full_a}, tokens, "s", 256, 128, "cpu")
    for base, art in ((split_b, split_a), (split_b, full_a), (full_b, split_a)):
        b, r = compare(base, {"a": art}, tokens, "s", 256, 128, "cpu")
        assert b.perplexity.value == pytest.approx(ref_b.perplexity.value, rel=1e-6)
        assert r["a"].perplexity.value == pytest.approx(ref["a"].perplexity.value, rel=1e-6)
        assert r["a"].kl_mean.value == pytest.approx(ref["a"].kl_mean.value, rel=1e-5)
        assert r["a"].top1_agreement.value == ref["a"].top1_agreement.value
