"""validate's accuracy pass holds one window's logits per model, whatever the number of tokens
(issue 20, item 5: 16K tokens of a 135M model with a 49K vocabulary took 9.5 GB before)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from dsquant.validate.accuracy import compare
    torch.manual_seed(0)
    V, H, WINDOW = 49152, 16, 2048  # a 135M Llama's vocabulary (SmolLM-class), window 2048
    emb, head = torch.randn(V, H), torch.randn(H, V) / 4
    base = lambda ids: emb[ids] @ head  # [B, T, V] float32
    art = lambda ids: (emb[ids] + 0.05 * torch.randn(ids.shape[0], ids.shape[1], H)) @ head
    tokens = torch.randint(0, V, (int(sys.argv[1]),))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    b, r = compare(base, {"art": art}, tokens, "s", WINDOW, WINDOW // 2, "cpu")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mb": (after - before) / 1024, "kl": r["art"].kl_mean.value}))
""")


def _growth_mb(tokens: int) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tokens)], capture_output=True, text=True, timeout=600)
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
