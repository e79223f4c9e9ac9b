"""vLLM drop-in behaviour (issue 22): stop strings never leak into a stream, prompt lists and n > 1,
add_special_tokens, chat logprobs, penalties and logit_bias over HTTP, /v1/models/{id},
/tokenize, /detokenize and /version."""
from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.server.test_server_api import MODEL, PROMPT, sse_events  # noqa: E402

CHAT = [{"role": "user", "content": "Tell me a story"}]


def _stream_text(c, route: str, body: dict) -> tuple[str, list]:
    with c.stream("POST", f"/v1/{route}", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    key = "delta" if route.startswith("chat") else None
    texts = [(ch["delta"].get("content") or "") if key else ch["text"] for e in events[:-1] for ch in e["choices"]]
    return "".join(texts), events[:-1]


def _stop_from(text: str) -> str:
    """A stop string of a few words from the middle of a greedy output (several tokens long)."""
    words = text.split(" ")
    assert len(words) > 6, text
    return " " + " ".join(words[3:6])


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_streamed_text_equals_non_streamed_with_multi_token_stop_strings(serve, route):
    base = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    base.update({"prompt": PROMPT} if route == "completions" else {"messages": CHAT})

    def text_of(r):
        ch = r.json()["choices"][0]
        return ch["text"] if route == "completions" else ch["message"]["content"]

    with serve() as (url, _), httpx.Client(base_url=url, timeout=120) as c:
        full = text_of(c.post(f"/v1/{route}", json=base))
        stop = _stop_from(full)
        for stops in ([stop], [stop, "no such text"], [stop + " and never this"]):
            r = c.post(f"/v1/{route}", json={**base, "stop": stops})
            assert r.status_code == 200, r.text
            streamed, events = _stream_text(c, route, {**base, "stop": stops})
            assert streamed == text_of(r), (stops, streamed, text_of(r))
            assert stop not in streamed or stop not in stops
        assert text_of(r) == full  # a stop string that never completes holds nothing back at the end


def test_prompt_lists_and_n_index_choices_as_openai(serve):
    with serve() as (url, _), httpx.Client(base_url=url, timeout=120) as c:
        one = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0}).json()
               for p in (PROMPT, [1, 2, 3])]
        r = c.post("/v1/completions", json={"prompt": [PROMPT, "A cat"], "max_tokens": 4, "temperature": 0, "n": 2})
        assert r.status_code == 200, r.text
        out = r.json()
        assert [ch["index"] for ch in out["choices"]] == [0, 1, 2, 3]
        assert out["choices"][0]["text"] == out["choices"][1]["text"] == one[0]["choices"][0]["text"]
        assert out["usage"]["completion_tokens"] == 16
        ids = c.post("/v1/completions", json={"prompt": [[1, 2, 3], [1, 2, 3]], "max_tokens": 4,
                                              "temperature": 0}).json()
        assert [ch["text"] for ch in ids["choices"]] == [one[1]["choices"][0]["text"]] * 2
        assert ids["usage"]["prompt_tokens"] == 6
        seeded = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5,
                                                 "n": 3}).json()
        again = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5,
                                                "n": 3}).json()
        texts = [ch["text"] for ch in seeded["choices"]]
        assert texts == [ch["text"] for ch in again["choices"]] and len(set(texts)) > 1
        streamed, events = _stream_text(c, "completions", {"prompt": [PROMPT, "A cat"], "max_tokens": 4,
                                                           "temperature": 0, "n": 2})
        per = {}
        for e in events:
            for ch in e["choices"]:
                per[ch["index"]] = per.get(ch["index"], "") + ch["text"]
        assert [per[k] for k in range(4)] == [ch["text"] for ch in out["choices"]]
        chat = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "n": 2, "temperature": 0})
        assert [ch["index"] for ch in chat.json()["choices"]] == [0, 1]


def test_add_special_tokens_and_tokenize_detokenize_version_models(serve):
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        with_bos = c.post("/tokenize", json={"prompt": PROMPT}).json()
        without = c.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
        assert with_bos["tokens"][1:] == without["tokens"] and with_bos["count"] == len(with_bos["tokens"])
        assert with_bos["max_model_len"] == 96
        bos_text = c.post("/detokenize", json={"tokens": with_bos["tokens"][:1]}).json()["prompt"]
        assert c.post("/tokenize", json={"prompt": bos_text + PROMPT}).json()["tokens"] == with_bos["tokens"]
        assert c.post("/detokenize", json={"tokens": without["tokens"]}).json() == {"prompt": PROMPT}
        assert c.post("/detokenize", json={"tokens": [10 ** 9]}).json()["error"]["param"] == "tokens"
        chat = c.post("/tokenize", json={"messages": CHAT}).json()
        assert chat["tokens"][0] == with_bos["tokens"][0] and chat["tokens"][1] != chat["tokens"][0]
        for body, n in [({"prompt": PROMPT, "max_tokens": 1}, with_bos["count"]),
                        ({"prompt": PROMPT, "max_tokens": 1, "add_special_tokens": False}, without["count"]),
                        ({"prompt": bos_text + PROMPT, "max_tokens": 1}, with_bos["count"])]:
            assert c.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"] == n
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == chat["count"]
        assert c.post("/tokenize", json={"prompt": "a", "messages": CHAT}).status_code == 400
        assert c.get("/version").json() == {"version": __import__("dsquant").__version__}
        m = c.get(f"/v1/models/{MODEL}")
        assert m.status_code == 200 and m.json()["id"] == MODEL and m.json()["object"] == "model"
        missing = c.get("/v1/models/nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_chat_logprobs_in_openai_shape_streaming_and_not(serve):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "ignore_eos": True}
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 6
        for e in content:
            assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["bytes"] == list(e["token"].encode())
            assert len(e["top_logprobs"]) == 3 and e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"])
            assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"] >= e["top_logprobs"][2]["logprob"]
        assert "".join(e["token"] for e in content) == r.json()["choices"][0]["message"]["content"]
        _, events = _stream_text(c, "chat/completions", body)
        streamed = [e for ev in events for ch in ev["choices"] for e in (ch.get("logprobs") or {}).get("content", [])]
        assert [(e["token"], round(e["logprob"], 4)) for e in streamed] == \
            [(e["token"], round(e["logprob"], 4)) for e in content]
        plain = c.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
        assert plain["choices"][0]["logprobs"] is None
        none_top = c.post("/v1/chat/completions", json={**body, "top_logprobs": 0}).json()
        assert all(e["top_logprobs"] == [] for e in none_top["choices"][0]["logprobs"]["content"])


def test_penalties_and_logit_bias_over_http(serve):
    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        forced = c.post("/v1/completions", json={**base, "logit_bias": {"42": 100}, "logprobs": 0}).json()
        ids = c.post("/tokenize", json={"prompt": forced["choices"][0]["text"], "add_special_tokens": False}).json()
        assert set(ids["tokens"]) == {42}
        plain = c.post("/v1/completions", json=base).json()["choices"][0]["text"]
        for extra in ({"presence_penalty": 2}, {"frequency_penalty": 2}, {"repetition_penalty": 50.0}):
            r = c.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 200, r.text
        assert c.post("/v1/completions", json={**base, "presence_penalty": 0, "frequency_penalty": 0,
                                               "repetition_penalty": 1}).json()["choices"][0]["text"] == plain
        chat = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "logit_bias": {"42": 100},
                                                    "temperature": 0, "ignore_eos": True})
        assert chat.status_code == 200, chat.text
