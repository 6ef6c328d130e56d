"""Spec keys given in Kubernetes form (affinity, env, envFrom, tolerations, a NetworkPolicy's selectors), checked
against the kubernetes client's models: the API's own key names and value types, at every depth, and the API's
rules for some of its objects (ctl.api_rules: a toleration's operator, a variable's one source...). The API server
finds a mistyped key or a wrong type only when `ctl submit` applies the job, and names the object's path, not the
spec's key (`500 Internal Server Error: failed to create typed patch object ...:
.spec.pytorchReplicaSpecs.Master.template.spec.affinity.nodAffinity: field not declared in schema`); `ctl render`
and `ctl run` never see it.

The client is imported only when such a key is given: it takes about 0.4 s, and `ctl render` does not otherwise
need it. values.schema.json names each object's own keys (its first level: those are the same in every client
version ctl allows, where deeper ones grow).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, GetJsonSchemaHandler

from ctl.api_rules import RULES
from trainer.spec import KeyProblem, did_you_mean, not_text

LIST_OF = re.compile(r"list\[(.+)\]$")
MAP_OF = re.compile(r"dict\(str, (.+)\)$")
# The client's names of plain types, and what YAML gives for each. A date-time arrives as text.
SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "datetime": (str,),
    "date": (str,),
}
SCALAR_NAMES = {"str": "text", "int": "an integer", "float": "a number", "bool": "true or false"}
Path = tuple[str | int, ...]  # where a value is: keys and list indices


def model(name: str) -> Any:
    import kubernetes.client  # about 0.4 s: only for a spec that gives such a key

    return getattr(kubernetes.client, name)


class NotText(KeyProblem):
    """A number or a boolean where the API takes text; `path` is its key's parts (a label key keeps its dots), for
    `--set`, which then keeps the text as typed (ctl.spec.keep_text)."""

    def __init__(self, path: Path, value: float) -> None:
        super().__init__(dotted(path), not_text(value))
        self.path = path


def dotted(path: Path) -> str:
    return ".".join(map(str, path))


def check(value: Any, kind: str, path: Path = ()) -> None:
    """Raise KeyProblem for the first key of `value` that the client's type `kind` (`V1Affinity`, `list[str]`,
    `dict(str, str)`, `int`...) does not have, or whose value is not of its type. `path` is where `value` is."""
    if inner := LIST_OF.match(kind):
        if not isinstance(value, list):
            raise KeyProblem(dotted(path), f"expected a list, got {value!r}")
        for index, item in enumerate(value):
            check(item, inner[1], (*path, index))
    elif inner := MAP_OF.match(kind):
        if not isinstance(value, dict):
            raise KeyProblem(dotted(path), f"expected a mapping, got {value!r}")
        for name, item in value.items():
            check(item, inner[1], (*path, name))
    elif kind == "str" and isinstance(value, int | float):  # bool too
        raise NotText(path, value)
    elif kind in SCALARS:
        if not isinstance(value, SCALARS[kind]) or (isinstance(value, bool) and kind != "bool"):
            raise KeyProblem(dotted(path), f"expected {SCALAR_NAMES.get(kind, 'text')}, got {value!r}")
    elif kind != "object":  # `object`: any value (an int-or-string, a quantity)
        check_object(value, model(kind), path)


def check_object(value: Any, cls: Any, path: Path) -> None:
    if not isinstance(value, dict):
        raise KeyProblem(dotted(path), f"expected a mapping, got {value!r}")
    types = {cls.attribute_map[attr]: kind for attr, kind in cls.openapi_types.items()}
    for name, item in value.items():
        if name not in types:
            raise KeyProblem(dotted((*path, name)), "unknown key" + did_you_mean(str(name), list(types)))
        if item is not None:
            check(item, types[name], (*path, name))
    # The API's rules for such an object (its inner objects were checked above: the innermost problem comes first).
    for where, problem in RULES[cls.__name__](value) if cls.__name__ in RULES else ():
        raise KeyProblem(dotted((*path, *where)), problem)


@dataclass(frozen=True)
class FirstLevel:
    """values.schema.json's form of the client's type `kind`: a mapping of its own keys only (a list of them with
    `many`). Made when the schema is generated, so that importing the spec does not import the client."""

    kind: str
    many: bool = False

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        keys = model(self.kind).attribute_map.values()
        mapping = {"type": "object", "properties": {key: {} for key in keys}, "additionalProperties": False}
        return {"type": "array", "items": mapping} if self.many else mapping


def kubernetes_object(kind: str) -> Any:
    """A mapping in the form of the client's type `kind` (`V1Affinity`), as a spec field's type."""

    def checked(value: dict[str, Any]) -> dict[str, Any]:
        check(value, kind)
        return value

    return Annotated[dict[str, Any], AfterValidator(checked), FirstLevel(kind)]


def kubernetes_list(kind: str) -> Any:
    """A list of mappings in the form of the client's type `kind` (`V1Toleration`), as a spec field's type."""

    def checked(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        check(entries, f"list[{kind}]")
        return entries

    return Annotated[list[dict[str, Any]], AfterValidator(checked), FirstLevel(kind, many=True)]
