"""A small reading of Kubernetes' structural-schema rules and OpenAPI validation, for unit tests.

The API server is the real judge (tests/e2e/test_crd.py applies the CRD to one); these
functions catch the common mistakes without it: a node without a type, properties next to
additionalProperties, a required field that is not declared, a default or a sample that
breaks its own schema, a printer column that points at nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment

Schema = Mapping[str, Any]

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"

# Keywords a structural schema may not use at all (apiextensions "structural" rules).
FORBIDDEN = frozenset({"$ref", "definitions", "dependencies", "id", "patternProperties"})
# Inside anyOf/allOf/oneOf/not only validation may appear, never the shape of the value.
SHAPE_KEYS = frozenset({"type", "default", "description", "nullable", "additionalProperties"})
TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean"})


def load_all(path: Path) -> list[dict[str, Any]]:
    """Every non-empty document of a YAML file."""
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def crd_version(crd: Mapping[str, Any], name: str = "v1alpha1") -> dict[str, Any]:
    versions: list[dict[str, Any]] = [v for v in crd["spec"]["versions"] if v["name"] == name]
    assert len(versions) == 1, f"version {name} appears {len(versions)} times"
    return versions[0]


def walk(schema: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    """Every schema node with a readable path: .spec.trainer.command[*], .x{*} for maps."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), Mapping):
        yield from walk(schema["items"], f"{path}[*]")
    if isinstance(schema.get("additionalProperties"), Mapping):
        yield from walk(schema["additionalProperties"], f"{path}{{*}}")


def structural_errors(root: Schema) -> list[str]:
    """Violations of the structural-schema rules this project can break."""
    errors: list[str] = []
    for path, node in walk(root):
        where = path or "<root>"
        errors += [f"{where}: forbidden keyword {k}" for k in FORBIDDEN & node.keys()]
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        if "type" not in node and not int_or_string:
            errors.append(f"{where}: no type")
        elif "type" in node and node["type"] not in TYPES:
            errors.append(f"{where}: unknown type {node['type']!r}")
        if node.get("x-kubernetes-preserve-unknown-fields") and node.get("type") != "object":
            errors.append(f"{where}: preserve-unknown-fields needs type object")
        if "properties" in node and "additionalProperties" in node:
            errors.append(f"{where}: properties and additionalProperties together")
        missing = set(node.get("required", [])) - set(node.get("properties", {}))
        errors += [f"{where}: required {m} is not a property" for m in sorted(missing)]
        for combinator in ("anyOf", "allOf", "oneOf", "not"):
            branches = node.get(combinator, [])
            for branch in [branches] if isinstance(branches, Mapping) else branches:
                shape = SHAPE_KEYS & branch.keys()
                allowed = {"type"} if int_or_string and combinator == "anyOf" else set()
                errors += [f"{where}.{combinator}: {k} not allowed" for k in shape - allowed]
        if node.get("x-kubernetes-list-type") == "map":
            item = node.get("items", {})
            for key in node.get("x-kubernetes-list-map-keys", []):
                prop = item.get("properties", {}).get(key)
                if prop is None:
                    errors.append(f"{where}: list-map key {key} is not a property")
                elif key not in item.get("required", []) and "default" not in prop:
                    errors.append(f"{where}: list-map key {key} is neither required nor defaulted")
        if "default" in node:
            errors += [f"{where}: default {e}" for e in validate(node, node["default"], where)]
    return errors


def validate(schema: Schema, value: Any, path: str = "") -> list[str]:
    """OpenAPI v3 checks of one value (the subset the TrainJob schema uses)."""
    where = path or "<root>"
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            return [f"{where}: {value!r} is neither an integer nor a string"]
        if isinstance(value, str) and "pattern" in schema:
            if not re.search(schema["pattern"], value):
                return [f"{where}: {value!r} does not match {schema['pattern']}"]
        return []
    kind = schema.get("type")
    expected: dict[str, type | tuple[type, ...]] = {
        "object": dict,
        "array": list,
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
    }
    if kind in expected:
        # bool is an int in Python, never in OpenAPI.
        if not isinstance(value, expected[kind]) or isinstance(value, bool) != (kind == "boolean"):
            return [f"{where}: {value!r} is not of type {kind}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{where}: {value!r} < minimum {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{where}: {value!r} > maximum {schema['maximum']}")
    if kind == "string":
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{where}: {value!r} shorter than {schema['minLength']}")
        if len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{where}: {value!r} longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if kind == "array":
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{where}: {len(value)} items, fewer than {schema['minItems']}")
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{where}: {len(value)} items, more than {schema['maxItems']}")
        for i, item in enumerate(value):
            errors += validate(schema.get("items", {}), item, f"{where}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        errors += [f"{where}.{r}: required" for r in schema.get("required", []) if r not in value]
        for name, item in value.items():
            if name in props:
                errors += validate(props[name], item, f"{path}.{name}")
            elif isinstance(schema.get("additionalProperties"), Mapping):
                errors += validate(schema["additionalProperties"], item, f"{path}.{name}")
            elif props and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{where}: unknown field {name} (the API server would prune it)")
    return errors


def with_defaults(schema: Schema, value: Any) -> Any:
    """The value with every absent defaulted field filled in, as the API server does."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out = {k: with_defaults(props.get(k, {}), v) for k, v in value.items()}
        for name, prop in props.items():
            if name not in out and "default" in prop:
                out[name] = with_defaults(prop, prop["default"])
        return out
    if isinstance(value, list):
        return [with_defaults(schema.get("items", {}), v) for v in value]
    return value


def node_at(root: Schema, json_path: str) -> Schema | None:
    """The schema node a simple JSONPath (.a.b.c) names, or None."""
    node: Schema | None = root
    for part in json_path.strip(".").split("."):
        node = (node or {}).get("properties", {}).get(part)
    return node
