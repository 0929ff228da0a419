"""Load, merge and validate the workflow configuration against config/schema/.

The schema (JSON Schema draft 2020-12, one file a section) is the documentation: every key
has a description and a default. Validation fills the defaults in and reports *every* error
with the dotted key path at fault, e.g. ``deps.repos.verl.commit: '220e903' does not match
'^[0-9a-f]{40}$'``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, validators
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = REPO_ROOT / "config" / "schema"
ROOT_SCHEMA = "config.schema.yaml"


class ConfigError(ValueError):
    """A configuration value is wrong; the message names every offending key path."""


# libyaml's safe loader where PyYAML was built with it (the wheels are): the same documents,
# parsed in C (the pure-Python parser took seconds for the schema in every rule's job)
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load_yaml(path: Path) -> Any:
    try:
        with open(path) as fh:
            return yaml.load(fh, Loader=_SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


def _registry(schema_dir: Path) -> Registry:
    resources = []
    for path in sorted(schema_dir.glob("*.schema.yaml")):
        contents = _load_yaml(path)
        # Drop the per-file "$schema": jsonschema switches to the plain validator class of
        # that dialect when descending into such a resource, which would skip our defaults.
        contents.pop("$schema", None)
        resources.append((path.name, Resource(contents, specification=DRAFT202012)))
    return Registry().with_resources(resources)


_SCHEMAS: dict[tuple, tuple[Any, Registry]] = {}


def _schema(schema_dir: Path) -> tuple[Any, Registry]:
    """The root schema and the registry of every section's schema, read once a process
    while the files stay the same (name, size and mtime of each): a rule's job validates
    its config more than once. Neither is modified by validation (defaults are copied)."""
    stamp = (str(schema_dir), *((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                for p in sorted(schema_dir.glob("*.schema.yaml"))))
    if stamp not in _SCHEMAS:
        _SCHEMAS.clear()
        _SCHEMAS[stamp] = (_load_yaml(schema_dir / ROOT_SCHEMA), _registry(schema_dir))
    return _SCHEMAS[stamp]


def _with_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if name in instance:
                    continue
                default = sub.get("default")
                if default is None and "$ref" in sub:
                    resolved = validator._resolver.lookup(sub["$ref"]).contents
                    default = resolved.get("default")
                if default is not None:
                    instance[name] = copy.deepcopy(default)
        yield from validate_properties(validator, properties, instance, schema)

    return validators.extend(validator_class, {"properties": set_defaults})


_DefaultingValidator = _with_defaults(Draft202012Validator)


def key_path(parts) -> str:
    return ".".join(str(p) for p in parts) or "<config>"


def validate(config: Mapping[str, Any], schema_dir: Path = SCHEMA_DIR) -> dict[str, Any]:
    """Return a deep copy of ``config`` with defaults filled in; raise ConfigError otherwise."""
    data = copy.deepcopy(dict(config))
    schema, registry = _schema(schema_dir)
    # Fill defaults (repeat: defaults may create objects whose own defaults need filling).
    for _ in range(8):
        before = json.dumps(data, sort_keys=True, default=str)
        for _err in _DefaultingValidator(schema, registry=registry).iter_errors(data):
            pass
        if json.dumps(data, sort_keys=True, default=str) == before:
            break
    errors = sorted(
        Draft202012Validator(schema, registry=registry).iter_errors(data),
        key=lambda e: list(map(str, e.absolute_path)),
    )
    if errors:
        lines = []
        for err in errors:
            path = key_path(err.absolute_path)
            if err.validator == "additionalProperties":
                extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
                keys = ", ".join(f"{path}.{k}" if err.absolute_path else k for k in extra)
                lines.append(f"unknown key {keys} (not in the schema; check the spelling)")
            else:
                lines.append(f"{path}: {err.message}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))
    return data


PLACEHOLDER = "CHANGE_ME"


def placeholders(value: Any, path: str = "") -> list[str]:
    """Dotted key paths whose string value still holds a ``CHANGE_ME`` site placeholder."""
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in placeholders(v, f"{path}.{k}" if path
                                                                else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in placeholders(v, f"{path}[{i}]")]
    return [path] if isinstance(value, str) and PLACEHOLDER in value else []


def refuse_placeholders(config: Mapping[str, Any], resources: Any = None) -> None:
    """Stop before the DAG is built while a site value is still a placeholder: in the
    effective config, or in the profile's ``default-resources`` (partition, account), given
    as a mapping or as Snakemake's own resources object."""
    found = [f"config {p}: {_get(config, p)!r}" for p in placeholders(config)]
    found += [f"profile default-resources {k}: {v!r}" for k, v in _resource_values(resources)
              if isinstance(v, str) and PLACEHOLDER in v]
    if found:
        raise ConfigError(
            "site values still hold the CHANGE_ME placeholder; set them (a site config file "
            "after the others, or your own profile) before running:\n  " + "\n  ".join(found))


def _resource_values(resources: Any) -> list[tuple[str, Any]]:
    if resources is None:
        return []
    items = resources.items() if hasattr(resources, "items") else \
        getattr(resources, "_data", {}).items()
    # Snakemake's Resource objects keep the profile's value as `raw`.
    return [(k, getattr(v, "raw", v)) for k, v in items]


def _get(config: Mapping[str, Any], path: str) -> Any:
    value: Any = config
    for part in path.replace("[", ".").replace("]", "").split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Merge like Snakemake merges several --configfile: mappings recursively, others replace."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load(*paths: str | Path) -> dict[str, Any]:
    """Load and merge config files in order, then validate (for the CLIs and tests)."""
    merged: dict[str, Any] = {}
    for path in paths:
        loaded = _load_yaml(Path(path)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        merged = deep_merge(merged, loaded)
    return validate(merged)


def config_hash(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a (validated) config."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
