"""Shared checks for the server's hostile-input tests: OpenAI's error body, and the server still serving."""
from __future__ import annotations

OK = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}  # a cheap valid request
JSON = {"content-type": "application/json"}


def assert_openai_error(r, status: int, param: str | None = None) -> dict:
    """r is a JSON {"error": {message, type, param, code}} with `status`; `param` named in it when given."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"], err
    if param is not None:
        assert err["param"] == param and param in err["message"], err
    return err


def assert_still_serving(c) -> None:
    """/health is 200 and a valid completion runs to its 2 tokens."""
    assert c.get("/health").status_code == 200
    r = c.post("/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
