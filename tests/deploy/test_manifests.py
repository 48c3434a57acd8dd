"""The deployment files, checked offline: Kubernetes manifests against the
API schemas (kubernetes-validate), their commands against Springback's own
argument parsers, the Dockerfile through BuildKit's parser, systemd units'
command lines. No cluster and no docker engine is needed (none runs here)."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import dockerfile
import kubernetes_validate
import pytest
import yaml

from springback.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
MANIFESTS = ["etcd.yaml", "coordinator.yaml", "workers.yaml"]
K8S_VERSION = kubernetes_validate.utils.latest_version()


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def every_document() -> list[dict]:
    return [d for name in MANIFESTS for d in documents(name)]


def by_kind(kind: str, name: str) -> dict:
    return next(d for d in every_document() if d["kind"] == kind and d["metadata"]["name"] == name)


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion, failing on a variable the container lacks."""
    def value(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not defined in the container's env"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, text)


def container_env(container: dict) -> dict[str, str]:
    """The container's env, with sample values for those read from the cluster."""
    samples = {"fieldRef": "10.0.0.7", "configMapKeyRef": "tiny-1a2b3c", "secretKeyRef": "s3cr3t"}
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        else:
            (source,) = var["valueFrom"]
            env[var["name"]] = samples[source]
    return env


def parse_springback(argv: list[str]):  # noqa: ANN201
    return build_parser().parse_args(argv)


class TestKubernetesManifests:
    @pytest.mark.parametrize("name", MANIFESTS)
    def test_every_document_is_valid_against_the_api_schema(self, name):
        for doc in documents(name):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

    def test_the_kustomization_lists_every_manifest(self):
        kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
        assert sorted(kustomization["resources"]) == sorted(MANIFESTS)

    def test_no_container_needs_a_shell(self):
        for doc in every_document():
            if "template" not in doc.get("spec", {}):
                continue
            for c in pod_spec(doc)["containers"]:
                argv = c.get("command", []) + c.get("args", [])
                assert argv and not argv[0].endswith("sh"), (doc["metadata"]["name"], argv)

    def test_etcd_runs_the_binary_of_its_image_with_per_pod_flags(self):
        sts = by_kind("StatefulSet", "springback-etcd")
        (c,) = pod_spec(sts)["containers"]
        assert c["command"] == ["/usr/local/bin/etcd"]
        env = container_env(c)
        env["POD_NAME"] = "springback-etcd-1"
        flags = dict(expand(a, env).removeprefix("--").split("=", 1) for a in c["args"])
        assert flags["name"] == "springback-etcd-1"
        assert flags["advertise-client-urls"] == "http://springback-etcd-1.springback-etcd:2379"
        peers = dict(p.split("=", 1) for p in flags["initial-cluster"].split(","))
        assert sorted(peers) == [f"springback-etcd-{i}" for i in range(sts["spec"]["replicas"])]
        anti = pod_spec(sts)["affinity"]["podAntiAffinity"]
        assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
            "kubernetes.io/hostname")

    def test_no_secret_is_shipped_and_each_one_used_is_documented(self):
        assert [d for d in every_document() if d["kind"] == "Secret"] == []
        for name in ("coordinator.yaml", "workers.yaml"):
            text = (K8S / name).read_text()
            for secret in set(re.findall(r"secretKeyRef: \{name: ([\w-]+)", text)):
                assert f"kubectl create secret generic {secret}" in text, (name, secret)
        assert "change-me" not in "".join((K8S / n).read_text() for n in MANIFESTS)

    def test_every_workload_has_requests_and_a_disruption_budget(self):
        budgets = [d for d in every_document() if d["kind"] == "PodDisruptionBudget"]
        for doc in every_document():
            if doc["kind"] not in ("StatefulSet", "Deployment", "Job"):
                continue
            labels = doc["spec"]["template"]["metadata"]["labels"]
            for c in pod_spec(doc)["containers"]:
                assert {"cpu", "memory"} <= set(c["resources"]["requests"]), doc["metadata"]["name"]
            assert any(b["spec"]["selector"]["matchLabels"].items() <= labels.items()
                       for b in budgets), doc["metadata"]["name"]

    def test_the_coordinator_command_line_parses_with_springback_itself(self):
        (c,) = pod_spec(by_kind("Deployment", "springback-coordinator"))["containers"]
        env = container_env(c)
        args = parse_springback([expand(a, env) for a in c["args"]])
        assert args.command == "coordinator" and args.advertise == "10.0.0.7:7070"
        assert args.listen.endswith(":7070") and args.metrics_listen.endswith(":9090")
        assert {p["containerPort"] for p in c["ports"]} == {7070, 9090}


