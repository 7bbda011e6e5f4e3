"""What a schema cannot check in docker/kubernetes: that the objects fit together (mounts, selectors,
ports, names), that the gateway would accept its arguments and load its policy, and that the
security settings are the ones docs/deploy.md promises."""

from __future__ import annotations

import ipaddress
import posixpath

import pytest

from gateway.policy import load_policy

from .deployfiles import (
    GATEWAY_UID, K8S, METRICS_PORT, SANDBOX_LABEL, container_env, containers, expand_k8s, flag, gateway_container,
    host_port, kustomization, objects, one, parse_run, workloads,
)

NAMESPACE = "egress-gateway"
CA_FILES = {"mitmproxy-ca.pem", "mitmproxy-ca-cert.pem", "mitmproxy-dhparam.pem", "egress-placeholder.key"}


def _ids(items):
    return [f"{w['kind']}/{w['metadata']['name']}" for w in items]


WORKLOADS = workloads()
workload_param = pytest.mark.parametrize("workload", WORKLOADS, ids=_ids(WORKLOADS))


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _args(workload: dict) -> list[str]:
    container = gateway_container(workload)
    return expand_k8s(container["args"], container_env(container))


def _mounts(workload: dict) -> dict[str, dict]:
    """mountPath -> the volume mounted there, for the gateway container."""
    volumes = {v["name"]: v for v in _pod(workload)["volumes"]}
    return {m["mountPath"]: {**volumes[m["name"]], "_mount": m} for m in gateway_container(workload)["volumeMounts"]}


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and \
        not selector.get("matchExpressions")


# --- the gateway's own view: arguments, policy, CA ----------------------------------------------


@workload_param
def test_the_gateway_accepts_its_arguments(workload):
    container = gateway_container(workload)
    assert "command" not in container  # the image's entrypoint: egress-gateway run
    args = _args(workload)
    assert not [a for a in args if "$(" in a], "an unresolved $(VAR) reference"
    parsed = parse_run(args)
    assert parsed.workers == int(container_env(container)["EGRESS_WORKERS"])
    assert parsed.metrics and parsed.policy and parsed.confdir and parsed.audit_log == "-"
    assert parsed.drain_timeout < _pod(workload)["terminationGracePeriodSeconds"]


@workload_param
def test_workers_follow_the_cpu_limit(workload):
    container = gateway_container(workload)
    env = {e["name"]: e for e in container["env"]}
    ref = env["EGRESS_WORKERS"]["valueFrom"]["resourceFieldRef"]
    assert ref["resource"] == "limits.cpu" and ref["containerName"] == "gateway"
    assert "--workers=$(EGRESS_WORKERS)" in container["args"]
    assert int(container_env(container)["EGRESS_WORKERS"]) >= 1


@workload_param
def test_the_policy_in_the_configmap_loads_with_the_gateways_loader(workload, tmp_path):
    policy_path = flag(_args(workload), "policy")[0]
    directory, key = posixpath.split(policy_path)
    volume = _mounts(workload)[directory]
    assert "subPath" not in volume["_mount"], "a subPath mount never sees ConfigMap updates"
    configmap = one("ConfigMap", volume["configMap"]["name"])
    assert configmap["metadata"]["namespace"] == workload["metadata"]["namespace"]
    assert key in configmap["data"]
    path = tmp_path / key
    path.write_text(configmap["data"][key])
    policy = load_policy(str(path))
    assert policy.rules


def test_the_policy_generator_reads_the_file_the_compose_files_mount():
    gen = next(g for g in kustomization()["configMapGenerator"] if g["name"] == "egress-gateway-policy")
    assert gen["files"] == ["policy.yaml=policy/policy.yaml"]
    assert gen["options"]["disableNameSuffixHash"] is True  # same name: hot reload, not a rollout
    assert load_policy(str(K8S / "policy" / "policy.yaml")).rules


