"""Generate the chart's values.yaml and values.schema.json, and the spec reference docs/spec.md, from the job
spec model; and the names the chart's templates share with Python code (templates/_names.tpl).

The spec model (ctl/spec.py + trainer/spec.py) is the one source of truth: `helm install -f spec.yaml`
must see the same defaults and the same rules as `ctl`, and the reference says what both accept. The files
are generated and a test fails when the committed copies drift:

    python -m ctl.schema          # rewrite helm/ddpjob/values.yaml, values.schema.json, _names.tpl and docs/spec.md
    python -m ctl.schema --check  # exit 1 when any is stale
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo

from ctl import names
from ctl.kinds import KINDS
from ctl.spec import JobSpec
from trainer.location import (
    S3_ACCESS_KEY_ENV,
    S3_CA_BUNDLE_ENV,
    S3_ENDPOINT_ENV,
    S3_REGION_ENV,
    S3_SCHEME,
    S3_SECRET_KEY_ENV,
)
from trainer.names import (
    JOB_NAME_ENV,
    METRICS_DIR_ENV,
    METRICS_PORT_ENV,
    PREPARED_BY_JOB_ENV,
    RENDERED_BY_ENV,
    SHUTDOWN_TIMEOUT_ENV,
)
from trainer.spec import INT_MAX, INT_MIN, PATTERN_MEANINGS, SOURCE_LISTS

REPO = Path(__file__).resolve().parent.parent
CHART_DIR = REPO / "helm" / "ddpjob"
SPEC_REFERENCE = REPO / "docs" / "spec.md"

VALUES_HEADER = """\
# Default values of the ddpjob chart: a ddpjob job spec (every key: docs/spec.md).
# Generated from the spec model (ctl/spec.py, trainer/spec.py) by `python -m ctl.schema`; do not edit.
# A values file is a whole job spec: `helm install NAME helm/ddpjob -f examples/quickstart.yaml`
# and `ctl render examples/quickstart.yaml` produce the same objects.
"""


# Path lists the trainer also accepts as a single string (DataSpec's "before" validator, which JSON Schema
# generation cannot see): `train: data.txt` must pass `helm install` as it passes ctl.
SINGLE_OR_LIST = {"DataSpec": SOURCE_LISTS}


def _accept_single_strings(schema: dict[str, Any]) -> None:
    for model, keys in SINGLE_OR_LIST.items():
        properties = schema.get("$defs", {}).get(model, {}).get("properties", {})
        for key in keys:
            prop = properties.get(key)
            if prop and prop.get("type") == "array" and prop.get("items", {}).get("type") == "string":
                meta = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
                properties[key] = {"anyOf": [prop["items"], prop], **meta}  # the single string, checked as an item


def values_schema() -> dict[str, Any]:
    """JSON Schema of the chart's values: the job spec model by alias (camelCase)."""
    schema = JobSpec.model_json_schema(by_alias=True, mode="validation")
    _accept_single_strings(schema)
    _integers_within_int32(schema)
    return {"title": "ddpjob job spec (the ddpjob chart's values)", **{k: v for k, v in schema.items() if k != "title"}}


def _integers_within_int32(node: Any) -> None:
    """Every integer's range, where its field gives none of its own: the int32 that SpecModel checks."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.setdefault("minimum", INT_MIN)
            node.setdefault("maximum", INT_MAX)
        for value in node.values():
            _integers_within_int32(value)
    elif isinstance(node, list):
        for value in node:
            _integers_within_int32(value)


def _scalar(value: Any) -> str:
    """A JSON-compatible value as one line of flow YAML that Go's and Python's YAML parsers read alike."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_scalar(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, float) and math.isfinite(value):
        text = repr(value)
        # PyYAML (YAML 1.1) reads "1e-08" as a string; "1.0e-08" is a float everywhere.
        if "e" in text and "." not in text.split("e")[0]:
            mantissa, exponent = text.split("e")
            text = f"{mantissa}.0e{exponent}"
        return text
    return json.dumps(value)


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}".rstrip() for line in text.strip().splitlines()]


def _default(field: FieldInfo) -> Any:
    """A field's default as JSON-compatible values, default factories called."""
    default = field.get_default(call_default_factory=True, validated_data={})
    return TypeAdapter(field.annotation).dump_python(default, mode="json", by_alias=True)


