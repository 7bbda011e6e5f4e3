"""Regenerate servicemonitor-v1.json, the ServiceMonitor schema the deployment tests validate against.

Not run by the tests. kubernetes-validate ships the schemas of Kubernetes' own kinds only, so the
Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1) needs one of its own. Its source is
the prometheus-operator CRD's openAPIV3Schema (Apache-2.0), as packaged on PyPI in
cloudcoil-models-prometheus-operator (Apache-2.0), which generates one pydantic model per schema
object from the CRDs of the prometheus-operator release in its version number:

    python -m venv /tmp/sm && /tmp/sm/bin/pip install cloudcoil-models-prometheus-operator==0.80.1.0
    /tmp/sm/bin/python tests/deploy/schemas/make_servicemonitor_schema.py > tests/deploy/schemas/servicemonitor-v1.json

The pydantic schema is made as strict as the API server's structural-schema handling of the CRD:
nulls are not values (the models make every optional field nullable), objects with declared
properties take no other keys (the API server prunes or, with strict field validation, rejects
unknown fields), and descriptive keys (title, default) are dropped.
"""

import json
import sys

from cloudcoil.models.prometheus_operator import v1

SOURCE = "cloudcoil-models-prometheus-operator 0.80.1.0 (prometheus-operator v0.80.1 CRDs)"


def strict(node):
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: strict(value) for key, value in node.items() if key not in ("title", "default")}
    for key in ("anyOf", "oneOf"):
        if key in node:
            options = [option for option in node[key] if option != {"type": "null"}]
            if len(options) == 1:
                rest = {k: v for k, v in node.items() if k != key}
                node = {**options[0], **rest}
            else:
                node[key] = options
    if "properties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


def main() -> None:
    schema = strict(v1.ServiceMonitor.model_json_schema(by_alias=True))
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": f"ServiceMonitor monitoring.coreos.com/v1, from {SOURCE}; made strict by make_servicemonitor_schema.py. Apache-2.0.",
        **schema,
    }
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    json.dump(schema, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
