"""Validate the jobs ``lightning-plugins launch`` writes against the schemas their tools ship (issue 46).

    python .ci/launcher_schemas.py JOB.yaml ...

* A SkyPilot task (``num_nodes``/``run`` at the top) against SkyPilot's own task schema (``sky.utils.schemas``,
  JSON Schema, with ``additionalProperties: false``: a misspelt key fails), as ``sky launch`` checks it.
* A ``PyTorchJob`` against the Kubeflow training operator's SDK models (``kubeflow-training``: generated from the
  CRD's OpenAPI schema, with the Kubernetes client's pod models): deserialized with required fields enforced, then
  serialized back, which must give the manifest again (a key the schema does not know is dropped, so it fails).

Run it in a virtualenv with ``skypilot``, ``kubeflow-training``, ``jsonschema`` and ``pyyaml`` (``.ci/wheel`` makes
one: skypilot pins click below what huggingface_hub needs, so they cannot share the package's environment).
``tests/run/test_launchers.py`` runs it too where ``LP_SCHEMA_PYTHON`` names such an interpreter.
"""

from __future__ import annotations

import json
import sys

import jsonschema
import yaml


def _quantities_as_text(node):
    """Kubernetes quantities (``nvidia.com/gpu: 8``) come back from the client's models as strings."""
    if isinstance(node, dict):
        return {k: _quantities_as_text(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_quantities_as_text(v) for v in node]
    return str(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else node


def check_skypilot(task: dict) -> None:
    from sky.utils import schemas

    jsonschema.validate(task, schemas.get_task_schema())


def check_pytorchjob(manifest: dict) -> None:
    from kubeflow.training.api_client import ApiClient

    assert (manifest["apiVersion"], manifest["kind"]) == ("kubeflow.org/v1", "PyTorchJob"), manifest["kind"]
    client = ApiClient()

    class Response:
        data = json.dumps(manifest)

    job = client.deserialize(Response(), "KubeflowOrgV1PyTorchJob")
    back = client.sanitize_for_serialization(job)
    if _quantities_as_text(back) != _quantities_as_text(manifest):
        raise ValueError(f"the PyTorchJob does not survive the operator's models:\n{json.dumps(back, indent=1)}")


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as handle:
            data = yaml.safe_load(handle)
        if data.get("kind") == "PyTorchJob":
            check_pytorchjob(data)
            print(f"{path}: a valid PyTorchJob (kubeflow-training models)")
        else:
            check_skypilot(data)
            print(f"{path}: a valid SkyPilot task (sky.utils.schemas task schema)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
