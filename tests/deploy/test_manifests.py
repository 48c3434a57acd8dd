"""The deployment files, checked offline: Kubernetes manifests against the
API schemas (kubernetes-validate), their commands against Springback's own
argument parsers, the Dockerfile through BuildKit's parser, systemd units'
command lines. No cluster and no docker engine is needed (none runs here).

The hardening is checked here too: every pod against the Kubernetes
"restricted" Pod Security Standard (the checks below are written from that
profile, so a manifest that PSA would refuse fails here first), the
NetworkPolicies against the ports the Services and containers expose, TLS on
every etcd and coordinator connection, and the systemd units' sandboxing."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import dockerfile
import grpc
import kubernetes_validate
import pytest
import yaml

from springback.cli.main import build_parser
from springback.client.env import TLS_CA, TLS_CERT, TLS_KEY

pytestmark = [pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"   # what both the CPU (deploy/kubernetes) and the GPU overlay build on
MANIFESTS = ["namespace.yaml", "etcd.yaml", "etcd-auth.yaml", "coordinator.yaml", "workers.yaml",
             "network-policies.yaml"]
NAMESPACE = "springback"
WORKLOAD_KINDS = ("StatefulSet", "Deployment", "Job")
K8S_VERSION = kubernetes_validate.utils.latest_version()


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]


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
        kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
        assert sorted(kustomization["resources"]) == sorted(MANIFESTS)
        for overlay, base in (("kustomization.yaml", "base"), ("gpu/kustomization.yaml", "../base")):
            resources = yaml.safe_load((K8S / overlay).read_text())["resources"]
            assert resources == [base], f"deploy/kubernetes/{overlay}: resources must be [{base}]"

    @pytest.mark.skipif(not shutil.which("kubectl"), reason="no kubectl")
    @pytest.mark.parametrize("overlay", [".", "gpu"])
    def test_kustomize_builds_each_deployment_into_the_namespace(self, overlay):
        result = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)],
                                capture_output=True, text=True, timeout=30, check=False)
        assert result.returncode == 0, f"kubectl kustomize deploy/kubernetes/{overlay}: {result.stderr}"
        built = [d for d in yaml.safe_load_all(result.stdout) if d]
        assert len(built) == len(every_document()), f"{overlay}: {len(built)} documents"
        for doc in built:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            if doc["kind"] != "Namespace":
                assert doc["metadata"].get("namespace") == NAMESPACE, (
                    f"{overlay}: {doc['kind']} {doc['metadata']['name']} is not in {NAMESPACE}")

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
        assert flags["advertise-client-urls"] == "https://springback-etcd-1.springback-etcd:2379"
        peers = dict(p.split("=", 1) for p in flags["initial-cluster"].split(","))
        assert sorted(peers) == [f"springback-etcd-{i}" for i in range(sts["spec"]["replicas"])]
        anti = pod_spec(sts)["affinity"]["podAntiAffinity"]
        assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
            "kubernetes.io/hostname")

    def test_no_secret_is_shipped_and_each_one_used_is_documented(self):
        assert [d for d in every_document() if d["kind"] == "Secret"] == []
        for name in ("coordinator.yaml", "workers.yaml", "etcd-auth.yaml"):
            text = (BASE / name).read_text()
            # the TLS Secrets (-tls) are cert-manager's (see TestTls); the others the operator's
            mounted = re.findall(r"secret: \{secretName: ([\w-]+)", text)
            for secret in set(re.findall(r"secret(?:KeyRef|Ref): \{name: ([\w-]+)", text)) | {
                    s for s in mounted if not s.endswith("-tls")}:
                assert f"kubectl -n {NAMESPACE} create secret generic {secret}" in text, (
                    f"{name}: the Secret {secret} is used but its kubectl command is not documented")
        assert "change-me" not in "".join((BASE / n).read_text() for n in MANIFESTS)

    def test_every_workload_has_requests_and_a_disruption_budget(self):
        budgets = [d for d in every_document() if d["kind"] == "PodDisruptionBudget"]
        for doc in every_document():
            if doc["kind"] not in ("StatefulSet", "Deployment", "Job"):
                continue
            labels = doc["spec"]["template"]["metadata"]["labels"]
            for c in pod_spec(doc)["containers"]:
                assert {"cpu", "memory"} <= set(c["resources"]["requests"]), doc["metadata"]["name"]
            # a run-once Job may instead run again after an eviction, not counting it as a failure
            rerun = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in (
                doc["spec"].get("podFailurePolicy", {}).get("rules", []))
            assert rerun or any(b["spec"]["selector"]["matchLabels"].items() <= labels.items()
                                for b in budgets), doc["metadata"]["name"]

    def test_the_coordinator_command_line_parses_with_springback_itself(self):
        (c,) = pod_spec(by_kind("Deployment", "springback-coordinator"))["containers"]
        env = container_env(c)
        args = parse_springback([expand(a, env) for a in c["args"]])
        assert args.command == "coordinator" and args.advertise == "10.0.0.7:7070"
        assert args.etcd_ca and args.etcd_cert and args.etcd_key, "coordinator: etcd TLS flags"
        assert args.tls_cert and args.tls_key and args.tls_client_ca, "coordinator: API TLS flags"
        assert args.listen.endswith(":7070") and args.metrics_listen.endswith(":9090")
        assert {p["containerPort"] for p in c["ports"]} == {7070, 9090}


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


# --- Pod security --------------------------------------------------------------------

# The "restricted" Pod Security Standard (kubernetes.io/docs/concepts/security/
# pod-security-standards), which includes "baseline".
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}


def restricted_violations(where: str, spec: dict) -> list[str]:
    """Every way the pod spec breaks the restricted profile, each naming the
    pod and the field (an empty list: PSA `enforce: restricted` admits it)."""
    bad: list[str] = []
    pod = spec.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            bad.append(f"{where}: spec.{field} is true")
    for volume in spec.get("volumes", []):
        (kind,) = set(volume) - {"name"}
        if kind not in RESTRICTED_VOLUME_TYPES:
            bad.append(f"{where}: volume {volume['name']} is a {kind} volume")
    for sysctl in pod.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad.append(f"{where}: sysctl {sysctl['name']} is not a safe one")
    if pod.get("runAsUser") == 0:
        bad.append(f"{where}: securityContext.runAsUser is 0")
    pod_seccomp = pod.get("seccompProfile", {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        bad.append(f"{where}: securityContext.seccompProfile.type is {pod_seccomp}")
    if pod.get("seLinuxOptions", {}).get("type", "") not in SELINUX_TYPES:
        bad.append(f"{where}: securityContext.seLinuxOptions.type is not allowed")
    containers = spec["containers"] + spec.get("initContainers", [])
    for c in containers + spec.get("ephemeralContainers", []):
        name = f"{where} container {c['name']}"
        ctx = c.get("securityContext", {})
        if ctx.get("privileged"):
            bad.append(f"{name}: securityContext.privileged is true")
        if ctx.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: securityContext.allowPrivilegeEscalation is not false")
        caps = ctx.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: securityContext.capabilities.drop lacks ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: securityContext.capabilities.add {caps['add']}")
        if not ctx.get("runAsNonRoot", pod.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot is not true (pod or container)")
        if ctx.get("runAsUser") == 0:
            bad.append(f"{name}: securityContext.runAsUser is 0")
        seccomp = ctx.get("seccompProfile", {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile is {seccomp} (RuntimeDefault or Localhost)")
        if ctx.get("procMount", "Default") != "Default":
            bad.append(f"{name}: securityContext.procMount is {ctx['procMount']}")
        if ctx.get("windowsOptions", {}).get("hostProcess"):
            bad.append(f"{name}: windowsOptions.hostProcess is true")
        if ctx.get("seLinuxOptions", {}).get("type", "") not in SELINUX_TYPES:
            bad.append(f"{name}: securityContext.seLinuxOptions.type is not allowed")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                bad.append(f"{name}: port {port['containerPort']} has a hostPort")
    return bad


def gpu_job() -> dict:
    kustomization = yaml.safe_load((K8S / "gpu" / "kustomization.yaml").read_text())
    (patch,) = kustomization["patches"]
    return json_patch(by_kind("Job", "springback-workers"),
                      json.loads((K8S / "gpu" / patch["path"]).read_text()))


def workloads() -> list[tuple[str, dict]]:
    """(name, workload) for every pod template, the GPU overlay's Job included."""
    found = [(f"{d['kind']} {d['metadata']['name']}", d) for d in every_document()
             if d["kind"] in WORKLOAD_KINDS]
    return found + [("Job springback-workers (gpu overlay)", gpu_job())]


