"""Kubernetes' own rules for what the pods name, label and take in Kubernetes form (apimachinery's and the core API's
validation), as ctl checks them. The API server applies them to a PyTorchJob's or TrainingRuntime's pod template only
when the operator creates the pods, which it then fails to do; a pod may name any claim, and waits for ever for one
that no claim can be. The e2e tier checks each rule against the API server (its agreement test's values).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from trainer.spec import PATTERN_MEANINGS, pattern

_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]"  # at most 63 characters
_NAME_IN_WORDS = "at most 63 letters, digits, '-', '_' and '.', a letter or digit at each end"
OBJECT_NAME = pattern(
    f"^({_SUBDOMAIN})?$",
    "a Kubernetes object name: lower-case letters, digits, '-' and '.', a letter or digit at each end",
)
LABEL_VALUE = pattern(f"^({_LABEL_NAME})?$", f"a Kubernetes label value: {_NAME_IN_WORDS}")
SUBDOMAIN_MAX = 253
LABEL_KEY = pattern(
    f"^({_SUBDOMAIN}/)?{_LABEL_NAME}$",
    f"a Kubernetes label key: an optional lower-case DNS prefix (at most {SUBDOMAIN_MAX} characters) and '/', then"
    f" {_NAME_IN_WORDS}",
)
# The API server checks an annotation's key lower-cased: its prefix may have capitals.
ANNOTATION_KEY = pattern(
    f"^({_SUBDOMAIN.replace('a-z0-9', 'a-zA-Z0-9')}/)?{_LABEL_NAME}$",
    f"a Kubernetes annotation key: an optional DNS prefix (at most {SUBDOMAIN_MAX} characters) and '/', then"
    f" {_NAME_IN_WORDS}",
)
# A key's prefix length, which the patterns above cannot bound without look-ahead (Go's and Rust's regular
# expressions have none): values.schema.json refuses a longer prefix beside the pattern, ctl in a validator.
PREFIX_TOO_LONG = rf"^[^/]{{{SUBDOMAIN_MAX + 1},}}/"
# A key of a Secret or ConfigMap (a variable's secretKeyRef.key).
DATA_KEY = pattern(r"^[-._a-zA-Z0-9]+$", "a Secret's or ConfigMap's key: letters, digits, '-', '_' and '.'")

Problems = Iterator[tuple[tuple[str | int, ...], str]]  # (where within the object, empty for all of it; what is wrong)


def mismatch(value: Any, regex: str) -> str | None:
    """`value` is not what `regex` (one of the patterns above) asks for: that in words, or None."""
    if isinstance(value, str) and re.match(regex, value):
        return None
    if value is None:  # a required key left out (`.get` of it): said as such, not as `None is not ...`
        return f"missing: {PATTERN_MEANINGS[regex]}"
    return f"{value!r} is not {PATTERN_MEANINGS[regex]}"


def prefix_problem(key: str) -> str | None:
    """A label's or annotation's key (one that matches its pattern) whose DNS prefix is too long: that, or None."""
    if re.match(PREFIX_TOO_LONG, key):  # after the key's pattern: one '/' at most
        return f"its DNS prefix has {key.index('/')} characters, at most {SUBDOMAIN_MAX}"
    return None


def label_key_problem(key: Any) -> str | None:
    if problem := mismatch(key, LABEL_KEY):
        return problem
    return f"{key!r}: {problem}" if (problem := prefix_problem(key)) else None


def object_name_problem(name: Any, what: str) -> str | None:
    """A name the object named by it must have (a Secret's, a ConfigMap's): not empty, a DNS subdomain."""
    if not name:
        return f"the {what}'s name is required"
    if len(name) > SUBDOMAIN_MAX:
        return f"{name!r} has {len(name)} characters, at most {SUBDOMAIN_MAX}"
    return mismatch(name, OBJECT_NAME)


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_LABEL_MAX = 63


def namespace_problem(name: str) -> str | None:
    """A namespace's name is a DNS-1123 label: that, or None."""
    if len(name) <= DNS_LABEL_MAX and DNS_LABEL.fullmatch(name):
        return None
    return (
        f"{name!r} is not a namespace's name: at most {DNS_LABEL_MAX} lower-case letters, digits and '-', a letter or"
        " digit at each end"
    )


def exactly_one(given: list[str], of: str) -> str | None:
    """The problem with an object that takes exactly one of its keys (`of`, in words): `given` are those set."""
    if len(given) == 1:
        return None
    return f"exactly one of {of}, not {' and '.join(given)}" if given else f"one of {of} is required"


