"""deploy/: the Dockerfile (parsed, no docker needed) and the Kubernetes manifests, checked against
the `kubernetes` client's models with unknown fields refused (the client itself drops them)."""
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from dsquant.runtime.server.cli_serve import serve

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def _serve_default(name: str):
    return next(p.default for p in serve.params if p.name == name)


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuations joined, comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if cur and line.lstrip().startswith("#"):
            continue
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def test_dockerfile_matches_serve_defaults():
    ins = _instructions((DEPLOY / "Dockerfile").read_text())
    by = {}
    for word, rest in ins:
        by.setdefault(word, []).append(rest)
    args = dict(a.split("=", 1) for a in by.get("ARG", []) if "=" in a)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], by["FROM"][-1])
    m = re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda[\d.]+-cudnn\d+-runtime", base)
    assert m and (int(m.group(1)), int(m.group(2))) >= (2, 11), base  # pyproject: torch>=2.11
    assert any('".[serve]"' in r or "[serve]" in r for r in by["RUN"]), "installs the serve extra"
    assert _exec_form(by["ENTRYPOINT"][-1]) == ["dsquant", "serve"]
    user = by["USER"][-1]
    assert user not in ("root", "0") and not user.startswith("0:")
    assert any("useradd" in r and user in r for r in by["RUN"])
    port = _serve_default("port")
    assert by["EXPOSE"] == [str(port)]
    cmd = _exec_form(by["CMD"][-1])
    assert cmd[cmd.index("--port") + 1] == str(port) and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    hc = by["HEALTHCHECK"][-1]
    assert "--start-period=" in hc and " CMD " in f" {hc}"
    assert f"127.0.0.1:{port}/health" in hc
    probe = _exec_form(hc.split("CMD", 1)[1].strip())
    compile(probe[-1], "healthcheck", "exec")  # the python -c snippet parses
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    copied = [shlex.split(r)[0] for r in by["COPY"]]
    assert all(f"!{c}" in ignore or f"!{c}/**" in ignore for c in copied)


def _strict(data, type_name: str, path: str) -> None:
    """Walk `data` against a kubernetes client model type; fail on unknown keys and wrong types."""
    import kubernetes.client as k8s

    if type_name.lower().startswith("list["):
        assert isinstance(data, list), f"{path}: expected a list"
        for i, item in enumerate(data):
            _strict(item, type_name[5:-1], f"{path}[{i}]")
    elif type_name.lower().startswith(("dict[", "dict(")):
        assert isinstance(data, dict), f"{path}: expected a mapping"
        value_type = type_name[5:-1].split(",", 1)[1].strip()
        for key, item in data.items():
            _strict(item, value_type, f"{path}.{key}")
    elif type_name == "object":
        assert isinstance(data, (str, int)), f"{path}: expected int or string"
    elif type_name in PRIMITIVES:
        ok = PRIMITIVES[type_name]
        assert isinstance(data, ok) and not (type_name != "bool" and isinstance(data, bool)), \
            f"{path}: expected {type_name}, got {data!r}"
    else:
        klass = getattr(k8s, type_name)
        assert isinstance(data, dict), f"{path}: expected a {type_name} mapping"
        by_json = {j: a for a, j in klass.attribute_map.items()}
        unknown = set(data) - set(by_json)
        assert not unknown, f"{path}: fields unknown to {type_name}: {sorted(unknown)}"
        for key, item in data.items():
            _strict(item, klass.openapi_types[by_json[key]], f"{path}.{key}")


def _load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / "k8s" / name).read_text())


def _model(doc: dict, type_name: str):
    pytest.importorskip("kubernetes")
    import kubernetes.client as k8s

    _strict(doc, type_name, doc["kind"])
    return getattr(k8s, type_name).from_dict(doc)  # types, enums and required fields


def test_strict_check_refuses_unknown_fields():
    doc = _load("deployment.yaml")
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(AssertionError, match="httpGett"):
        _model(doc, "V1Deployment")


def test_deployment_and_service_schema_and_wiring():
    dep = _model(_load("deployment.yaml"), "V1Deployment")
    svc = _model(_load("service.yaml"), "V1Service")
    assert dep.kind == "Deployment" and svc.kind == "Service"
    pod = dep.spec.template
    assert dep.spec.selector.match_labels.items() <= pod.metadata.labels.items()
    assert svc.spec.selector.items() <= pod.metadata.labels.items()
    (c,) = pod.spec.containers
    port = _serve_default("port")
    named = {p.name: p.container_port for p in c.ports}
    assert named["http"] == port and c.args[c.args.index("--port") + 1] == str(port)
    assert c.args[c.args.index("--host") + 1] == "0.0.0.0"
    for probe in (c.startup_probe, c.readiness_probe, c.liveness_probe):
        assert probe is not None and probe.http_get.path == "/health" and probe.http_get.port in ("http", port)
    assert c.startup_probe.failure_threshold * c.startup_probe.period_seconds >= 300  # model load
    assert c.resources.limits["nvidia.com/gpu"] == "1"
    (key,) = [e for e in c.env if e.name == "DSQUANT_API_KEY"]
    assert key.value is None and key.value_from.secret_key_ref.name and key.value_from.secret_key_ref.key
    assert pod.spec.security_context.run_as_non_root
    assert pod.spec.termination_grace_period_seconds > float(c.args[c.args.index("--shutdown-timeout") + 1])
    (sp,) = svc.spec.ports
    assert sp.name == "http" and sp.port == port and sp.target_port in ("http", port)


SERVICEMONITOR_ENDPOINT_KEYS = {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                                "relabelings", "metricRelabelings", "params", "bearerTokenSecret", "tlsConfig",
                                "basicAuth", "authorization", "followRedirects", "honorTimestamps"}


def test_servicemonitor_required_fields_and_wiring():
    sm, svc = _load("servicemonitor.yaml"), _load("service.yaml")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    assert set(sm) <= {"apiVersion", "kind", "metadata", "spec"} and sm["metadata"]["name"]
    spec = sm["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels",
                         "podTargetLabels", "sampleLimit"}
    assert spec["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert spec["endpoints"]
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    for ep in spec["endpoints"]:
        assert set(ep) <= SERVICEMONITOR_ENDPOINT_KEYS, set(ep) - SERVICEMONITOR_ENDPOINT_KEYS
        assert ep["port"] in port_names and ep["path"] == "/metrics"
        assert re.fullmatch(r"\d+[smh]", ep["interval"])


def test_kustomization_lists_every_manifest():
    kust = _load("kustomization.yaml")
    manifests = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == manifests