class TestPodSecurity:
    def test_the_namespace_enforces_the_restricted_profile(self):
        (ns,) = [d for d in every_document() if d["kind"] == "Namespace"]
        assert ns["metadata"]["name"] == NAMESPACE
        labels = ns["metadata"]["labels"]
        assert labels.get("pod-security.kubernetes.io/enforce") == "restricted", (
            f"namespace.yaml: labels {labels} do not enforce restricted")
        kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
        assert kustomization["namespace"] == NAMESPACE, "kustomization.yaml: namespace"

    @pytest.mark.parametrize("name", [n for n, _ in workloads()])
    def test_every_pod_meets_the_restricted_pod_security_standard(self, name):
        spec = pod_spec(dict(workloads())[name])
        assert restricted_violations(name, spec) == []

    def test_the_checks_catch_each_kind_of_violation(self):
        # the checks themselves: a pod that breaks each rule is reported for it
        spec = copy.deepcopy(pod_spec(by_kind("Job", "springback-workers")))
        spec["hostNetwork"] = True
        spec["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
        spec["securityContext"]["seccompProfile"] = {"type": "Unconfined"}
        ctx = spec["containers"][0]["securityContext"]
        ctx.update(privileged=True, allowPrivilegeEscalation=True, runAsUser=0,
                   capabilities={"add": ["SYS_ADMIN"]})
        spec["containers"][0]["ports"][0]["hostPort"] = 9091
        bad = "\n".join(restricted_violations("job", spec))
        for field in ("hostNetwork", "hostPath", "seccompProfile", "privileged",
                      "allowPrivilegeEscalation", "runAsUser is 0", "drop lacks ALL",
                      "capabilities.add", "hostPort"):
            assert field in bad, f"{field} not reported in:\n{bad}"

    @pytest.mark.parametrize("name", [n for n, _ in workloads()])
    def test_every_pod_runs_as_a_fixed_non_root_user_on_a_read_only_root(self, name):
        spec = pod_spec(dict(workloads())[name])
        pod = spec["securityContext"]
        assert pod.get("runAsNonRoot") is True, f"{name}: securityContext.runAsNonRoot"
        for field in ("runAsUser", "runAsGroup", "fsGroup"):
            assert pod.get(field, 0) > 0, f"{name}: securityContext.{field} must be non-zero"
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, f"{name}: seccompProfile"
        for c in spec["containers"]:
            assert c["securityContext"].get("readOnlyRootFilesystem") is True, (
                f"{name} container {c['name']}: readOnlyRootFilesystem")
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}, (
                f"{name} container {c['name']}: capabilities must be drop [ALL] and nothing added")

    def test_processes_that_write_scratch_files_get_an_empty_dir_for_them(self):
        for name, doc in workloads():
            if doc["kind"] == "StatefulSet":
                continue  # etcd writes only its data volume
            spec = pod_spec(doc)
            empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
            (c,) = spec["containers"]
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts.get("/tmp") in empty, f"{name}: /tmp is not an emptyDir"

    @pytest.mark.parametrize("name", [n for n, _ in workloads()])
    def test_no_pod_gets_a_service_account_token(self, name):
        # none of them calls the Kubernetes API; the workers run user code
        spec = pod_spec(dict(workloads())[name])
        assert spec.get("automountServiceAccountToken") is False, (
            f"{name}: automountServiceAccountToken must be false")