class TestWorkers:
    @property
    def job(self) -> dict:
        return by_kind("Job", "springback-workers")

    @property
    def agent(self) -> dict:
        (agent,) = pod_spec(self.job)["containers"]
        return agent

    def run_args(self, job: dict | None = None):  # noqa: ANN201
        (c,) = pod_spec(job or self.job)["containers"]
        assert c["command"] == ["springback"]
        return parse_springback([expand(a, container_env(c)) for a in c["args"]])

    def test_workers_are_an_indexed_job_whose_agents_end_with_the_training_job(self):
        spec = self.job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"]
        assert pod_spec(self.job)["restartPolicy"] == "Never"

    def test_a_drained_agent_is_replaced_without_counting_as_a_failure(self):
        args = self.run_args()
        assert args.drained_exit_code not in (0, 1, 2, 3)  # the agent's own statuses
        ignored = [r for r in self.job["spec"]["podFailurePolicy"]["rules"]
                   if r["action"] == "Ignore" and "onExitCodes" in r]
        assert [r["onExitCodes"]["values"] for r in ignored] == [[args.drained_exit_code]]
        assert ignored[0]["onExitCodes"]["containerName"] == self.agent["name"]

    def test_the_grace_period_covers_the_drain_and_fits_a_spot_notice(self):
        args = self.run_args()
        grace = pod_spec(self.job)["terminationGracePeriodSeconds"]
        assert args.drain_timeout_s + 5 <= grace <= 30, (args.drain_timeout_s, grace)

    def test_the_agent_command_line_parses_with_springback_itself(self):
        args = self.run_args()
        assert args.command == "run" and args.job == "tiny-1a2b3c" and args.host == "10.0.0.7"
        assert args.cmd[0] == "--" and args.cmd[1:] == ["python", "/app/train.py"]
        mounts = {m["name"]: m["mountPath"] for m in self.agent["volumeMounts"]}
        claims = {v["name"]: v for v in pod_spec(self.job)["volumes"]}
        assert claims["checkpoints"]["persistentVolumeClaim"]["claimName"] == (
            by_kind("PersistentVolumeClaim", "springback-checkpoints")["metadata"]["name"])
        assert mounts["checkpoints"] == "/var/lib/springback/checkpoints"
        assert self.agent["envFrom"] == [{"secretRef": {"name": "springback-s3", "optional": True}}]

    def test_the_gpu_overlay_yields_a_valid_job_with_one_gpu_per_rank(self):
        kustomization = yaml.safe_load((K8S / "gpu" / "kustomization.yaml").read_text())
        (patch,) = kustomization["patches"]
        assert patch["target"]["kind"] == "Job" and patch["target"]["name"] == "springback-workers"
        job = json_patch(self.job, json.loads((K8S / "gpu" / patch["path"]).read_text()))
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
        (c,) = pod_spec(job)["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == int(self.run_args(job).nproc_per_node) == 8
        assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(job)["tolerations"])


def json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 'add' and 'replace' (what the GPU overlay uses), applied to a copy."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] in ("add", "replace"), op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")]
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            if last == "-":
                node.append(op["value"])
            else:
                assert op["op"] == "replace" and int(last) < len(node), op
                node[int(last)] = op["value"]
        else:
            assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
            node[last] = op["value"]
    return doc


class TestDockerfile:
    @property
    def commands(self) -> tuple:
        return dockerfile.parse_file(str(ROOT / "Dockerfile"))

    @property
    def setup(self) -> str:
        return (ROOT / "deploy" / "local" / "setup.sh").read_text()

    def args(self) -> dict[str, str]:
        return dict(c.value[0].split("=", 1) for c in self.commands if c.cmd == "ARG")

    def runs(self) -> str:
        return "\n".join(" ".join(c.value) for c in self.commands if c.cmd == "RUN")

    def test_it_pins_the_torch_that_setup_installs(self):
        (pin,) = re.findall(r'"torch==([\d.]+)"', self.setup)
        assert self.args()["TORCH_VERSION"] == pin
        assert '"torch==$TORCH_VERSION"' in self.runs()
        assert "cuda)" in self.runs() and self.args()["TORCH_VARIANT"] == "cpu"

    def test_its_steps_are_those_of_setup(self):
        runs = self.runs()
        for step in ("-m venv .venv", "pip install -q --upgrade pip"):
            assert step in self.setup and step in runs, step
        # the setup path adds the test extras (and the trainers' extras they test)
        assert re.search(r"pip install -q -e \"\.\[test[\w,]*\]\"", self.setup)
        assert re.search(r"pip install -q \. ", runs)  # the package itself, without test extras

    def test_it_copies_what_the_package_is_built_from(self):
        sources = {s for c in self.commands if c.cmd == "COPY" for s in c.value[:-1]}
        for source in sources:
            assert (ROOT / source).exists(), source
        package_dirs = re.search(r"package-dir = \{(.*)\}", (ROOT / "pyproject.toml").read_text())
        for folder in set(re.findall(r'= "(\w+)', package_dirs.group(1))):
            assert folder in sources, f"{folder}/ is a package folder but is not copied"
        (entry,) = [c for c in self.commands if c.cmd == "ENTRYPOINT"]
        assert entry.json and entry.value == ("springback",)


class TestSystemdUnits:
    @staticmethod
    def exec_start(unit: str, env: dict[str, str]) -> list[str]:
        text = (ROOT / "deploy" / "systemd" / unit).read_text()
        (line,) = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
        argv = shlex.split(line.removeprefix("ExecStart="))
        if argv[:2] == ["/bin/sh", "-c"]:
            argv = shlex.split(argv[2].removeprefix("exec "))
        argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a).replace("%i", "tiny-1")
                for a in argv]
        assert argv[0] == "/opt/springback/.venv/bin/springback"
        return shlex.split(" ".join(argv[1:]))

    def test_the_coordinator_unit_parses_with_springback_itself(self):
        args = parse_springback(self.exec_start("springback-coordinator.service", {
            "ETCD": "http://10.0.0.1:2379", "LISTEN": "0.0.0.0:7070", "ADVERTISE": "10.0.0.5:7070"}))
        assert args.command == "coordinator" and args.advertise == "10.0.0.5:7070"

    def test_the_worker_unit_stops_after_the_drain(self):
        args = parse_springback(self.exec_start("springback-worker@.service", {
            "NPROC": "8", "TRAIN_CMD": "python /opt/train/train.py"}))
        assert args.command == "run" and args.job == "tiny-1" and args.nproc_per_node == "8"
        text = (ROOT / "deploy" / "systemd" / "springback-worker@.service").read_text()
        (stop,) = re.findall(r"^TimeoutStopSec=(\d+)$", text, re.M)
        assert int(stop) >= args.drain_timeout_s + 5
