"""The server through the official `openai` Python client (issue 22): completions, chat, streaming,
n > 1, prompt lists, logprobs (completions and chat), penalties, models.retrieve and its 404."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.server.test_server_api import MODEL, PROMPT  # noqa: E402

MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture
def client(serve):
    with serve() as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_and_chat_through_the_openai_client(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")

    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    text = out.choices[0].text
    assert text and out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == text

    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "A cat"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.choices[0].text == text[:len(batch.choices[0].text)]
    tokens = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert len(tokens.choices) == 2 and tokens.usage.prompt_tokens == 5

    lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=2, echo=True)
    assert lp.choices[0].text.startswith(PROMPT) and lp.choices[0].logprobs.token_logprobs[0] is None
    assert len(lp.choices[0].logprobs.top_logprobs[-1]) == 2

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2, n=2, presence_penalty=0.5,
                                          frequency_penalty=0.5, extra_body={"repetition_penalty": 1.1})
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.role == "assistant"
    content = chat.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 logprobs=True, presence_penalty=0.5, frequency_penalty=0.5,
                                                 extra_body={"repetition_penalty": 1.1}))
    assert chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, presence_penalty=3)
    assert e.value.body["param"] == "presence_penalty"
