"""Auth and cross-origin guards (issue 21, item 5): empty API keys refused, `Bearer` matched
case-insensitively, POST bodies must be application/json, Host checked (DNS rebinding), and no
CORS headers unless origins are allowed."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from dsquant.errors import DsquantError  # noqa: E402
from tests.server.openai_errors import OK, assert_openai_error  # noqa: E402

RAW_OK = b'{"prompt":"Once upon a time","max_tokens":2,"temperature":0}'


def test_an_empty_api_key_is_refused(llm):
    from dsquant.runtime.server.app import create_app

    for key in ("", "   "):
        with pytest.raises(DsquantError, match="api-key"):
            create_app(llm.engine, api_key=key)


@pytest.mark.parametrize("args, env", [(["--api-key", ""], {}), ([], {"DSQUANT_API_KEY": ""}),
                                       ([], {"DSQUANT_API_KEY": "  "})])
def test_serve_refuses_an_empty_api_key_before_loading(monkeypatch, capsys, args, env):
    import dsquant.runtime.engine.llm_engine as llm_engine
    from dsquant.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_engine, "LLMEngine", no_load)
    monkeypatch.delenv("DSQUANT_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "dsq-tiny-qwen2", "--port", "0", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "API key" in err and "empty" in err and "--api-key" in err, err


def test_bearer_is_matched_case_insensitively(serve):
    with serve(api_key="sekret") as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        for header in ("Bearer sekret", "bearer sekret", "BEARER sekret", "bEaReR  sekret"):
            assert c.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
        for header in ("Bearer", "Basic sekret", "Bearer Sekret", "sekret", "Bearer sekret extra"):
            assert_openai_error(c.get("/v1/models", headers={"Authorization": header}), 401)


def test_post_routes_require_application_json(serve):
    with serve() as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                      None):
            headers = {"content-type": ctype} if ctype else {}
            for route in ("completions", "chat/completions"):
                err = assert_openai_error(c.post(f"/v1/{route}", content=RAW_OK, headers=headers), 415)
                assert "application/json" in err["message"]
        for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            r = c.post("/v1/completions", content=RAW_OK, headers={"content-type": ctype})
            assert r.status_code == 200, (ctype, r.text)


def test_the_host_header_must_name_the_server(serve):
    with serve() as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        port = url.rsplit(":", 1)[1]
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil"):
            for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
                r = c.request(method, path, headers={"Host": host}, json=OK)
                err = assert_openai_error(r, 400)
                assert "Host" in err["message"] and "--allowed-hosts" in err["message"], err
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "localhost."):
            assert c.get("/health", headers={"Host": host}).status_code == 200, host
    with serve(allowed_hosts=["api.example", "*.corp.example"]) as (url, _), \
            httpx.Client(base_url=url, timeout=20) as c:
        for host in ("api.example", "api.example:443", "a.corp.example"):
            assert c.get("/health", headers={"Host": host}).status_code == 200, host
        assert_openai_error(c.get("/health", headers={"Host": "evil.example"}), 400)
    with serve(allowed_hosts=["*"]) as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        assert c.get("/health", headers={"Host": "anything.example"}).status_code == 200


def test_default_allowed_hosts_follow_the_bound_address():
    from dsquant.runtime.server.guards import default_allowed_hosts

    assert {"localhost", "127.0.0.1", "::1"} <= set(default_allowed_hosts("127.0.0.1"))
    assert "localhost" in default_allowed_hosts("::1")
    assert default_allowed_hosts("10.1.2.3") == ["10.1.2.3"]
    assert default_allowed_hosts("0.0.0.0") == ["*"] and default_allowed_hosts("::") == ["*"]


def test_no_cors_headers_unless_origins_are_allowed(serve):
    origin = {"Origin": "https://app.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type, authorization"}
    with serve() as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        r = c.post("/v1/completions", json=OK, headers=origin)
        assert r.status_code == 200 and not any(k.startswith("access-control-") for k in r.headers)
        r = c.options("/v1/completions", headers=preflight)
        assert r.status_code >= 400 and not any(k.startswith("access-control-") for k in r.headers)
    with serve(allowed_origins=["https://app.example"]) as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        r = c.options("/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.post("/v1/completions", json=OK, headers=origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_serve_help_documents_the_limits_and_guards():
    from dsquant.cli import cli

    out = CliRunner().invoke(cli, ["serve", "--help"]).output
    for flag in ("--max-request-bytes", "--allowed-hosts", "--allowed-origins", "--api-key", "--max-queue",
                 "--no-verify"):
        assert flag in out, flag