@workload_param
def test_the_ca_comes_from_one_secret_mounted_as_the_confdir(workload):
    confdir = flag(_args(workload), "confdir")[0]
    volume = _mounts(workload)[confdir]
    assert volume["_mount"].get("readOnly") is True and "subPath" not in volume["_mount"]
    secret = one("Secret", volume["secret"]["secretName"])
    assert set(secret["stringData"]) == CA_FILES  # read-only confdir: nothing is generated per pod
    assert volume["secret"]["defaultMode"] == 0o440  # root:fsGroup 0440: the gateway's group only
    assert _pod(workload)["securityContext"]["fsGroup"] == GATEWAY_UID
    gen = next(g for g in kustomization()["secretGenerator"] if g["name"] == secret["metadata"]["name"])
    assert not gen.get("options", {}).get("disableNameSuffixHash")  # a new CA rolls the pods


def test_sandboxes_get_the_ca_certificate_and_never_its_key():
    configmap = one("ConfigMap", "egress-gateway-ca-cert")
    gen = next(g for g in kustomization()["configMapGenerator"] if g["name"] == "egress-gateway-ca-cert")
    assert gen["files"] == ["ca.crt=ca/mitmproxy-ca-cert.pem"]
    assert configmap["metadata"]["namespace"] == one("NetworkPolicy", "sandbox-egress-only-via-gateway")["metadata"]["namespace"]
    for cm in objects("ConfigMap"):
        assert not any("PRIVATE KEY" in value for value in cm.get("data", {}).values())


@workload_param
def test_the_policys_secret_files_are_in_the_mounted_secret(workload, tmp_path):
    policy_path = flag(_args(workload), "policy")[0]
    directory, key = posixpath.split(policy_path)
    path = tmp_path / key
    path.write_text(one("ConfigMap", _mounts(workload)[directory]["configMap"]["name"])["data"][key])
    files = [source.file for source in load_policy(str(path)).secrets.values() if getattr(source, "file", None)]
    assert files, "the example policy reads a secret from a file"
    mounts = _mounts(workload)
    for file in files:
        directory, name = posixpath.split(file)
        volume = mounts[directory]
        assert "secret" in volume and "subPath" not in volume["_mount"]
        assert name in one("Secret", volume["secret"]["secretName"])["stringData"]
        gen = next(g for g in kustomization()["secretGenerator"] if g["name"] == volume["secret"]["secretName"])
        assert gen["options"]["disableNameSuffixHash"] is True  # rotation in place, no restart


@workload_param
def test_every_configmap_and_secret_a_pod_mounts_exists_in_the_kustomization(workload):
    namespace = workload["metadata"]["namespace"]
    for volume in _pod(workload)["volumes"]:
        for kind, key, name_key in (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName")):
            if key in volume:
                found = one(kind, volume[key][name_key])
                assert found["metadata"]["namespace"] == namespace
                assert not volume[key].get("optional"), "a missing object must stop the pod, not run it without"
    for container in containers(workload):
        for mount in container.get("volumeMounts", []):
            assert "subPath" not in mount, f"{container['name']}: subPath mounts never see updates"


# --- probes, ports, services --------------------------------------------------------------------


@workload_param
def test_probes_point_at_the_metrics_port_and_the_health_paths(workload):
    container = gateway_container(workload)
    host, port = host_port(flag(_args(workload), "metrics")[0])
    assert port == METRICS_PORT
    ports = {p["name"]: p for p in container["ports"]}
    assert ports["metrics"]["containerPort"] == METRICS_PORT
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for probe, path in expected.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path and get["port"] in ("metrics", METRICS_PORT), probe
        assert "host" not in get  # the pod's IP: where --metrics listens
    if _pod(workload).get("hostNetwork"):
        # The node's address, not 0.0.0.0: the probes use the pod IP, which is the node's here.
        assert "$(NODE_IP)" in " ".join(container["args"])
    else:
        assert host == "0.0.0.0"
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(METRICS_PORT)


@workload_param
def test_every_listener_is_a_declared_container_port(workload):
    container = gateway_container(workload)
    declared = {(p["containerPort"], p.get("protocol", "TCP")) for p in container["ports"]}
    for mode in flag(_args(workload), "mode"):
        _, port = host_port(mode)
        protocols = ("UDP", "TCP") if mode.startswith("dns") else ("TCP",)
        for protocol in protocols:
            assert (port, protocol) in declared, mode


def test_the_proxy_service_selects_the_deployment_pods_only():
    service = one("Service", "egress-gateway")
    deployment = one("Deployment", "egress-gateway")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _selects({"matchLabels": service["spec"]["selector"]}, pod_labels)
    assert _selects(deployment["spec"]["selector"], pod_labels)
    daemonset = one("DaemonSet")
    assert not _selects({"matchLabels": service["spec"]["selector"]}, daemonset["spec"]["template"]["metadata"]["labels"])
    proxy_port = next(p for p in gateway_container(deployment)["ports"] if p["name"] == "proxy")
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(8080, "proxy")]
    assert host_port(flag(_args(deployment), "mode")[0])[1] == proxy_port["containerPort"]