def toleration(value: dict[str, Any]) -> Problems:
    key, operator = value.get("key") or "", value.get("operator") or "Equal"
    effect, given = value.get("effect") or "", value.get("value") or ""
    if key and (problem := label_key_problem(key)):
        yield ("key",), problem
    if operator not in ("Equal", "Exists"):
        yield ("operator",), f"{operator!r} is not Equal or Exists"
    if not key and operator != "Exists":
        yield ("operator",), "Exists where there is no key (the toleration of every taint)"
    if operator == "Exists" and given:
        yield ("value",), "none with operator Exists"
    if operator == "Equal" and (problem := mismatch(given, LABEL_VALUE)):
        yield ("value",), problem
    if effect not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
        yield ("effect",), f"{effect!r} is not NoSchedule, PreferNoSchedule or NoExecute"
    if value.get("tolerationSeconds") is not None and effect != "NoExecute":
        yield ("tolerationSeconds",), "only with effect NoExecute"


def env_var(value: dict[str, Any]) -> Problems:
    if value.get("value") and value.get("valueFrom") is not None:
        yield ("valueFrom",), "not with a value: one or the other"


def env_var_source(value: dict[str, Any]) -> Problems:
    # Every key of the type is a source (the client's version may know more than these).
    given = [key for key, item in value.items() if item is not None]
    if problem := exactly_one(given, "fieldRef, resourceFieldRef, configMapKeyRef and secretKeyRef"):
        yield (), problem


def env_from_source(value: dict[str, Any]) -> Problems:
    given = [key for key in ("configMapRef", "secretRef") if value.get(key) is not None]
    if problem := exactly_one(given, "configMapRef and secretRef"):
        yield (), problem


def env_source(what: str) -> Callable[[dict[str, Any]], Problems]:
    """An envFrom's secretRef's or configMapRef's rule: the object's name."""

    def rule(value: dict[str, Any]) -> Problems:
        if problem := object_name_problem(value.get("name"), what):
            yield ("name",), problem

    return rule


def key_selector(what: str) -> Callable[[dict[str, Any]], Problems]:
    """A secretKeyRef's or configMapKeyRef's rule: the object's name, as an envFrom's, and one of its keys."""
    named = env_source(what)

    def rule(value: dict[str, Any]) -> Problems:
        yield from named(value)
        if problem := mismatch(value.get("key"), DATA_KEY):
            yield ("key",), problem

    return rule


def requirement(
    operators_with_values: tuple[str, ...], operators_without: tuple[str, ...], labels: bool
) -> Callable[[dict[str, Any]], Problems]:
    """A node selector's or label selector's matchExpressions item: its key a label key, its operator one of these
    two kinds (values required, values forbidden), and with `labels` each value a label value."""

    def rule(value: dict[str, Any]) -> Problems:
        if problem := label_key_problem(value.get("key")):
            yield ("key",), problem
        operator, values = value.get("operator"), value.get("values") or []
        if operator in operators_with_values and not values:
            yield ("values",), f"required with operator {operator}"
        elif operator in ("Gt", "Lt") and len(values) != 1:
            yield ("values",), f"one value with operator {operator}, a number"
        elif operator in operators_without and values:
            yield ("values",), f"none with operator {operator}"
        elif operator not in operators_with_values + operators_without:
            yield ("operator",), f"{operator!r} is not {', '.join(operators_with_values + operators_without)}"
        for index, item in enumerate(values if labels else ()):
            if problem := mismatch(item, LABEL_VALUE):
                yield ("values", index), problem

    return rule


def label_selector(value: dict[str, Any]) -> Problems:
    for key, item in (value.get("matchLabels") or {}).items():
        if problem := label_key_problem(key) or mismatch(item, LABEL_VALUE):
            yield ("matchLabels", key), problem


# By the kubernetes client's type name: what each object of that type must be, beyond its keys and their types.
RULES: dict[str, Callable[[dict[str, Any]], Problems]] = {
    "V1Toleration": toleration,
    "V1EnvVar": env_var,
    "V1EnvVarSource": env_var_source,
    "V1EnvFromSource": env_from_source,
    "V1SecretKeySelector": key_selector("Secret"),
    "V1ConfigMapKeySelector": key_selector("ConfigMap"),
    "V1SecretEnvSource": env_source("Secret"),
    "V1ConfigMapEnvSource": env_source("ConfigMap"),
    # Gt and Lt: one value, a number, which the scheduler reads (not the API server).
    "V1NodeSelectorRequirement": requirement(("In", "NotIn", "Gt", "Lt"), ("Exists", "DoesNotExist"), labels=False),
    "V1LabelSelectorRequirement": requirement(("In", "NotIn"), ("Exists", "DoesNotExist"), labels=True),
    "V1LabelSelector": label_selector,
}
