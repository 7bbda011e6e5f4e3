"""Every Kubernetes object in docker/kubernetes (and every one kustomization.yaml generates)
validates against the official Kubernetes JSON schemas, strictly (unknown fields are errors), for
the oldest Kubernetes version the manifests support and the newest one the schema package has.
The schemas come with the kubernetes-validate package: no cluster, no network.

The ServiceMonitor is a Prometheus Operator CRD, which kubernetes-validate does not ship: it is
validated against the CRD's schema vendored in schemas/ (see schemas/README.md)."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess

import jsonschema
import pytest
import yaml

from .deployfiles import K8S, SCHEMAS, all_objects, generated, kustomization, one, resources

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install -e '.[test]' (kubernetes-validate bundles the Kubernetes schemas)")

OLDEST_SUPPORTED = "1.29"  # docs/deploy.md states it; HPA v2, PDB v1 with unhealthyPodEvictionPolicy, PSA labels
VERSIONS = sorted({OLDEST_SUPPORTED, kubernetes_validate.latest_version()},
                  key=lambda v: tuple(int(p) for p in v.split(".")))
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor-v1.json"}


def _crd_validator(api_version: str, kind: str):
    schema = json.loads(CRD_SCHEMAS[(api_version, kind)].read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(doc: dict, version: str) -> list[str]:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in _crd_validator(*key).iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    return []


def _label(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(version):
    failures = {}
    for doc in all_objects():
        errors = _errors(doc, version)
        if errors:
            failures[_label(doc)] = errors
    assert not failures, f"Kubernetes {version}: {failures}"


def test_every_kind_has_a_schema_here():
    # A kind without a schema would pass silently in kubernetes-validate (a warning, not an error).
    version = VERSIONS[-1]
    for doc in all_objects():
        if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError as exc:  # pragma: no cover - the failure message
            pytest.fail(exc.message)


@pytest.mark.parametrize("mutate, kind", [
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="proxy"), "Deployment"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(livenesProbe={}), "Deployment"),
    (lambda d: d["spec"].update(minReplicas="two"), "HorizontalPodAutoscaler"),
    (lambda d: d["spec"]["endpoints"][0].update(scheme="gopher"), "ServiceMonitor"),
    (lambda d: d["spec"]["endpoints"][0].update(prot="metrics"), "ServiceMonitor"),
    (lambda d: d["spec"]["egress"][0].update(ports={"protocol": "TCP", "port": 53}), "NetworkPolicy"),
    (lambda d: d["spec"]["template"]["spec"].update(hostNetwork="yes"), "DaemonSet"),
])
def test_the_validation_is_strict_enough_to_catch_mistakes(mutate, kind):
    doc = copy.deepcopy(next(d for d in all_objects() if d["kind"] == kind))
    mutate(doc)
    assert _errors(doc, VERSIONS[-1]), f"a broken {kind} validated"


def test_the_vendored_servicemonitor_schema_is_the_operator_crd():
    schema = json.loads((SCHEMAS / "servicemonitor-v1.json").read_text())
    assert "prometheus-operator" in schema["$comment"] and "Apache-2.0" in schema["$comment"]
    spec = schema["$defs"]["ServiceMonitorSpec"]
    assert {"endpoints", "selector", "namespaceSelector", "jobLabel"} <= set(spec["properties"])
    assert spec["additionalProperties"] is False


def test_kustomize_renders_the_directory_and_the_output_validates(tmp_path):
    """The real kustomize (kubectl kustomize, no cluster needed) on a copy with stand-ins for the
    operator's files: generator references get their hash suffixes, images their tags."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the static checks above still ran)")
    copy_dir = tmp_path / "kubernetes"
    shutil.copytree(K8S, copy_dir, ignore=shutil.ignore_patterns("ca", "secrets"))
    for gen in kustomization().get("configMapGenerator", []) + kustomization().get("secretGenerator", []):
        for entry in gen.get("files", []):
            source = copy_dir / entry.split("=", 1)[-1]
            if not source.exists():
                source.parent.mkdir(parents=True, exist_ok=True)
                source.write_text(f"stand-in for {source.name}\n")
    result = subprocess.run([kubectl, "kustomize", str(copy_dir)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0 and "unknown command" in result.stderr:
        pytest.skip(f"this kubectl cannot render kustomizations: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    hashed = {g["name"] for g in kustomization()["secretGenerator"] + kustomization()["configMapGenerator"]
              if not g.get("options", {}).get("disableNameSuffixHash")}

    def unhashed(label: str) -> str:
        kind, _, name = label.partition("/")
        base = re.sub(r"-[a-z0-9]{10}$", "", name)
        return f"{kind}/{base}" if base in hashed else label

    assert sorted(unhashed(_label(d)) for d in rendered) == sorted(_label(d) for d in all_objects())
    for doc in rendered:
        assert not _errors(doc, VERSIONS[-1]), (_label(doc), _errors(doc, VERSIONS[-1]))
    # The CA Secret's name carries the content hash, and both workloads mount that name.
    ca_secret = next(d for d in rendered if d["kind"] == "Secret" and d["metadata"]["name"].startswith("egress-gateway-ca-"))
    for workload in (d for d in rendered if d["kind"] in ("Deployment", "DaemonSet")):
        names = {v["secret"]["secretName"] for v in workload["spec"]["template"]["spec"]["volumes"] if "secret" in v}
        assert ca_secret["metadata"]["name"] in names
        images = {c["image"] for c in workload["spec"]["template"]["spec"]["containers"]}
        assert all(image.endswith(":0.1.0") for image in images), images


def test_every_manifest_file_is_in_the_kustomization():
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == listed, f"not listed: {on_disk - listed}; missing: {listed - on_disk}"
    assert resources() and generated()
    assert one("Namespace", "egress-gateway")
