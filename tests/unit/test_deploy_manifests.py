"""The deployment files agree with the server and with each other.

Probe paths must be routes of the app, every ``HALFSERVE_*`` name a field of ``Settings`` with a value it accepts,
and ports, the store path, GPU requests and drain periods the same everywhere. Schema validation of the same files
(hadolint, Compose, Kubernetes) is ``.ci/lint-deploy``'s job.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.routing import Match

from halfserve.api.http.guard import host_allowed
from halfserve.app import create_app
from halfserve.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "docker-compose.cpu.yml"
DEPLOYMENT = ROOT / "deploy" / "kubernetes" / "deployment.yaml"
SERVICE = ROOT / "deploy" / "kubernetes" / "service.yaml"
HPA = ROOT / "deploy" / "kubernetes" / "hpa.yaml"
PDB = ROOT / "deploy" / "kubernetes" / "pdb.yaml"
INFERENCE_SERVICE = ROOT / "deploy" / "kserve" / "inferenceservice.yaml"
GUIDE = ROOT / "docs" / "deploy.md"

ENV_NAME = re.compile(r"\bHALFSERVE_[A-Z0-9_]+\b")
URL_PATH = re.compile(r"https?://[^/'\"\s]+(/[^'\"\s]*)")
COMPOSE_DEFAULT = re.compile(r"^\$\{(\w+):-(.*)\}$")


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """Every instruction of a Dockerfile, all stages, continued lines joined: (INSTRUCTION, arguments)."""
    logical: list[str] = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "Dockerfile ends inside a continued line"
    return [(ins.upper(), args.strip()) for ins, _, args in (line.partition(" ") for line in logical)]


@dataclass
class Dockerfile:
    """The instructions of a Dockerfile's last (runtime) stage, enough to run what the image runs."""

    instructions: list[tuple[str, str]]
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, path: Path = DOCKERFILE) -> Dockerfile:
        instructions = dockerfile_instructions(path)
        last_from = max(i for i, (ins, _) in enumerate(instructions) if ins == "FROM")
        stage = cls(instructions[last_from:])
        for args in stage.args("ENV"):
            for token in shlex.split(args):
                name, eq, value = token.partition("=")
                assert eq, f"ENV {args!r}: use the NAME=value form"
                stage.env[name] = value
        return stage

    def args(self, instruction: str) -> list[str]:
        return [args for ins, args in self.instructions if ins == instruction]

    def one(self, instruction: str) -> str:
        found = self.args(instruction)
        assert len(found) == 1, f"the runtime stage needs exactly one {instruction}, has {len(found)}"
        return found[0]

    def exec_form(self, instruction: str) -> list[str]:
        """ENTRYPOINT or CMD: JSON exec form only, so the server is PID 1 and receives SIGTERM itself."""
        value = json.loads(self.one(instruction))
        assert isinstance(value, list), f"{instruction} must be in exec (JSON) form"
        return [str(v) for v in value]

    @property
    def command(self) -> list[str]:
        return self.exec_form("ENTRYPOINT") + self.exec_form("CMD")

    @property
    def healthcheck(self) -> list[str]:
        args = self.one("HEALTHCHECK")
        _, _, command = args.partition("CMD ")
        value = json.loads(command)
        assert isinstance(value, list), "HEALTHCHECK CMD must be in exec (JSON) form"
        return [str(v) for v in value]

    @property
    def healthcheck_options(self) -> dict[str, str]:
        options = self.one("HEALTHCHECK").partition("CMD ")[0].split()
        return dict(o.removeprefix("--").split("=", 1) for o in options)

    @property
    def volumes(self) -> list[str]:
        out: list[str] = []
        for args in self.args("VOLUME"):
            out += json.loads(args) if args.startswith("[") else args.split()
        return out


class _ComposeLoader(yaml.SafeLoader):  # type: ignore[misc]
    """Reads Compose's merge tags (``!reset``, ``!override``) as the tagged value, marked."""


@dataclass
class Tagged:
    tag: str
    value: Any