def test_the_metrics_service_and_servicemonitor_reach_every_gateway_pod():
    service = one("Service", "egress-gateway-metrics")
    assert service["spec"]["clusterIP"] == "None"
    for workload in workloads():
        assert _selects({"matchLabels": service["spec"]["selector"]}, workload["spec"]["template"]["metadata"]["labels"])
    monitor = one("ServiceMonitor")
    assert _selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    # docker/prometheus/alerts.yml matches job="egress-gateway": the job comes from this label.
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "egress-gateway"


def test_the_hpa_and_the_pdb_target_the_deployment():
    deployment = one("Deployment", "egress-gateway")
    hpa = one("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "egress-gateway")
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert hpa["spec"]["minReplicas"] >= 2
    assert "replicas" not in deployment["spec"]  # the HPA owns it
    assert gateway_container(deployment)["resources"]["requests"]["cpu"]  # utilization needs a request
    pdb = one("PodDisruptionBudget")
    assert _selects(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]


# --- network policies ---------------------------------------------------------------------------


def test_the_sandbox_networkpolicy_selects_sandboxes_and_allows_only_the_gateway():
    policy = one("NetworkPolicy", "sandbox-egress-only-via-gateway")
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == dict([SANDBOX_LABEL])
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"} and spec["ingress"] == []
    deployment = one("Deployment", "egress-gateway")
    daemonset = one("DaemonSet")
    explicit, transparent = spec["egress"]
    # Explicit: the Deployment's pods, on the proxy port.
    peer = explicit["to"][0]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": deployment["metadata"]["namespace"]}
    assert _selects(peer["podSelector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert not _selects(peer["podSelector"], daemonset["spec"]["template"]["metadata"]["labels"])
    assert [(p["protocol"], p["port"]) for p in explicit["ports"]] == [("TCP", 8080)]
    # Transparent: node addresses, the DaemonSet's transparent and DNS ports, nothing else.
    assert [list(p) for p in transparent["to"]] == [["ipBlock"]]
    ports = {(p["protocol"], p["port"]) for p in transparent["ports"]}
    listeners = {(proto, host_port(m)[1]) for m in flag(_args(daemonset), "mode")
                 for proto in (("UDP", "TCP") if m.startswith("dns") else ("TCP",))}
    assert ports == listeners
    # The stand-in node range routes nowhere (fail closed until it is edited).
    assert ipaddress.ip_network(transparent["to"][0]["ipBlock"]["cidr"]).subnet_of(ipaddress.ip_network("192.0.2.0/24"))
    for rule in spec["egress"]:
        assert rule.get("ports"), "an egress rule without ports allows every port"


def test_the_gateway_networkpolicy_admits_sandboxes_and_keeps_its_egress_off_private_ranges():
    policy = one("NetworkPolicy", "egress-gateway")
    spec = policy["spec"]
    deployment = one("Deployment", "egress-gateway")
    assert _selects(spec["podSelector"], deployment["spec"]["template"]["metadata"]["labels"])
    proxy, metrics = spec["ingress"]
    assert proxy["from"][0]["podSelector"]["matchLabels"] == dict([SANDBOX_LABEL])
    assert [(p["protocol"], p["port"]) for p in proxy["ports"]] == [("TCP", 8080)]
    assert [(p["protocol"], p["port"]) for p in metrics["ports"]] == [("TCP", METRICS_PORT)]
    dns, internet = spec["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    excepted = [ipaddress.ip_network(c) for block in internet["to"] for c in block["ipBlock"]["except"]]
    for must in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10",
                 "127.0.0.0/8", "fc00::/7", "fe80::/10", "::1/128"):
        network = ipaddress.ip_network(must)
        assert any(network.version == e.version and network.subnet_of(e) for e in excepted), must
    for block in internet["to"]:
        cidr = ipaddress.ip_network(block["ipBlock"]["cidr"])
        assert all(ipaddress.ip_network(e).subnet_of(cidr) for e in block["ipBlock"]["except"])


# --- security settings --------------------------------------------------------------------------


def _restricted_violations(pod: dict, container_list: list[dict]) -> list[str]:
    """The Pod Security Standard "restricted" (the checks that apply to these fields)."""
    problems = []
    pod_sc = pod.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append(key)
    if any("hostPath" in v for v in pod.get("volumes", [])):
        problems.append("hostPath volume")
    for c in container_list:
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            problems.append(f"{c['name']}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c['name']}: allowPrivilegeEscalation")
        if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True):
            problems.append(f"{c['name']}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{c['name']}: runAsUser 0")
        if sc.get("capabilities", {}).get("drop") != ["ALL"]:
            problems.append(f"{c['name']}: capabilities not dropped")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{c['name']}: capabilities added")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{c['name']}: seccomp")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            problems.append(f"{c['name']}: hostPort")
    return problems


def test_the_deployment_meets_the_restricted_pod_security_standard():
    deployment = one("Deployment", "egress-gateway")
    assert _restricted_violations(_pod(deployment), containers(deployment)) == []


@workload_param
def test_the_gateway_container_runs_unprivileged_on_a_read_only_root(workload):
    container = gateway_container(workload)
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == GATEWAY_UID
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}  # transparent mode too: the redirect is not its job
    assert _pod(workload)["automountServiceAccountToken"] is False
    # --workers keeps its merged metrics in a temporary directory: the only writable path.
    writable = [m for m in container["volumeMounts"] if not m.get("readOnly")]
    assert [m["mountPath"] for m in writable] == ["/tmp"]
    resources = container["resources"]
    for kind in ("requests", "limits"):
        assert resources[kind]["cpu"] and resources[kind]["memory"]