def _defaults(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every key's default by dotted path (camelCase); required keys are absent."""
    found: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found |= _defaults(field.annotation, path + ".")
        elif not field.is_required():
            found[path] = _default(field)
    return found


def _model_lines(model: type[BaseModel], depth: int) -> list[str]:
    """One documented line per key: sub-models recurse, required keys stay commented out."""
    indent = "  " * depth
    lines: list[str] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        annotation = field.annotation
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        description = field.description or (annotation.__doc__ if is_model else "") or ""
        if depth == 0 and lines:
            lines.append("")
        if is_model:
            lines += _comment(description, indent)
            inner = _model_lines(annotation, depth + 1)
            has_values = any(not line.lstrip().startswith("#") for line in inner)
            lines += [f"{indent}{key}:" if has_values else f"{indent}{key}: {{}}", *inner]
        elif field.is_required():
            lines += _comment(f"{description} Required: no default.", indent)
            lines.append(f"{indent}# {key}:")
        else:
            dumped = _default(field)
            if dumped is None:
                # Helm versions disagree on whether a null default survives the merge; unset is unset.
                lines += _comment(f"{description} Unset by default.", indent)
                lines.append(f"{indent}# {key}:")
            else:
                lines += _comment(description, indent)
                lines.append(f"{indent}{key}: {_scalar(dumped)}")
    return lines


def values_yaml() -> str:
    """The chart's values.yaml: the spec's defaults, each key with its description."""
    return VALUES_HEADER + "\n" + "\n".join(_model_lines(JobSpec, 0)) + "\n"


SPEC_HEADER = """\
# The job spec

<!-- Generated from the spec model (ctl/spec.py, trainer/spec.py) by `python -m ctl.schema`; do not edit. -->

A job spec is the Helm chart's values (`helm/ddpjob/values.yaml` holds the same keys with their defaults):
camelCase keys, and unknown keys are errors. `ctl run|prepare|render|submit SPEC` reads it (`-`: standard input,
as `kubectl apply -f -`), then, in helm's order:

- `--values FILE` (repeatable, in order), files of keys layered over the spec as helm's `-f` files: mappings merged
  key by key, lists and values replaced, `null` back to the default (the key is checked all the same: a mistyped
  one is an error, not a no-op). A cluster's settings (image registry, storage
  class, node selector) can so live apart from each job's spec.
- `--set dotted.key=value`, one key per flag, the value read as YAML (numbers, booleans, lists, and helm's `{a,b}`
  list; `null` back to the default). A key that takes text gets the text as typed (`--set image.tag=1.10`, no need
  for helm's `--set-string`); a value's commas are its own; `\\.` is a dot within a key
  (`nodeSelector.kubernetes\\.io/arch=amd64`).
- `--set-file dotted.key=path`, a key set to a file's text (`--set-file storage.caBundle=ca.crt`).

Numbers and booleans are YAML's own, read as Helm reads them: `lr: 3e-4` is a number, while a quoted `"0.002"` or
`"true"`, or `false` for a number, is refused, as values.schema.json refuses it.

A key that another one makes moot is refused, not ignored: `nLayer`, `nHead` or `nEmbd` with `model.size` or
`model.pretrained` (whose config sets them), `data.valFraction` with `data.val`, `data.labelField` outside
classification (or equal to `textField`). A path is written whole: one that starts with `~` is refused, since a spec
is read in pods too, which have no home of yours (`ctl`'s own path flags, `--run-dir=~/runs`, expand it as a shell
does). values.schema.json cannot say these; with `helm install` the trainer refuses them when it starts.

A bad spec gets one line naming the key and the problem, and exit code 2; `helm install` refuses the same
(values.schema.json). The line begins with where the key was given: its `--set` or `--set-file` flag, else the file
and line that wrote it (the last of the spec and its `--values` files that does; for a missing key, its mapping's):

```
$ ctl run examples/quickstart.yaml --set training.batchSize=0
error: --set 'training.batchSize=0': training.batchSize: Input should be greater than or equal to 1
$ ctl run examples/quickstart.yaml --values cluster.yaml
error: cluster.yaml:4: nodes: Input should be greater than or equal to 1
```

Keys in Kubernetes form (`affinity`, `env`, `envFrom`, `tolerations`, the NetworkPolicy's selectors) are checked at
every depth against the Kubernetes API's own keys and types, as the installed `kubernetes` client knows them
(`affinity.nodeAffinity...nodeSelectorTerms.0.matchExpresions: unknown key (did you mean matchExpressions?)`), by
`ctl render` and `ctl run` too: the API server would refuse such a key only at submit, naming the object's path.
So are the API's rules for a toleration (its operator, value and effect), a variable's one source, an `envFrom`'s
one reference, the names and keys they refer to, and a selector's operators, keys and values
(`tolerations.0.operator: 'Equals' is not Equal or Exists`): the API server checks those only in the pods.
values.schema.json checks their first level. The names and labels the pods carry (`storage.existingClaim`,
`podLabels`, `nodeSelector`, `podAnnotations`' keys, the queues) are checked as the API server checks such names
and labels: it checks a PyTorchJob's pod template only when the operator creates the pods, which then never start.

`training:` is the trainer's whole input (mounted into the pods as training.yaml); everything else
describes the Kubernetes objects around it. Secrets are never spec values: name them by reference
(`env` with `valueFrom.secretKeyRef`, `envFrom`).
"""
TYPES = f"""\
An integer is YAML's own (`2`, not `"2"` or `true`), from {INT_MIN} to {INT_MAX} (Kubernetes' int32) unless its
row says less; a boolean is `true` or `false` (YAML's `yes` and `no` too), not quoted.
"""

CONSTRAINTS = (
    ("minimum", "≥ {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "≤ {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "at least {} characters"),
    ("maxLength", "at most {} characters"),
    ("minItems", "at least {} items"),
    ("maxItems", "at most {} items"),
    ("pattern", "matching `{}`"),
)


INT_RANGE = {("minimum", INT_MIN), ("maximum", INT_MAX)}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A property's own schema: a $ref (plain, or pydantic's allOf wrapper) replaced by its definition."""
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node["allOf"][0], **{k: v for k, v in node.items() if k != "allOf"}}
    if "$ref" in node:
        return {**defs[node["$ref"].rsplit("/", 1)[1]], **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _type(node: dict[str, Any], defs: dict[str, Any]) -> str:
    """A property's type in words: `integer ≥ 1`, `a | b`, `list of string`, `string or null`."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        return " or ".join(_type(option, defs) for option in node["anyOf"])
    if "enum" in node:
        return " | ".join(f"`{value}`" for value in node["enum"])
    if "const" in node:
        return f"`{node['const']}`"
    kind = node.get("type", "any")
    if kind == "array":
        # A tuple of one type (training.optimizer.betas) is a list of it.
        prefix = node.get("prefixItems") or [{}]
        items = node.get("items", prefix[0] if all(item == prefix[0] for item in prefix) else {})
        text = f"list of {_type(items, defs)}"
    elif kind == "object" and "properties" not in node:
        values = node.get("additionalProperties")
        text = f"map of {_type(values, defs)}" if isinstance(values, dict) and values else "object"
        if "propertyNames" in node:  # keys of a form of their own (ctl.spec's Labels)
            text = f"map from {_type({'type': 'string', **node['propertyNames']}, defs)} to {_type(values, defs)}"
    else:
        text = kind
    # Every integer's int32 range is said once, above the tables: a row shows its own bounds.
    shown = {key: node[key] for key, _ in CONSTRAINTS if key in node and (key, node[key]) not in INT_RANGE}
    exactly = "minItems" in shown and shown["minItems"] == shown.get("maxItems")
    if exactly:
        items = f"exactly {shown.pop('minItems')} items"
        del shown["maxItems"]
    limits = [_limit(key, shown[key], template) for key, template in CONSTRAINTS if key in shown]
    limits += [items] if exactly else []
    return text + (f" ({', '.join(limits)})" if limits else "")


def _limit(key: str, value: Any, template: str) -> str:
    """A constraint in words: a pattern as what it asks for, where the spec says so."""
    if (key, value) == ("minLength", 1):
        return "not empty"
    if key == "pattern" and value in PATTERN_MEANINGS:
        return PATTERN_MEANINGS[value]
    return template.format(value)


def _reference_rows(node: dict[str, Any], defs: dict[str, Any], defaults: dict[str, Any], prefix: str) -> list[str]:
    """One table row per key, depth first: a section (sub-model) row, then its keys. A mapping in Kubernetes form
    (its keys listed, not a model of the spec's) is one key."""
    rows = []
    for key, prop in node.get("properties", {}).items():
        path = prefix + key
        resolved = _resolve(prop, defs)
        description = _cell(prop.get("description") or resolved.get("description", ""))
        if resolved is not prop and "properties" in resolved:
            required = " required " if key in node.get("required", []) else " "
            rows.append(f"| **`{path}`** | section |{required}| {description} |")
            rows += _reference_rows(resolved, defs, defaults, path + ".")
            continue
        default = f"`{json.dumps(defaults[path])}`" if path in defaults else "required"
        rows.append(f"| `{path}` | {_cell(_type(prop, defs))} | {default} | {description} |")
    return rows


def spec_reference() -> str:
    """docs/spec.md: every key of the job spec with its type, default and description."""
    schema = values_schema()
    table = ["| key | type | default | meaning |", "|---|---|---|---|"]
    rows = _reference_rows(schema, schema.get("$defs", {}), _defaults(JobSpec), "")
    return SPEC_HEADER + "\n" + TYPES + "\n" + "\n".join(table + rows) + "\n"


NAMES_HEADER = """\
{{/*
Names the templates share with Python code, each from where Python defines it (ctl/names.py, ctl/kinds,
trainer/names.py). Generated by `python -m ctl.schema`; do not edit. Read them as
`(include "ddpjob.names" . | fromJson)`: numbers come back as floats (`int` them).
*/}}
"""


def chart_names() -> dict[str, Any]:
    """The names of _names.tpl: pod names, labels, ports, env variables, limits and defaults."""
    return {
        "dnsLabelMax": names.DNS_LABEL_MAX,
        "metricsPort": names.METRICS_PORT_NAME,
        "instanceLabel": names.INSTANCE_LABEL,
        "componentLabel": names.COMPONENT_LABEL,
        "trainerComponent": names.TRAINER_COMPONENT,
        "prepareComponent": names.PREPARE_COMPONENT,
        "env": {
            "jobName": JOB_NAME_ENV,
            "metricsPort": METRICS_PORT_ENV,
            "metricsDir": METRICS_DIR_ENV,
            "shutdownTimeout": SHUTDOWN_TIMEOUT_ENV,
            "preparedByJob": PREPARED_BY_JOB_ENV,
            "renderedBy": RENDERED_BY_ENV,
            "freshRendezvousStore": names.FRESH_RDZV_STORE_ENV,
            "threads": names.THREADS_ENV,
            "podKey": names.POD_KEY_ENV,
            "s3Endpoint": S3_ENDPOINT_ENV,
            "s3Region": S3_REGION_ENV,
            "s3AccessKey": S3_ACCESS_KEY_ENV,
            "s3SecretKey": S3_SECRET_KEY_ENV,
            "s3CaBundle": S3_CA_BUNDLE_ENV,
        },
        "prepareDeniedEnv": list(names.PREPARE_DENIED_ENV),
        "mounts": names.POD_MOUNTS,
        "compileCaches": names.COMPILE_CACHES,
        "compileCacheDir": names.COMPILE_CACHE_DIR,
        "s3Scheme": S3_SCHEME,
        "refusals": {"podNameTooLong": names.POD_NAME_TOO_LONG, "gpusBelowProcesses": names.GPUS_BELOW_PROCESSES},
        "cpuPerProcess": names.CPU_PER_PROCESS,
        "memoryMiPerProcess": names.MEMORY_MIB_PER_PROCESS,
        "kueueLabels": {
            "queue": names.KUEUE_QUEUE_LABEL,
            "priorityClass": names.KUEUE_PRIORITY_LABEL,
            "maxExecutionSeconds": names.KUEUE_MAX_EXEC_TIME_LABEL,
        },
        "kinds": {
            kind.kind: {
                "container": kind.container,
                "jobLabel": kind.job_label,
                "indexLabels": list(kind.index_labels),
                "podKeyField": kind.pod_key_field,
                "kubectlKind": kind.kind.lower(),
                # Replica type -> what its pods' names have between the job's name and the index.
                "podNames": {t: kind.pod_name_part(t) for t in kind.replica_types},
            }
            for kind in KINDS.values()
        },
    }


def names_template() -> str:
    """templates/_names.tpl: the helper `ddpjob.names`, a JSON object of chart_names()."""
    body = json.dumps(chart_names(), indent=2)
    return f'{NAMES_HEADER}{{{{- define "ddpjob.names" -}}}}\n{body}\n{{{{- end }}}}\n'


def generated_files(chart_dir: Path = CHART_DIR) -> dict[Path, str]:
    """Every generated file and its expected content."""
    return {
        chart_dir / "values.yaml": values_yaml(),
        chart_dir / "templates" / "_names.tpl": names_template(),
        chart_dir / "values.schema.json": json.dumps(values_schema(), indent=2, sort_keys=False) + "\n",
        SPEC_REFERENCE: spec_reference(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ctl.schema", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated_files().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}", file=sys.stderr)
    if args.check and stale:
        print("stale: " + ", ".join(map(str, stale)) + " (run `python -m ctl.schema`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