def _tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.SequenceNode):
        return Tagged(suffix, loader.construct_sequence(node))
    if isinstance(node, yaml.MappingNode):
        return Tagged(suffix, loader.construct_mapping(node))
    return Tagged(suffix, loader.construct_scalar(node))


_ComposeLoader.add_multi_constructor("!", _tagged)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


def compose_value(value: Any) -> str | None:
    """What a container sees for a compose environment entry, with nothing set in the caller's shell."""
    if value is None:
        return None
    match = COMPOSE_DEFAULT.match(str(value))
    return match.group(2) if match else str(value)


def k8s_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] == "InferenceService":
        containers: list[dict[str, Any]] = obj["spec"]["predictor"]["containers"]
    else:
        containers = obj["spec"]["template"]["spec"]["containers"]
    return containers


def k8s_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def probes(container: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        if kind in container:
            yield kind, container[kind]["httpGet"]


def drain_timeout_s(env: dict[str, str | None]) -> float:
    """How long ``halfserve serve`` waits for requests in flight after SIGTERM, with ``env`` set."""
    field = Settings.model_fields.get("drain_timeout")
    if field is not None:
        value = env.get("HALFSERVE_DRAIN_TIMEOUT")
        return float(value) if value is not None else float(field.default)
    # Before the setting existed, a literal in server/halfserve/cli.py.
    tree = ast.parse((ROOT / "server" / "halfserve" / "cli.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "timeout_graceful_shutdown":
            return float(ast.literal_eval(node.value))
    raise AssertionError("cannot tell how long halfserve serve drains for")


def duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert parts, f"not a duration: {text!r}"
    assert "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile.parse()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict[str, Any]]:
    return {p.stem: load_yaml(p) for p in (DEPLOYMENT, SERVICE, HPA, PDB, INFERENCE_SERVICE)}


def is_get_route(path: str) -> bool:
    app = create_app(Settings(store=ROOT / "model_store"))
    scope = {"type": "http", "method": "GET", "path": path, "root_path": ""}
    return any(route.matches(scope)[0] is Match.FULL for route in app.router.routes)


def probe_paths(dockerfile: Dockerfile, compose: dict[str, Any], k8s: dict[str, dict[str, Any]]) -> dict[str, str]:
    found = {"Dockerfile HEALTHCHECK": URL_PATH.search(" ".join(dockerfile.healthcheck))}
    test = compose["services"]["halfserve"]["healthcheck"]["test"]
    found["docker-compose.yml healthcheck"] = URL_PATH.search(" ".join(test))
    paths = {where: m.group(1) for where, m in found.items() if m}
    assert len(paths) == len(found), f"no URL found in {set(found) - set(paths)}"
    for name in ("deployment", "inferenceservice"):
        for container in k8s_containers(k8s[name]):
            for kind, get in probes(container):
                paths[f"{name} {kind}"] = get["path"]
    return paths


def test_probe_paths_are_get_routes_of_the_app(
    dockerfile: Dockerfile, compose: dict[str, Any], k8s: dict[str, dict[str, Any]]
) -> None:
    paths = probe_paths(dockerfile, compose, k8s)
    missing = {where: path for where, path in paths.items() if not is_get_route(path)}
    assert not missing, f"probes on paths the app does not serve: {missing}"
    # Containers are restarted on liveness and taken out of rotation on readiness: those must be the right ones.
    assert paths["Dockerfile HEALTHCHECK"] == "/ready"
    assert paths["docker-compose.yml healthcheck"] == "/ready"
    assert paths["deployment readinessProbe"] == "/ready"
    assert paths["deployment livenessProbe"] == "/health"
    assert paths["inferenceservice readinessProbe"] == "/v2/health/ready"
    assert paths["inferenceservice livenessProbe"] == "/v2/health/live"


@pytest.mark.parametrize(
    "path",
    [DOCKERFILE, COMPOSE, COMPOSE_CPU, DEPLOYMENT, INFERENCE_SERVICE, GUIDE],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_halfserve_variable_named_is_a_setting(path: Path) -> None:
    names = set(ENV_NAME.findall(path.read_text()))
    unknown = sorted(n for n in names if n.removeprefix("HALFSERVE_").lower() not in Settings.model_fields)
    assert not unknown, f"{path.name}: not fields of halfserve.settings.Settings: {unknown}"


def settings_from(env: dict[str, str | None], monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in [n for n in os.environ if n.startswith("HALFSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("HALFSERVE_") and value is not None:
            monkeypatch.setenv(name, value)
    return Settings()


def test_every_halfserve_value_set_is_accepted_by_settings(
    dockerfile: Dockerfile, compose: dict[str, Any], k8s: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    image = settings_from(dict(dockerfile.env), monkeypatch)
    assert image.host == "0.0.0.0", "the container must listen beyond its own loopback"
    for service in compose["services"].values():
        env = {k: compose_value(v) for k, v in service.get("environment", {}).items()}
        settings_from({**dockerfile.env, **env}, monkeypatch)
    for name in ("deployment", "inferenceservice"):
        for container in k8s_containers(k8s[name]):
            settings = settings_from({**dockerfile.env, **k8s_env(container)}, monkeypatch)
            assert settings.device == "cuda", f"{name}: a GPU pod should fail without its GPU, not fall back to CPU"


def test_dockerfile_runs_halfserve_serve_as_a_non_root_user_with_jemalloc(dockerfile: Dockerfile) -> None:
    assert dockerfile.command == ["halfserve", "serve"]
    assert dockerfile.one("STOPSIGNAL") == "SIGTERM"
    user = dockerfile.one("USER").split(":")
    assert all(part.isdigit() and int(part) > 0 for part in user), "USER must be a numeric, non-root UID[:GID]"
    assert "jemalloc" in dockerfile.env["LD_PRELOAD"]
    assert dockerfile.one("EXPOSE") == f"{dockerfile.env['HALFSERVE_PORT']} {dockerfile.env['HALFSERVE_GRPC_PORT']}"
    assert dockerfile.healthcheck[0] == "python"
    options = dockerfile.healthcheck_options
    assert duration_s(options["start-period"]) >= 60, "loading and warm-up on a GPU need time before checks count"


def test_dockerfile_pins_a_cuda_build_of_torch_for_t4_and_a10() -> None:
    text = DOCKERFILE.read_text()
    version = re.search(r"^ARG TORCH_VERSION=(\d+)\.(\d+)\.(\d+)$", text, re.M)
    index = re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu(\d+)$", text, re.M)
    assert version, "ARG TORCH_VERSION=X.Y.Z"
    assert index, "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cuNNN"
    # 2.x releases from 2.4 on with CUDA 12.x wheels include sm_75 (T4) and sm_86 (A10) kernels.
    assert (int(version[1]), int(version[2])) >= (2, 4)
    assert index[1].startswith("12")
    # The image runs the torch release CI tests the server with: the lock's.
    locked = re.search(r"^torch==([\w.]+)", (ROOT / "constraints.txt").read_text(), re.M)
    assert locked, "constraints.txt pins torch"
    assert ".".join(version.groups()) == locked[1], "the image's torch differs from the lock's, which CI tests with"


BUILD_SECRETS = {"pip_conf", "ca_bundle", "apt_conf"}
PACKAGE_SOURCE_VARIABLES = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE", "PIP_CERT", "APT_CONFIG"}


def test_build_time_package_sources_stay_out_of_the_image(dockerfile: Dockerfile) -> None:
    """Mirrors, pip.conf and CA bundles are build args of the builder stage or optional build secrets."""
    instructions = dockerfile_instructions()
    mounted: set[str] = set()
    for ins, args in instructions:
        if ins != "RUN":
            continue
        for mount in re.findall(r"--mount=(\S+)", args):
            options = dict(o.partition("=")[::2] for o in mount.split(","))
            # Optional (a plain `docker build` gives none) and at the default /run/secrets/<id>, which is never
            # part of a layer.
            assert options.get("type") == "secret", f"RUN --mount={mount}: only build secrets are mounted"
            assert options.get("id") in BUILD_SECRETS, f"RUN --mount={mount}: an id documented in docs/deploy.md"
            assert options.keys() == {"type", "id"}, f"RUN --mount={mount}: not required, no target of its own"
            mounted.add(options["id"])
            assert f"/run/secrets/{options['id']}" in args, f"RUN --mount={mount} is mounted but not used"
    assert mounted == BUILD_SECRETS
    # Index URLs are build args of the builder stage only; nothing in the runtime stage points pip or apt anywhere.
    runtime_from = max(i for i, (ins, _) in enumerate(instructions) if ins == "FROM")
    args_in = {ins_args.split("=")[0] for ins, ins_args in instructions[runtime_from:] if ins == "ARG"}
    assert not args_in & PACKAGE_SOURCE_VARIABLES
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"} <= {a.split("=")[0] for i, a in instructions if i == "ARG"}
    assert not set(dockerfile.env) & PACKAGE_SOURCE_VARIABLES
    guide = GUIDE.read_text()
    for name in BUILD_SECRETS | {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "TORCH_INDEX_URL"}:
        assert name in guide, f"docs/deploy.md does not say how to give {name}"


def test_the_model_store_is_the_same_path_everywhere(dockerfile: Dockerfile, compose: dict[str, Any]) -> None:
    store = dockerfile.env["HALFSERVE_STORE"]
    assert store in dockerfile.volumes
    assert any(args.split() == ["model_store", store] for args in dockerfile.args("COPY"))
    service = compose["services"]["halfserve"]
    assert compose_value(service["environment"]["HALFSERVE_STORE"]) == store
    source, target, *mode = service["volumes"][0].split(":")
    assert (source, target, mode) == ("./model_store", store, ["ro"])


def test_ports_agree(dockerfile: Dockerfile, compose: dict[str, Any], k8s: dict[str, dict[str, Any]]) -> None:
    port = int(dockerfile.env["HALFSERVE_PORT"])
    grpc_port = int(dockerfile.env["HALFSERVE_GRPC_PORT"])
    assert grpc_port == Settings.model_fields["grpc_port"].default
    service = compose["services"]["halfserve"]
    assert int(compose_value(service["environment"]["HALFSERVE_PORT"]) or 0) == port
    assert int(compose_value(service["environment"]["HALFSERVE_GRPC_PORT"]) or 0) == grpc_port
    for published in (port, grpc_port):
        assert any(str(p).endswith(f":{published}") for p in service["ports"])
    for name in ("deployment", "inferenceservice"):
        (container,) = k8s_containers(k8s[name])
        container_port = container["ports"][0]
        assert container_port["containerPort"] == port
        assert int(k8s_env(container)["HALFSERVE_PORT"]) == port
        assert int(k8s_env(container)["HALFSERVE_GRPC_PORT"]) == grpc_port
        for _, get in probes(container):
            assert get["port"] in (port, container_port.get("name")), f"{name}: probe on another port"
    # Knative gives a container one port (the InferenceService's); a Deployment has both, and its Service routes both.
    (_,) = k8s_containers(k8s["inferenceservice"])[0]["ports"]
    named = {p["name"]: p["containerPort"] for p in k8s_containers(k8s["deployment"])[0]["ports"]}
    assert named == {"http": port, "grpc": grpc_port}
    routes = {p["name"]: (p["port"], p["targetPort"]) for p in k8s["service"]["spec"]["ports"]}
    assert routes == {"http": (80, "http"), "grpc": (grpc_port, "grpc")}


def test_drain_periods_outlast_the_servers_drain(
    dockerfile: Dockerfile, compose: dict[str, Any], k8s: dict[str, dict[str, Any]]
) -> None:
    service = compose["services"]["halfserve"]
    env = {**dockerfile.env, **{k: compose_value(v) for k, v in service["environment"].items()}}
    assert service["stop_signal"] == "SIGTERM"
    assert duration_s(service["stop_grace_period"]) > drain_timeout_s(env)
    pod = k8s["deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = drain_timeout_s({**dockerfile.env, **k8s_env(container)})
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + drain


def test_gpu_is_requested_where_it_should_be(compose: dict[str, Any], k8s: dict[str, dict[str, Any]]) -> None:
    (device,) = compose["services"]["halfserve"]["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    cpu = load_yaml(COMPOSE_CPU)["services"]["halfserve"]
    devices = cpu["deploy"]["resources"]["reservations"]["devices"]
    assert isinstance(devices, Tagged), "the CPU override must !reset the GPU request"
    assert devices.tag == "reset", "the CPU override must !reset the GPU request"
    assert cpu["environment"]["HALFSERVE_DEVICE"] == "cpu"
    for name in ("deployment", "inferenceservice"):
        (container,) = k8s_containers(k8s[name])
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, name


def test_kubernetes_objects_select_the_deployments_pods(k8s: dict[str, dict[str, Any]]) -> None:
    deployment = k8s["deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert k8s["service"]["spec"]["selector"].items() <= labels.items()
    assert k8s["pdb"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = k8s["hpa"]["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "halfserve")
    assert target["name"] == deployment["metadata"]["name"]


def test_inference_service_is_a_v2_custom_predictor(k8s: dict[str, dict[str, Any]]) -> None:
    isvc = k8s["inferenceservice"]
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    predictor = isvc["spec"]["predictor"]
    assert predictor["minReplicas"] >= 1, "scale-to-zero would put a GPU cold start on a request's path"
    assert predictor["minReplicas"] <= predictor["maxReplicas"]
    (container,) = predictor["containers"]
    assert container["name"] == "kserve-container"
    assert k8s_env(container)["PROTOCOL"] == "v2"
    assert container["ports"][0]["name"] in ("http1", "h2c")


def test_loadtest_service_targets_the_server_on_the_compose_network(compose: dict[str, Any]) -> None:
    loadtest = compose["services"]["loadtest"]
    assert loadtest["profiles"] == ["loadtest"]
    assert loadtest["depends_on"]["halfserve"]["condition"] == "service_healthy"
    command = [compose_value(arg) for arg in loadtest["command"]]
    assert command[0] == "loadtest"
    url = command[command.index("--url") + 1]
    port = compose_value(compose["services"]["halfserve"]["environment"]["HALFSERVE_PORT"])
    assert url == f"http://halfserve:{port}"
    assert "--allow-remote" in command, "the loadtest client refuses a non-local URL without --allow-remote"
    # The server serves the whole store, so the model must be named, and shipped.
    model = command[command.index("--model") + 1]
    assert (ROOT / "model_store" / str(model) / "config.json").is_file()


def test_the_names_clients_use_are_hosts_the_server_answers_to(
    dockerfile: Dockerfile, compose: dict[str, Any], k8s: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Host that is not an IP address or localhost must be allowed (--allowed-hosts): the compose network's name of
    the server, for the loadtest service, and the Kubernetes Service's, as in-cluster clients address it."""
    service = compose["services"]["halfserve"]
    settings = settings_from(
        {**dockerfile.env, **{k: compose_value(v) for k, v in service["environment"].items()}}, monkeypatch
    )
    command = [compose_value(arg) for arg in compose["services"]["loadtest"]["command"]]
    url = str(command[command.index("--url") + 1])
    hosts = [url.removeprefix("http://").encode(), b"localhost:8000", b"192.168.1.20:8000"]
    assert all(host_allowed(h, tuple(settings.allowed_hosts), settings.host) for h in hosts), settings.allowed_hosts
    assert not host_allowed(b"rebound.example", tuple(settings.allowed_hosts), settings.host)
    name = k8s["service"]["metadata"]["name"]
    for container in k8s_containers(k8s["deployment"]):
        settings = settings_from({**dockerfile.env, **k8s_env(container)}, monkeypatch)
        for host in (name, f"{name}.default.svc", f"{name}.serving.svc.cluster.local:80", "10.0.3.7:8000"):
            assert host_allowed(host.encode(), tuple(settings.allowed_hosts), settings.host), host
        assert not host_allowed(b"rebound.example", tuple(settings.allowed_hosts), settings.host)


def test_loadtest_command_parses(compose: dict[str, Any]) -> None:
    from halfserve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args([str(compose_value(a)) for a in compose["services"]["loadtest"]["command"]])
    assert args.allow_remote is True