# --- Network policies ----------------------------------------------------------------

def network_policies() -> list[dict]:
    return [d for d in every_document() if d["kind"] == "NetworkPolicy"]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector {selector}: only matchLabels is checked"
    return selector.get("matchLabels", {}).items() <= labels.items()


def ingress_sources(labels: dict, port: int) -> list[dict]:
    """The `from` peers of every rule that lets TCP traffic to `port` reach
    pods with these labels ({} stands for "from anywhere")."""
    sources = []
    for policy in network_policies():
        if not selects(policy["spec"]["podSelector"], labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is None or any(p["port"] == port for p in ports):
                sources += rule.get("from") or [{}]
    return sources


def pods_labelled(name: str) -> dict:
    return {"app.kubernetes.io/name": name}


class TestNetworkPolicies:
    def test_ingress_is_denied_by_default(self):
        deny = [p for p in network_policies() if p["spec"]["podSelector"] == {}
                and p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress")]
        assert deny, "network-policies.yaml: no default-deny-ingress policy (podSelector {})"

    def test_a_policy_lets_in_every_port_a_service_or_container_exposes(self):
        for doc in every_document():
            if doc["kind"] not in WORKLOAD_KINDS:
                continue
            labels = doc["spec"]["template"]["metadata"]["labels"]
            ports = {p["containerPort"] for c in pod_spec(doc)["containers"]
                     for p in c.get("ports", [])}
            for service in (d for d in every_document() if d["kind"] == "Service"):
                if selects({"matchLabels": service["spec"]["selector"]}, labels):
                    ports |= {p.get("targetPort", p["port"]) for p in service["spec"]["ports"]}
            for port in sorted(ports):
                assert ingress_sources(labels, port), (
                    f"{doc['metadata']['name']}: port {port} is exposed but no NetworkPolicy lets "
                    "any traffic in (default deny makes it unreachable)")

    def test_etcd_takes_clients_only_from_the_coordinator_and_peers_only_from_etcd(self):
        etcd = pods_labelled("springback-etcd")
        assert ingress_sources(etcd, 2379) == [
            {"podSelector": {"matchLabels": pods_labelled("springback-coordinator")}},
            {"podSelector": {"matchLabels": pods_labelled("springback-etcd-auth")}}], (
            "springback-etcd: port 2379 must be reachable from the coordinator pods and the "
            "Job enabling etcd's auth only")
        assert ingress_sources(etcd, 2380) == [
            {"podSelector": {"matchLabels": etcd}}], (
            "springback-etcd: port 2380 must be reachable from the etcd pods only")

    def test_the_coordinator_api_is_for_workers_replicas_and_operators_its_metrics_for_monitoring(self):
        coordinator = pods_labelled("springback-coordinator")
        assert ingress_sources(coordinator, 7070) == [
            {"podSelector": {"matchLabels": pods_labelled("springback-worker")}},
            {"podSelector": {"matchLabels": coordinator}},
            {"namespaceSelector": {"matchLabels": {"springback.io/access": "operator"}}}], (
            "springback-coordinator: port 7070 sources")
        assert ingress_sources(coordinator, 9090) == [
            {"namespaceSelector": {"matchLabels": {"springback.io/access": "monitoring"}}}], (
            "springback-coordinator: the metrics/dashboard port 9090 must be for monitoring only")

    def test_workers_ports_are_reachable_from_workers_only_but_metrics(self):
        worker = pods_labelled("springback-worker")
        for port in (29500, 40000, 65000):  # the rendezvous store, collectives: ephemeral ports
            assert ingress_sources(worker, port) == [{"podSelector": {"matchLabels": worker}}], (
                f"springback-worker: port {port} must be reachable from worker pods only")
        assert {"namespaceSelector": {"matchLabels": {"springback.io/access": "monitoring"}}} in (
            ingress_sources(worker, 9091)), "springback-worker: metrics 9091 from monitoring"

    def test_the_labels_operators_provide_are_documented(self):
        text = (BASE / "network-policies.yaml").read_text()
        for label in ("springback.io/access=operator", "springback.io/access=monitoring"):
            assert label in text, f"network-policies.yaml: the label {label} is not documented"


# --- TLS -----------------------------------------------------------------------------

TLS_KEYS = {"tls.crt", "tls.key", "ca.crt"}


def secret_file(spec: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path`, which must come from a
    read-only mount of a Secret volume."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            secret = volumes[mount["name"]].get("secret")
            assert secret, f"{path}: mounted from {mount['name']}, which is not a Secret"
            assert mount.get("readOnly") is True, f"{path}: the mount {mount['name']} is not readOnly"
            return secret["secretName"], path.removeprefix(mount["mountPath"].rstrip("/") + "/")
    raise AssertionError(f"{path}: no volume is mounted there")


def flag_values(args: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--"))


class TestTls:
    def test_etcd_serves_clients_and_peers_over_tls_with_client_certificates(self):
        sts = by_kind("StatefulSet", "springback-etcd")
        spec = pod_spec(sts)
        (c,) = spec["containers"]
        flags = flag_values(c["args"])
        for flag in ("client-cert-auth", "peer-client-cert-auth"):
            assert flags.get(flag) == "true", f"etcd.yaml: --{flag}=true is missing"
        for flag in ("trusted-ca-file", "cert-file", "key-file",
                     "peer-trusted-ca-file", "peer-cert-file", "peer-key-file"):
            assert flag in flags, f"etcd.yaml: --{flag} is missing"
            secret, key = secret_file(spec, c, flags[flag])
            assert secret == "springback-etcd-tls" and key in TLS_KEYS, (
                f"etcd.yaml: --{flag} reads {key} of {secret}")
        for flag in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls",
                     "initial-advertise-peer-urls"):
            assert flags[flag].startswith("https://"), f"etcd.yaml: --{flag} is not https"
        for peer in flags["initial-cluster"].split(","):
            assert peer.split("=", 1)[1].startswith("https://"), f"etcd.yaml: initial-cluster {peer}"
        # the only plaintext listener: health and metrics, on a port no client uses
        assert flags["listen-metrics-urls"] == "http://0.0.0.0:2381"
        assert {p["httpGet"]["port"] for p in (c["readinessProbe"], c["livenessProbe"])} == {2381}

    def test_the_coordinator_talks_tls_to_etcd_and_serves_mtls(self):
        spec = pod_spec(by_kind("Deployment", "springback-coordinator"))
        (c,) = spec["containers"]
        args = parse_springback([expand(a, container_env(c)) for a in c["args"]])
        for endpoint in args.etcd.split(","):
            assert endpoint.startswith("https://"), f"coordinator.yaml: --etcd {endpoint}"
        for flag, key in (("etcd_ca", "ca.crt"), ("etcd_cert", "tls.crt"), ("etcd_key", "tls.key")):
            assert secret_file(spec, c, getattr(args, flag)) == ("springback-etcd-client-tls", key), (
                f"coordinator.yaml: --{flag.replace('_', '-')}")
        for flag, key in (("tls_client_ca", "ca.crt"), ("tls_cert", "tls.crt"), ("tls_key", "tls.key")):
            assert secret_file(spec, c, getattr(args, flag)) == ("springback-coordinator-tls", key), (
                f"coordinator.yaml: --{flag.replace('_', '-')}")
        # a follower forwards to the leader through the client: it needs the client's TLS env
        env = container_env(c)
        for var in (TLS_CA, TLS_CERT, TLS_KEY):
            assert var in env, f"coordinator.yaml: {var} is not set (forwarding would be plaintext)"
        assert "exec" in c["readinessProbe"], (
            "coordinator.yaml: the kubelet's grpc probe speaks no TLS; the readiness probe must exec")

    @pytest.mark.parametrize("job", ["base", "gpu"])
    def test_agents_reach_the_coordinator_over_mtls(self, job):
        spec = pod_spec(by_kind("Job", "springback-workers") if job == "base" else gpu_job())
        (c,) = spec["containers"]
        env = container_env(c)
        for var, key in ((TLS_CA, "ca.crt"), (TLS_CERT, "tls.crt"), (TLS_KEY, "tls.key")):
            assert var in env, f"workers.yaml: {var} is not set"
            assert secret_file(spec, c, env[var]) == ("springback-worker-tls", key), f"workers.yaml: {var}"

    def test_no_manifest_or_unit_names_a_plaintext_etcd_url(self):
        files = [BASE / n for n in MANIFESTS] + sorted((ROOT / "deploy" / "systemd").iterdir())
        for path in files:
            for url in map(urlsplit, re.findall(r"http://[^\s,\"']+", path.read_text())):
                assert url.port not in (2379, 2380) and "etcd" not in (url.hostname or ""), (
                    f"{path.name}: plaintext etcd URL {url.geturl()}")

    def test_cert_manager_issues_every_tls_secret_and_keeps_etcd_on_its_own_ca(self):
        docs = [d for d in yaml.safe_load_all((K8S / "cert-manager.yaml").read_text()) if d]
        for doc in docs:  # cert-manager's kinds are CRDs: no schema to check them against
            with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        issued = {d["spec"]["secretName"]: d["spec"]["issuerRef"]["name"]
                  for d in docs if d["kind"] == "Certificate" and not d["spec"].get("isCA")}
        used = {v["secret"]["secretName"] for _, w in workloads() for v in pod_spec(w)["volumes"]
                if "secret" in v and v["secret"]["secretName"].endswith("-tls")}
        assert used <= set(issued), f"cert-manager.yaml issues no Certificate for {used - set(issued)}"
        etcd_ca = issued["springback-etcd-tls"]
        assert issued["springback-etcd-client-tls"] == etcd_ca
        assert issued["springback-worker-tls"] != etcd_ca, (
            "cert-manager.yaml: the workers' certificate must not come from etcd's CA")
        kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
        assert "cert-manager.yaml" not in kustomization["resources"], (
            "cert-manager.yaml needs cert-manager's CRDs: it must not be in the default kustomization")

# --- etcd's auth ---------------------------------------------------------------------

def etcd_auth_job() -> tuple[dict, dict]:
    """(pod spec, container) of the Job that enables etcd's auth."""
    spec = pod_spec(by_kind("Job", "springback-etcd-auth"))
    (c,) = spec["containers"]
    return spec, c


def etcd_auth_script() -> str:
    """The script the Job runs: its file, as its ConfigMap volume holds it."""
    spec, c = etcd_auth_job()
    assert c["command"][0] == "python", c["command"]
    (path,) = c["command"][1:]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    config_map = by_kind("ConfigMap", volume["configMap"]["name"])
    return config_map["data"][path.removeprefix(mount["mountPath"].rstrip("/") + "/")]


class TestEtcdAuth:
    def test_the_job_reaches_every_member_with_the_coordinators_etcd_identity(self):
        spec, c = etcd_auth_job()
        env = container_env(c)
        for var, key in (("ETCD_CA", "ca.crt"), ("ETCD_CERT", "tls.crt"), ("ETCD_KEY", "tls.key")):
            assert secret_file(spec, c, env[var]) == ("springback-etcd-client-tls", key), var
        assert secret_file(spec, c, env["ETCD_ROOT_PASSWORD_FILE"]) == (
            "springback-etcd-root", "password")
        # the user it limits is the one etcd reads from the coordinator's certificate
        certificates = {d["spec"]["secretName"]: d["spec"] for d in yaml.safe_load_all(
            (K8S / "cert-manager.yaml").read_text()) if d and d["kind"] == "Certificate"}
        assert env["ETCD_USER"] == certificates["springback-etcd-client-tls"]["commonName"]
        # every etcd member the coordinator uses, and no --etcd-user there: its CN is its user
        (coordinator,) = pod_spec(by_kind("Deployment", "springback-coordinator"))["containers"]
        args = parse_springback([expand(a, container_env(coordinator)) for a in coordinator["args"]])
        assert env["ETCD_ENDPOINTS"].split(",") == [urlsplit(e).netloc for e in args.etcd.split(",")]
        assert args.etcd_user is None, "coordinator.yaml: the client certificate is the etcd user"
        assert pod_spec(by_kind("Job", "springback-etcd-auth"))["restartPolicy"] == "Never"

    def test_the_script_enables_auth_limiting_the_coordinator_to_its_prefix_idempotently(
            self, tmp_path):
        import dataclasses
        import sys

        from etcd3 import etcdrpc

        from etcdtls import CLIENT_CN, make_certs, random_password
        from springback.cli.local import EtcdServer
        from springback.client.api import Client
        from springback.service.transport.config import CoordinatorConfig
        from springback.service.transport.server import CoordinatorServer
        from springback.service.etcd.store import EtcdSecurity, Store, StoreDenied

        tls = make_certs(str(tmp_path / "certs"))  # no password: etcd starts without auth
        etcd = EtcdServer(str(tmp_path / "etcd"), tls=tls)
        etcd.start()
        script = tmp_path / "etcd-auth.py"
        script.write_text(etcd_auth_script())
        password = tmp_path / "password"
        password.write_text(random_password() + "\n")
        env = {"PATH": "/usr/bin:/bin", "ETCD_ENDPOINTS": f"127.0.0.1:{etcd.client_port}",
               "ETCD_USER": CLIENT_CN, "ETCD_CA": tls.ca_file, "ETCD_CERT": tls.client_cert_file,
               "ETCD_KEY": tls.client_key_file, "ETCD_ROOT_PASSWORD_FILE": str(password),
               "ETCD_WAIT_S": "10"}

        def bootstrap(**extra: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, str(script)], env={**env, **extra},
                                  capture_output=True, text=True, timeout=60, check=False)

        certificate = EtcdSecurity(ca_file=tls.ca_file, cert_file=tls.client_cert_file,
                                   key_file=tls.client_key_file)
        root = dataclasses.replace(certificate, user="root",
                                   password=password.read_text().strip())
        server = None
        try:
            for run in (1, 2):  # the second finds everything done (and auth on)
                done = bootstrap()
                assert done.returncode == 0, f"run {run}: {done.stdout}{done.stderr}"
            # the certificate's CN is a user now: /springback/ only, nothing else
            store = Store(etcd.endpoint, security=certificate)
            store.put("/springback/v1/probe", b"1")
            with pytest.raises(StoreDenied, match="permission denied"):
                store.put("/other/x", b"1")
            with pytest.raises(StoreDenied, match="permission denied"):
                store.get("/other/x")
            store.close()
            admin = Store(etcd.endpoint, security=root)  # root, with the Secret's password
            admin.put("/other/x", b"root may")
            # the user has no password anyone knows (an empty one is refused)
            with pytest.raises(grpc.RpcError, match="authentication failed"):
                admin._client.authstub.Authenticate(  # noqa: SLF001
                    etcdrpc.AuthenticateRequest(name=CLIENT_CN, password=""), timeout=5)
            admin.close()
            # a wrong root password, once auth is on, fails the run naming root
            password.write_text("wrong\n")
            refused = bootstrap()
            assert refused.returncode != 0 and "refused root" in refused.stderr, refused.stderr
            # the coordinator works with its certificate alone, as in coordinator.yaml
            server = CoordinatorServer(CoordinatorConfig(
                etcd=etcd.endpoint, listen="127.0.0.1:0", etcd_security=certificate))
            server.start()
            with Client(server.address, timeout_s=10) as client:
                job = client.create_job({"name": "auth", "min_workers": 1, "max_workers": 1,
                                         "data": {"num_samples": 8, "global_batch_size": 8},
                                         "max_steps": 1})
                assert client.get_job(job.id).spec.name == "auth"
        finally:
            if server is not None:
                server.stop(grace_s=0.5)
            etcd.stop(kill=True)


def secrets_of(spec: dict) -> set[str]:
    """Every Secret a pod reads: env, envFrom and volumes."""
    names = {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
    for c in spec.get("initContainers", []) + spec["containers"]:
        names |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})}
    return names


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
        assert self.agent["envFrom"] == [{"secretRef": {"name": "springback-job-s3", "optional": True}}]

    def test_storage_credentials_are_the_jobs_own_secret_that_no_other_pod_takes(self):
        # one Secret per job, like its join credential (issue 44): a name shared
        # by every job (springback-s3, as before) or read by any other pod fails
        job_secrets = {"springback-job-credential", "springback-job-s3"}
        used = secrets_of(pod_spec(self.job))
        assert {s for s in used if s != "springback-worker-tls"} == job_secrets, used
        for doc in every_document():
            if doc["kind"] in WORKLOAD_KINDS and doc != self.job:
                others = secrets_of(pod_spec(doc)) & job_secrets
                assert not others, f"{doc['metadata']['name']} takes the job's Secrets {others}"
        text = "".join((BASE / n).read_text() for n in MANIFESTS)
        assert "springback-s3" not in text.replace("springback-job-s3", ""), (
            "a storage Secret shared by every job")

    def test_the_gpu_overlay_yields_a_valid_job_with_one_gpu_per_rank(self):
        kustomization = yaml.safe_load((K8S / "gpu" / "kustomization.yaml").read_text())
        (patch,) = kustomization["patches"]
        assert patch["target"]["kind"] == "Job" and patch["target"]["name"] == "springback-workers"
        job = json_patch(self.job, json.loads((K8S / "gpu" / patch["path"]).read_text()))
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
        (c,) = pod_spec(job)["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == int(self.run_args(job).nproc_per_node) == 8
        assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(job)["tolerations"])


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

    def test_its_base_image_is_pinned_by_digest(self):
        # a tag can be re-pushed; a digest names one image (issue 44, supply chain)
        base = self.args()["PYTHON_IMAGE"]
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", base), base
        (frm,) = [c for c in self.commands if c.cmd == "FROM"]
        assert frm.value == ("${PYTHON_IMAGE}",)

    def test_its_steps_are_those_of_setup(self):
        runs = self.runs()
        for step in ("-m venv .venv", "pip install -q -c constraints.txt --upgrade pip"):
            assert step in self.setup and step in runs, step
        # the setup path adds the test extras (and the trainers' extras they test)
        assert re.search(r"pip install -q -c constraints.txt -e \"\.\[test[\w,]*\]\"", self.setup)
        # the package itself, without test extras
        assert re.search(r"pip install -q -c constraints.txt \. ", runs)

    def test_it_copies_what_the_package_is_built_from(self):
        sources = {s for c in self.commands if c.cmd == "COPY" for s in c.value[:-1]}
        for source in sources:
            assert (ROOT / source).exists(), source
        package_dirs = re.search(r"package-dir = \{(.*)\}", (ROOT / "pyproject.toml").read_text())
        for folder in set(re.findall(r'= "(\w+)', package_dirs.group(1))):
            assert folder in sources, f"{folder}/ is a package folder but is not copied"
        (entry,) = [c for c in self.commands if c.cmd == "ENTRYPOINT"]
        assert entry.json and entry.value == ("springback",)


HARDENING = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
    "PrivateTmp": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX", "RestrictNamespaces": "yes",
    "LockPersonality": "yes", "CapabilityBoundingSet": "", "SystemCallFilter": "@system-service",
}


def unit_settings(unit: str) -> dict[str, list[str]]:
    """The [Service] section's settings, each key with all its values in order."""
    settings: dict[str, list[str]] = {}
    section = None
    for line in (ROOT / "deploy" / "systemd" / unit).read_text().splitlines():
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


class TestSystemdUnits:
    @pytest.mark.parametrize("unit", ["springback-coordinator.service", "springback-worker@.service"])
    def test_each_unit_runs_unprivileged_in_a_sandbox(self, unit):
        settings = unit_settings(unit)
        assert settings.get("DynamicUser") == ["yes"] or settings.get("User") == ["springback"], (
            f"{unit}: needs DynamicUser=yes or User=springback")
        assert settings.get("User", ["springback"]) != ["root"], f"{unit}: User=root"
        for key, value in HARDENING.items():
            assert settings.get(key) == [value], f"{unit}: {key}={value} (has {settings.get(key)})"
        for credential in settings.get("LoadCredential", []):
            assert credential.split(":", 1)[1].startswith("/etc/springback/tls/"), (
                f"{unit}: LoadCredential={credential}")
        assert {"tls.crt", "tls.key", "ca.crt"} <= {
            c.split(":", 1)[0] for c in settings.get("LoadCredential", [])}, (
            f"{unit}: the TLS files must come in through LoadCredential")

    def test_the_coordinator_hides_devices_the_gpu_worker_does_not(self):
        assert unit_settings("springback-coordinator.service")["PrivateDevices"] == ["yes"]
        worker = unit_settings("springback-worker@.service")
        assert "PrivateDevices" not in worker, (
            "springback-worker@.service: PrivateDevices would hide the GPUs from the ranks")
        assert "MemoryDenyWriteExecute" not in worker, (
            "springback-worker@.service: MemoryDenyWriteExecute breaks PyTorch's JIT kernels")

    def test_the_worker_writes_only_its_state_directory(self):
        worker = unit_settings("springback-worker@.service")
        assert worker["StateDirectory"] == ["springback"], "springback-worker@.service: StateDirectory"
        assert worker["ReadWritePaths"] == ["/var/lib/springback"], (
            "springback-worker@.service: ReadWritePaths")
        assert set(worker["Environment"][0].split()) == {
            f"{TLS_CA}=%d/ca.crt", f"{TLS_CERT}=%d/tls.crt", f"{TLS_KEY}=%d/tls.key"}, (
            "springback-worker@.service: the client's TLS env from the credentials")

    @pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze")
    def test_systemd_accepts_the_units(self, tmp_path):
        # the binary is not installed here: verify with /bin/true in its place
        for unit in ("springback-coordinator.service", "springback-worker@.service"):
            text = (ROOT / "deploy" / "systemd" / unit).read_text()
            (tmp_path / unit).write_text(text.replace("/opt/springback/.venv/bin/springback", "/bin/true"))
        result = subprocess.run(
            ["systemd-analyze", "verify", "springback-coordinator.service",
             "springback-worker@tiny.service"],
            cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False)
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    @staticmethod
    def exec_start(unit: str, env: dict[str, str]) -> list[str]:
        text = (ROOT / "deploy" / "systemd" / unit).read_text()
        (line,) = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
        argv = shlex.split(line.removeprefix("ExecStart="))
        if argv[:2] == ["/bin/sh", "-c"]:
            argv = shlex.split(argv[2].removeprefix("exec "))
        argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a).replace("%i", "tiny-1")
                .replace("%d", f"/run/credentials/{unit}") for a in argv]
        assert argv[0] == "/opt/springback/.venv/bin/springback"
        return shlex.split(" ".join(argv[1:]))

    def test_the_coordinator_unit_parses_with_springback_itself(self):
        args = parse_springback(self.exec_start("springback-coordinator.service", {
            "ETCD": "https://10.0.0.1:2379", "LISTEN": "0.0.0.0:7070", "ADVERTISE": "10.0.0.5:7070"}))
        assert args.command == "coordinator" and args.advertise == "10.0.0.5:7070"
        for flag in ("etcd_ca", "etcd_cert", "etcd_key", "tls_cert", "tls_key", "tls_client_ca"):
            assert getattr(args, flag, None), f"springback-coordinator.service: no --{flag.replace('_', '-')}"
            assert getattr(args, flag).startswith("/run/credentials/"), (
                f"springback-coordinator.service: --{flag.replace('_', '-')} is not a LoadCredential file")

    def test_the_worker_unit_stops_after_the_drain(self):
        args = parse_springback(self.exec_start("springback-worker@.service", {
            "NPROC": "8", "TRAIN_CMD": "python /opt/train/train.py"}))
        assert args.command == "run" and args.job == "tiny-1" and args.nproc_per_node == "8"
        text = (ROOT / "deploy" / "systemd" / "springback-worker@.service").read_text()
        (stop,) = re.findall(r"^TimeoutStopSec=(\d+)$", text, re.M)
        assert int(stop) >= args.drain_timeout_s + 5