def test_only_the_daemonsets_init_container_holds_capabilities_and_only_network_ones():
    daemonset = one("DaemonSet")
    pod = _pod(daemonset)
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (init,) = pod["initContainers"]
    sc = init["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False and sc["readOnlyRootFilesystem"] is True
    env = container_env(init)
    assert env["NODE_IP"] and env["SANDBOX_INTERFACES"]
    args = _args(daemonset)
    assert {host_port(m)[1] for m in flag(args, "mode") if m.startswith("transparent")} == {int(env["PROXY_PORT"])}
    assert {host_port(m)[1] for m in flag(args, "mode") if m.startswith("dns")} == {int(env["DNS_PORT"])}
    for mode in flag(args, "mode"):
        assert host_port(mode)[0] == env["NODE_IP"]  # the DNAT target, not every interface
    assert (K8S.parent / "netinit" / "node-redirect.sh").exists()
    for workload in workloads():
        for container in containers(workload):
            if container is not init:
                assert not container["securityContext"]["capabilities"].get("add"), container["name"]
    assert {"key": "egress-gateway/sandbox-node", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"]["egress-gateway/sandbox-node"] == "true"


def test_images_are_the_ones_the_kustomization_pins():
    images = {i["name"]: i for i in kustomization()["images"]}
    used = {c["image"].split(":")[0] for w in workloads() for c in containers(w)}
    assert used == set(images)
    assert all(i.get("newTag") for i in images.values())


def test_every_namespaced_object_lives_in_a_namespace_defined_here():
    namespaces = {n["metadata"]["name"] for n in objects("Namespace")}
    assert NAMESPACE in namespaces
    namespaced = [o for o in objects("Deployment") + objects("DaemonSet") + objects("Service") + objects("ConfigMap")
                  + objects("Secret") + objects("NetworkPolicy") + objects("ServiceMonitor")
                  + objects("PodDisruptionBudget") + objects("HorizontalPodAutoscaler") + objects("ServiceAccount")]
    for obj in namespaced:
        assert obj["metadata"].get("namespace") in namespaces, obj["metadata"]["name"]
    labels = one("Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    sandboxes = one("Namespace", one("NetworkPolicy", "sandbox-egress-only-via-gateway")["metadata"]["namespace"])
    assert sandboxes["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload in workloads():
        assert _pod(workload)["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]
        assert _pod(workload)["priorityClassName"] == one("PriorityClass")["metadata"]["name"]
