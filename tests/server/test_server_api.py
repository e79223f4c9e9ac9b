"""The OpenAI routes against a real engine: outputs equal dsquant.LLM's, usage, streaming, errors, auth."""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from dsquant.runtime.engine.sequence import SamplingParams  # noqa: E402

MAX_MODEL_LEN = 96  # conftest's engine

PROMPT = "Once upon a time"
MODEL = "dsq-tiny-qwen2"


def sse_events(response) -> list:
    """The data payloads of an SSE response, JSON-decoded, with the final "[DONE]" kept as a string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completions_equal_llm_greedy_with_usage_and_stream(llm, serve):
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    seeded = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.9, seed=7))[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "text_completion" and out["model"] == MODEL
        assert out["choices"][0]["text"] == ref.text
        assert out["choices"][0]["finish_reason"] == ref.finish_reason == "length"
        n_in, n_out = len(ref.prompt_token_ids), len(ref.token_ids)
        assert out["usage"] == {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

        # the same prompt as token ids
        r = c.post("/v1/completions", json={**body, "prompt": ref.prompt_token_ids})
        assert r.json()["choices"][0]["text"] == ref.text

        with c.stream("POST", "/v1/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        usage_chunk, chunks = events[-2], events[:-2]
        assert "".join(e["choices"][0]["text"] for e in chunks) == ref.text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["choices"][0].get("finish_reason") is None for e in chunks[:-1])
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == n_out

        # without include_usage no chunk carries usage
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])

        # a stop string cuts the text before it
        stop = ref.text.split()[2]
        r = c.post("/v1/completions", json={**body, "stop": [stop]}).json()
        assert r["choices"][0]["text"] == ref.text[:ref.text.index(stop)]
        assert r["choices"][0]["finish_reason"] == "stop"

        # a seed makes sampling reproducible and equal to the offline API's
        r = c.post("/v1/completions", json={**body, "max_tokens": 8, "temperature": 0.9, "seed": 7}).json()
        assert r["choices"][0]["text"] == seeded.text


def test_chat_uses_the_artifacts_template_and_equals_llm_greedy(llm, serve):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    hf = AutoTokenizer.from_pretrained(llm.engine.path)
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref = llm.generate(ids, SamplingParams(max_tokens=10, temperature=0))[0]
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        out = c.post("/v1/chat/completions", json=body).json()
        assert out["object"] == "chat.completion"
        assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
        assert out["choices"][0]["finish_reason"] == ref.finish_reason
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["usage"]["completion_tokens"] == len(ref.token_ids)

        # max_completion_tokens is the newer name of max_tokens
        alt = c.post("/v1/chat/completions", json={**{k: v for k, v in body.items() if k != "max_tokens"},
                                                   "max_completion_tokens": 10}).json()
        assert alt["choices"][0]["message"]["content"] == ref.text

        with c.stream("POST", "/v1/chat/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
        assert content == ref.text
        assert events[-3]["choices"][0]["finish_reason"] == ref.finish_reason
        assert events[-2]["usage"] == out["usage"]

        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]


LONG = "word " * (MAX_MODEL_LEN + 10)
BAD = [  # (body or raw bytes, route, status, param the error names)
    (b"{not json", "completions", 400, None),
    (b"[1, 2]", "completions", 400, None),
    ({"prompt": PROMPT, "max_tokens": "5"}, "completions", 400, "max_tokens"),
    ({"prompt": PROMPT, "temperature": "hot"}, "completions", 400, "temperature"),
    ({"prompt": PROMPT, "stream": "yes"}, "completions", 400, "stream"),
    ({"prompt": 5}, "completions", 400, "prompt"),
    ({}, "completions", 400, "prompt"),
    ({"prompt": PROMPT, "max_tokens": 0}, "completions", 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": -3}, "completions", 400, "max_tokens"),
    ({"prompt": LONG}, "completions", 400, "prompt"),
    ({"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}, "completions", 400, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -0.1}, "completions", 400, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "completions", 400, "top_p"),
    ({"prompt": PROMPT, "top_p": 1.5}, "completions", 400, "top_p"),
    ({"prompt": PROMPT, "n": 0}, "completions", 400, "n"),
    ({"prompt": PROMPT, "n": 129}, "completions", 400, "n"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "completions", 400, "presence_penalty"),
    ({"prompt": PROMPT, "frequency_penalty": -3}, "completions", 400, "frequency_penalty"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, "completions", 400, "repetition_penalty"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, "completions", 400, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"x": 1}}, "completions", 400, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {str(10 ** 9): 1}}, "completions", 400, "logit_bias"),
    ({"prompt": [PROMPT, ""]}, "completions", 400, "prompt"),
    ({"prompt": [[1, 2], [1, 10 ** 9]]}, "completions", 400, "prompt"),
    ({"prompt": [1, 10 ** 9]}, "completions", 400, "prompt"),
    ({"prompt": PROMPT, "model": "gpt-4"}, "completions", 404, "model"),
    ({"messages": "hi"}, "chat/completions", 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "chat/completions", 400, None),
    ({"messages": [{"role": "user", "content": LONG}]}, "chat/completions", 400, "prompt"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, "chat/completions", 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "chat/completions", 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "chat/completions",
     400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "chat/completions", 400, "logprobs"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(serve):
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        for body, route, status, param in BAD:
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            r = c.post(f"/v1/{route}", **kw)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["code"] == status and err["type"] and err["message"], err
            if param is not None:
                assert err["param"].startswith(param), (body, err)
        assert c.get("/v1/nowhere").status_code == 404
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_api_key_is_required_on_v1_routes(serve):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with serve(api_key="sekret") as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/v1/completions", json=body).status_code == 401
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200  # probes stay open
        ok = {"Authorization": "Bearer sekret"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).status_code == 200


def test_the_official_openai_client_streams_and_not(llm, serve):
    openai = pytest.importorskip("openai")
    ref = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
    with serve(api_key="k") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.token_ids)
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
        deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True)]
        assert "".join(deltas) == chat.choices[0].message.content
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt=PROMPT)
        assert [m.id for m in client.models.list()] == [MODEL]
