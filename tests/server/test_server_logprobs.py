"""/v1/completions `echo` and `logprobs`: prompt-token log-probabilities as loglikelihood evaluations
(lm-evaluation-harness's local-completions) read them, checked against the model run directly."""
from __future__ import annotations

import math

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

PROMPT = "It is a truth universally acknowledged, that a single man"


def reference_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) for every i, from the model loaded plainly in float32: [len(ids) - 1]."""
    from dsquant.models import load_model

    model = load_model(llm.engine.path, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    logits = (out.logits if hasattr(out, "logits") else out)[0].float()
    return logits[:-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_logprobs_score_every_prompt_token_like_the_model(llm, serve):
    ids = llm.engine.encode(PROMPT)
    ref = reference_logprobs(llm, ids)
    tol = 1e-3 if next(llm.engine.model.parameters()).dtype == torch.float32 else 0.1
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        # the request lm-eval's local-completions sends for a loglikelihood: a batch of one token list
        r = c.post("/v1/completions", json={"prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                            "echo": True, "seed": 1234})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        zero = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "logprobs": 2, "echo": True})
        assert zero.status_code == 200, zero.text
        plain = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1})
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = torch.tensor(lp["token_logprobs"][1:n])
    assert torch.allclose(got, ref, atol=tol), (got - ref).abs().max()
    # is_greedy as lm-eval computes it: the token's logprob equals the top-1's exactly when it is the argmax
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert len(top) == 1 and max(top.values()) >= value
    # the generated token (greedy) is its own top-1
    assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
    z = zero.json()
    assert z["usage"]["completion_tokens"] == 0 and z["choices"][0]["text"] == PROMPT
    zl = z["choices"][0]["logprobs"]
    assert len(zl["token_logprobs"]) == n and all(len(t) == 2 for t in zl["top_logprobs"][1:])
    assert zl["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:n], abs=1e-4)
    p = plain.json()["choices"][0]
    assert len(p["logprobs"]["tokens"]) == 3 and not p["text"].startswith(PROMPT)
    assert all(math.isfinite(v) and v <= 0 for v in p["logprobs"]["token_logprobs"])


@pytest.mark.parametrize("body, words", [
    ({"prompt": PROMPT, "max_tokens": 0}, "0 only with echo"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs must be in [0, 20]"),
    ({"prompt": PROMPT, "echo": True, "stream": True}, "not supported with stream"),
    ({"prompt": [[1, 2], []]}, "prompt 1 is empty"),
])
def test_bad_echo_logprobs_requests_are_400(serve, body, words):
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
