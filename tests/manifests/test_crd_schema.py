"""The TrainJob CRD without an API server: every manifest parses, the schema is structural and
matches the contract (field names, required fields, defaults, immutable fields), every CEL rule
carries a message, the printer columns and scale paths name real fields, and the samples are
valid jobs. tests/e2e/test_crd.py checks the same CRD against a real kube-apiserver.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
from openapi_check import (
    MANIFESTS,
    REPO,
    crd_version,
    load_all,
    node_at,
    structural_errors,
    validate,
    walk,
    with_defaults,
)

CRD_FILE = MANIFESTS / "crd" / "trainjob.yaml"
SAMPLES = sorted((MANIFESTS / "samples").glob("*.yaml"))

# The contract (k8s.md, item 3): field -> default, or None when the field has no default.
TRAINER: dict[str, object] = {
    "image": None, "command": None, "args": [], "env": None, "numNodes": None,
    "numProcPerNode": 1, "resourcesPerNode": None, "numSteps": None, "seed": 0,
}  # fmt: skip
ELASTIC: dict[str, object] = {
    "minNodes": 1,
    "maxNodes": None,
    "globalBatchSize": None,
    "microBatchSize": None,
}
STATUS = {
    "phase", "nodes", "worldSize", "step", "lastSnapshotStep", "snapshotBytes", "epoch",
    "recoveries",
    "mttrP50Seconds", "lastMttrSeconds", "samplesPerSecond", "paramsSha256", "selector",
    "nextPodIndex", "observedGeneration", "belowMinNodesSince", "podFailures",
    "createBackoffUntil", "conditions",
}  # fmt: skip
IMMUTABLE = {
    ".spec.trainer.image", ".spec.trainer.command", ".spec.trainer.args",
    ".spec.trainer.numProcPerNode", ".spec.trainer.numSteps", ".spec.trainer.seed",
    ".spec.elasticPolicy.globalBatchSize", ".spec.elasticPolicy.microBatchSize",
}  # fmt: skip
COLUMN_TYPES = {"integer": {"integer"}, "number": {"number", "integer"}, "string": {"string"}}


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    (doc,) = load_all(CRD_FILE)
    return doc


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    root: dict[str, Any] = crd_version(crd)["schema"]["openAPIV3Schema"]
    return root


def object_files() -> list[Path]:
    """Every YAML file of Kubernetes objects: not kustomize's own files, not the chart's
    (templates are not YAML before helm renders them; test_helm_chart.py renders them)."""
    chart = MANIFESTS / "helm"
    return sorted(
        p
        for p in MANIFESTS.rglob("*.yaml")
        if p.name != "kustomization.yaml" and not p.is_relative_to(chart)
    )


@pytest.mark.parametrize("path", object_files(), ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_every_manifest_parses_into_named_objects(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{path} has no documents"
    keys = [(d["apiVersion"], d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
            for d in docs]  # fmt: skip
    assert len(keys) == len(set(keys)), f"duplicate objects in {path}: {keys}"


def test_names_group_and_version(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "trainjobs.keepstep.dev"
    assert (spec["group"], spec["scope"]) == ("keepstep.dev", "Namespaced")
    names = spec["names"]
    assert [names["kind"], names["plural"], names["singular"]] == [
        "TrainJob",
        "trainjobs",
        "trainjob",
    ]
    assert names["shortNames"] == ["kstj"]
    assert "all" in names["categories"]
    version = crd_version(crd)
    assert version["served"] is True and version["storage"] is True
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    assert structural_errors(schema) == []


def test_structural_check_catches_mistakes(schema: dict[str, Any]) -> None:
    broken = copy.deepcopy(schema)
    trainer = broken["properties"]["spec"]["properties"]["trainer"]
    del trainer["properties"]["numNodes"]["type"]
    trainer["properties"]["seed"]["default"] = -1
    trainer["required"].append("gpus")
    assert structural_errors(broken) == [
        ".spec.trainer: required gpus is not a property",
        ".spec.trainer.numNodes: no type",
        ".spec.trainer.seed: default .spec.trainer.seed: -1 < minimum 0",
    ]


def test_fields_required_and_defaults_follow_the_contract(schema: dict[str, Any]) -> None:
    spec = schema["properties"]["spec"]
    assert set(spec["properties"]) == {
        "suspend", "trainer", "elasticPolicy", "checkpoint", "failurePolicy", "podTemplate",
    }  # fmt: skip
    assert set(spec["required"]) == {"trainer", "elasticPolicy"}
    assert spec["properties"]["suspend"]["default"] is False
    cases: list[tuple[str, dict[str, object], set[str]]] = [
        ("trainer", TRAINER, {"image", "command", "numNodes", "numSteps"}),
        ("elasticPolicy", ELASTIC, {"maxNodes", "globalBatchSize", "microBatchSize"}),
    ]
    for name, fields, required in cases:
        node = spec["properties"][name]
        assert set(node["properties"]) == set(fields), name
        assert set(node["required"]) == required, name
        defaults = {k: v.get("default") for k, v in node["properties"].items()}
        assert defaults == fields, name
    checkpoint = spec["properties"]["checkpoint"]
    assert checkpoint["required"] == ["uri"]
    assert checkpoint["properties"]["everySteps"]["default"] == 0
    assert set(schema["properties"]["status"]["properties"]) == STATUS
    phases = schema["properties"]["status"]["properties"]["phase"]["enum"]
    assert phases == ["Pending", "Running", "Suspended", "Succeeded", "Failed"]
    trainer = spec["properties"]["trainer"]["properties"]
    assert trainer["command"]["minItems"] == 1
    assert (trainer["numProcPerNode"]["minimum"], trainer["numProcPerNode"]["maximum"]) == (1, 64)


def test_immutable_fields_have_transition_rules(schema: dict[str, Any]) -> None:
    immutable = {
        path
        for path, node in walk(schema)
        if any(r["rule"] == "self == oldSelf" for r in node.get("x-kubernetes-validations", []))
    }
    assert immutable == IMMUTABLE


def test_every_rule_has_a_message_the_cost_estimator_accepts(schema: dict[str, Any]) -> None:
    rules = [(p, r) for p, n in walk(schema) for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 14
    for path, rule in rules:
        message = rule.get("messageExpression", "")
        assert message or rule.get("message"), f"{path}: {rule['rule']} has no message"
        # `'..' + string(n)` is estimated as unbounded and the API server refuses the CRD;
        # one format() call is cheap (found out against kube-apiserver 1.34).
        assert "string(" not in message and message.count(".format(") == 1, (path, message)


def test_cross_field_rules_name_both_fields(schema: dict[str, Any]) -> None:
    spec = schema["properties"]["spec"]
    rules = spec["x-kubernetes-validations"]
    rules += spec["properties"]["elasticPolicy"]["x-kubernetes-validations"]
    texts = [r["rule"] for r in rules]
    assert "self.elasticPolicy.minNodes <= self.trainer.numNodes" in texts
    assert "self.trainer.numNodes <= self.elasticPolicy.maxNodes" in texts
    assert "self.globalBatchSize % self.microBatchSize == 0" in texts
    assert any("maxNodes * self.trainer.numProcPerNode" in t for t in texts)


def test_printer_columns_point_at_fields_of_their_type(
    crd: dict[str, Any], schema: dict[str, Any]
) -> None:
    columns = crd_version(crd)["additionalPrinterColumns"]
    default_view = [c["name"] for c in columns if c.get("priority", 0) == 0]
    assert default_view == ["Nodes", "Step", "Phase", "MTTR", "Age"]
    paths = {c["name"]: c["jsonPath"] for c in columns}
    assert paths["Nodes"] == ".status.nodes" and paths["MTTR"] == ".status.lastMttrSeconds"
    for column in columns:
        if column["jsonPath"] == ".metadata.creationTimestamp":
            assert column["type"] == "date"
            continue
        node = node_at(schema, column["jsonPath"])
        assert node is not None, f"{column['name']}: {column['jsonPath']} is not in the schema"
        assert node["type"] in COLUMN_TYPES[column["type"]], column


def test_scale_subresource_paths(crd: dict[str, Any], schema: dict[str, Any]) -> None:
    subresources = crd_version(crd)["subresources"]
    assert subresources["status"] == {}
    scale = subresources["scale"]
    assert scale == {
        "specReplicasPath": ".spec.trainer.numNodes",
        "statusReplicasPath": ".status.nodes",
        "labelSelectorPath": ".status.selector",
    }
    for key, kind in [("specReplicasPath", "integer"), ("statusReplicasPath", "integer"),
                      ("labelSelectorPath", "string")]:  # fmt: skip
        node = node_at(schema, scale[key])
        assert node is not None and node["type"] == kind, key


def cross_field_errors(spec: dict[str, Any]) -> list[str]:
    """The CEL rules of the CRD, restated: a sample must pass them before a server sees it."""
    t, e = spec["trainer"], spec["elasticPolicy"]
    errors = []
    if not e["minNodes"] <= t["numNodes"] <= e["maxNodes"]:
        errors.append(f"nodes {e['minNodes']} <= {t['numNodes']} <= {e['maxNodes']} fails")
    if e["globalBatchSize"] % e["microBatchSize"]:
        errors.append("globalBatchSize not divisible by microBatchSize")
    if e["globalBatchSize"] // e["microBatchSize"] < e["maxNodes"] * t["numProcPerNode"]:
        errors.append("fewer micro-batches than workers at maxNodes")
    return errors


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_are_valid_jobs(path: Path, schema: dict[str, Any]) -> None:
    (job,) = load_all(path)
    assert (job["apiVersion"], job["kind"]) == ("keepstep.dev/v1alpha1", "TrainJob")
    assert validate(schema, job) == []
    full = with_defaults(schema, job)
    assert cross_field_errors(full["spec"]) == []
    script = next(a for a in full["spec"]["trainer"]["command"] if a.endswith(".py"))
    assert (REPO / script).is_file(), f"{path.name} runs {script}, which is not in the repo"


def test_main_sample_is_three_nodes_between_two_and_four(schema: dict[str, Any]) -> None:
    (job,) = load_all(MANIFESTS / "samples" / "trainjob.yaml")
    spec = with_defaults(schema, job)["spec"]
    assert spec["trainer"]["numNodes"] == 3
    assert (spec["elasticPolicy"]["minNodes"], spec["elasticPolicy"]["maxNodes"]) == (2, 4)
    assert spec["trainer"]["command"][-1] == "examples/transformer.py"


def test_minimal_sample_gets_every_default(schema: dict[str, Any]) -> None:
    (job,) = load_all(MANIFESTS / "samples" / "mlp-minimal.yaml")
    spec = with_defaults(schema, job)["spec"]
    assert spec["suspend"] is False
    assert (spec["trainer"]["args"], spec["trainer"]["numProcPerNode"]) == ([], 1)
    assert (spec["trainer"]["seed"], spec["elasticPolicy"]["minNodes"]) == (0, 1)


def test_validation_rejects_broken_jobs(schema: dict[str, Any]) -> None:
    (job,) = load_all(MANIFESTS / "samples" / "trainjob.yaml")
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["numNodes"] = "3"
    del bad["spec"]["trainer"]["numSteps"]
    bad["spec"]["trainer"]["numProcPerNode"] = 65
    bad["spec"]["trainer"]["resourcesPerNode"]["requests"]["cpu"] = "two"
    bad["spec"]["elasticPolicy"]["gpus"] = 1
    assert validate(schema, bad) == [
        ".spec.trainer.numSteps: required",
        ".spec.trainer.numNodes: '3' is not of type integer",
        ".spec.trainer.numProcPerNode: 65 > maximum 64",
        ".spec.trainer.resourcesPerNode.requests.cpu: 'two' does not match "
        + schema["properties"]["spec"]["properties"]["trainer"]["properties"]["resourcesPerNode"][
            "properties"
        ]["requests"]["additionalProperties"]["pattern"],
        ".spec.elasticPolicy: unknown field gpus (the API server would prune it)",
    ]
    spec = with_defaults(schema, job)["spec"]
    spec["elasticPolicy"]["globalBatchSize"] = 30
    assert cross_field_errors(spec) == [
        "globalBatchSize not divisible by microBatchSize",
        "fewer micro-batches than workers at maxNodes",
    ]


def test_reserved_env_names_and_owned_keys_match_the_operator(schema: dict[str, Any]) -> None:
    """The CEL rules and the operator's own checks refuse the same names."""
    from keepstep.operator.fields import ENV_SETTINGS
    from keepstep.operator.template import OWNED_KEY_PREFIXES

    trainer = schema["properties"]["spec"]["properties"]["trainer"]["properties"]
    rules = trainer["env"]["items"]["x-kubernetes-validations"]
    (reserved,) = [r["rule"] for r in rules if "KEEPSTEP_" in r["rule"]]
    assert sorted(re.findall(r"'(KEEPSTEP_[A-Z0-9_]+)'", reserved)) == sorted(ENV_SETTINGS)
    assert "self.name.startsWith('KEEPSTEP_')" in reserved
    template = schema["properties"]["spec"]["properties"]["podTemplate"]["properties"]
    labels = template["metadata"]["properties"]["labels"]["x-kubernetes-validations"]
    for prefix in OWNED_KEY_PREFIXES:
        assert f"'{prefix}'" in labels[0]["rule"], prefix
