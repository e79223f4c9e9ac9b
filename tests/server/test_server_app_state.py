"""The routes are module-level functions over each app's own AppState (app.state.server): two apps
over one engine answer with their own model name and API key, and neither sees the other's."""
import dataclasses

from starlette.testclient import TestClient


def test_two_apps_keep_their_own_state(llm):
    from dsquant.runtime.server.app import create_app
    from dsquant.runtime.server.state import AppState

    a = create_app(llm.engine, model_name="a", allowed_hosts=["*"])
    b = create_app(llm.engine, model_name="b", api_key="key-b", allowed_hosts=["*"])
    assert isinstance(a.state.server, AppState) and dataclasses.is_dataclass(a.state.server)
    assert a.state.engine_loop is a.state.server.loop is not b.state.server.loop
    ca, cb = TestClient(a), TestClient(b)  # no lifespan: /v1/models needs no engine loop
    assert [m["id"] for m in ca.get("/v1/models").json()["data"]] == ["a"]
    assert cb.get("/v1/models").status_code == 401
    assert [m["id"] for m in cb.get("/v1/models", headers={"Authorization": "Bearer key-b"}).json()["data"]] == ["b"]
    assert ca.get("/v1/models/b").status_code == 404 and ca.get("/v1/models/a").json()["id"] == "a"
