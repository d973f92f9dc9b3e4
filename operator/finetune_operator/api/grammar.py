"""The grammars of the places where the spec's strings end up, written once.

Every string of a FinetuneJob that lands in a Kubernetes object (a pod's image, a ServiceAccount or
Secret name, a nodeSelector label, a resource quantity) is checked at admission against the rule that
the API server, KubeRay, the kubelet or the container runtime would apply to it later, when the job can
no longer be fixed by editing the spec. Each `Grammar` below is used twice from this one definition:

- by the pydantic models (`finetune validate`, `finetune run`, the operator): `Grammar.check`;
- by the CRD schema (server-side, at `kubectl apply`): `maxLength` plus a CEL rule with the same message.

The regular expressions are written for both engines: Go's RE2 (CEL `matches`, the API server) and
pydantic's Rust `regex` / Python's `re`. So: no look-around, no back-references, no `\\d`/`\\w` (they
are Unicode-aware in Rust and Python, ASCII in RE2): explicit ASCII classes only, always anchored.

Sources (upstream, read for these definitions):
- kubernetes/apimachinery pkg/util/validation/validation.go and pkg/api/validate/content/{dns,kube}.go:
  IsDNS1123Label, IsDNS1123Subdomain, IsDNS1035Label, IsQualifiedName (label/annotation keys),
  IsValidLabelValue, IsEnvVarName, IsConfigMapKey.
- kubernetes/apimachinery pkg/api/resource/quantity.go: the quantity grammar (ParseQuantity).
- distribution/reference reference.go, regexp.go, normalize.go: the image reference grammar the kubelet
  and containerd parse with (ParseNormalizedNamed), and opencontainers/go-digest for the digests the
  runtimes register (sha256, sha384, sha512; lowercase hex of the algorithm's length).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator, Field
from pydantic.json_schema import WithJsonSchema

from . import quantity

# ------------------------------------------------------------------------------ apimachinery fragments

DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"  # dns1123LabelFmt
DNS1123_SUBDOMAIN_FMT = DNS1123_LABEL_FMT + r"(\." + DNS1123_LABEL_FMT + ")*"  # dns1123SubdomainFmt
DNS1035_LABEL_FMT = "[a-z]([-a-z0-9]*[a-z0-9])?"  # dns1035LabelFmt
QUALIFIED_NAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"  # labelKeyFmt (qualifiedNameFmt)
ENV_VAR_NAME_FMT = "[-._a-zA-Z][-._a-zA-Z0-9]*"  # envVarNameFmt
CONFIG_MAP_KEY_FMT = "[-._a-zA-Z0-9]+"  # configMapKeyFmt

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63
QUALIFIED_NAME_MAX = 63  # the name part of a label key; its prefix is a DNS-1123 subdomain

# Non-negative (requests, limits and emptyDir sizes may not be negative: ValidateNonnegativeQuantity).
# Exponents of at most three digits: Kubernetes caps any quantity at 2^63-1 (QUANTITY's extra rule refuses
# those), and a long exponent only makes exact arithmetic (api/quantity.py) slow.
QUANTITY_FMT = r"[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][-+]?[0-9]{1,3})?"

# ------------------------------------------------------------------------------ distribution/reference

_ALNUM = "[a-z0-9]+"
_SEPARATOR = "([._]|__|[-]+)"
_PATH_COMPONENT = f"{_ALNUM}({_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = "([a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_NAME = _DOMAIN_COMPONENT + r"(\." + _DOMAIN_COMPONENT + ")*"
_IPV6 = r"\[[a-fA-F0-9:]+\]"
_DOMAIN = f"({_DOMAIN_NAME}|{_IPV6})(:[0-9]+)?"
IMAGE_NAME_FMT = f"({_DOMAIN}/)?{_PATH_COMPONENT}(/{_PATH_COMPONENT})*"
IMAGE_TAG_FMT = "[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
IMAGE_DIGEST_FMT = "(sha256:[a-f0-9]{64}|sha384:[a-f0-9]{96}|sha512:[a-f0-9]{128})"
IMAGE_NAME_MAX = 255  # NameTotalLengthMax (older releases count the registry in; so do we)
IMAGE_MAX = 512


def anchored(fmt: str) -> str:
    return f"^{fmt}$"


def _quote(value: str) -> str:
    return repr(value) if len(value) <= 80 else repr(value[:77] + "...")


# ------------------------------------------------------------------------------ the rules


@dataclass(frozen=True)
class Grammar:
    """One rule: a regular expression, a length limit, extra checks, and the words for a user."""

    name: str  # what it is, in words, for docs/api.md
    rule: str  # the rule, in words: it is the error message (Python and CEL alike)
    pattern: str  # anchored; RE2-compatible
    max_length: int
    source: str  # where Kubernetes (or the runtime) defines it
    # Further rules that a regular expression cannot say: (CEL over `self`, Python predicate, message).
    extra: tuple[tuple[str, Callable[[str], bool], str], ...] = field(default=())

    def check(self, value: str) -> str | None:
        """None if `value` is valid, else the message: the rule and the value."""
        if len(value) > self.max_length:
            return f"{self.rule}; at most {self.max_length} characters, got {len(value)}"
        if not re.fullmatch(self.pattern[1:-1], value):
            return f"{self.rule}; got {_quote(value)}"
        for _, ok, message in self.extra:
            if not ok(value):
                return f"{message}; got {_quote(value)}"
        return None

    def cel(self, subject: str = "self") -> str:
        """A CEL expression that is true where `check` accepts (lengths are the schema's maxLength)."""
        parts = [f"{subject}.matches(r'{self.pattern}')"]
        parts += [rule.replace("self", subject) for rule, _, _ in self.extra]
        return " && ".join(f"({p})" if len(parts) > 1 else p for p in parts)

    def validations(self) -> list[dict[str, Any]]:
        """`x-kubernetes-validations` for a string field of this grammar."""
        out = [{"rule": f"self.matches(r'{self.pattern}')", "message": self.rule}]
        out += [{"rule": rule, "message": message} for rule, _, message in self.extra]
        return out

    def schema(self) -> dict[str, Any]:
        """The CRD schema of a string field of this grammar."""
        return {"type": "string", "maxLength": self.max_length, "x-kubernetes-validations": self.validations()}

    def validate(self, value: str) -> str:
        """A pydantic AfterValidator."""
        message = self.check(value)
        if message is not None:
            raise ValueError(message)
        return value


APIMACHINERY = "kubernetes/apimachinery pkg/util/validation"

DNS1123_SUBDOMAIN = Grammar(
    name="DNS-1123 subdomain",
    rule=("must be a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', starting and ending with a "
          "letter or digit, at most 253 characters)"),
    pattern=anchored(DNS1123_SUBDOMAIN_FMT),
    max_length=DNS1123_SUBDOMAIN_MAX,
    source=f"{APIMACHINERY} IsDNS1123Subdomain",
)

DNS1123_LABEL = Grammar(
    name="DNS-1123 label",
    rule=("must be a DNS-1123 label (lowercase letters, digits and '-', starting and ending with a letter or "
          "digit, at most 63 characters)"),
    pattern=anchored(DNS1123_LABEL_FMT),
    max_length=DNS1123_LABEL_MAX,
    source=f"{APIMACHINERY} IsDNS1123Label",
)

LABEL_VALUE = Grammar(
    name="label value",
    rule=("must be a label value (empty, or letters, digits, '-', '_' and '.', starting and ending with a letter "
          "or digit, at most 63 characters)"),
    pattern=anchored(f"({QUALIFIED_NAME_FMT})?"),
    max_length=LABEL_VALUE_MAX,
    source=f"{APIMACHINERY} IsValidLabelValue",
)


def _prefix_fits(key: str) -> bool:
    return "/" not in key or len(key.split("/")[0]) <= DNS1123_SUBDOMAIN_MAX


def _name_fits(key: str) -> bool:
    return len(key.split("/")[-1]) <= QUALIFIED_NAME_MAX


LABEL_KEY = Grammar(
    name="label key (qualified name)",
    rule=("must be a label key: an optional DNS-1123 subdomain prefix (at most 253 characters) and '/', then a "
          "name of letters, digits, '-', '_' and '.' starting and ending with a letter or digit (at most 63)"),
    pattern=anchored(f"({DNS1123_SUBDOMAIN_FMT}/)?{QUALIFIED_NAME_FMT}"),
    max_length=DNS1123_SUBDOMAIN_MAX + 1 + QUALIFIED_NAME_MAX,
    source=f"{APIMACHINERY} IsQualifiedName",
    extra=(
        ("!self.contains('/') || self.split('/')[0].size() <= 253",
         _prefix_fits, "the prefix of a label key (before '/') is at most 253 characters"),
        ("self.split('/')[self.split('/').size() - 1].size() <= 63",
         _name_fits, "the name of a label key (after '/') is at most 63 characters"),
    ),
)

ENV_VAR_NAME = Grammar(
    name="environment variable name",
    rule=("must be an environment variable name (letters, digits, '_', '-' and '.', not starting with a digit)"),
    pattern=anchored(ENV_VAR_NAME_FMT),
    max_length=DNS1123_SUBDOMAIN_MAX,
    source=f"{APIMACHINERY} IsEnvVarName",
)

CONFIG_MAP_KEY = Grammar(
    name="ConfigMap/Secret key",
    rule="must be a Secret/ConfigMap key (letters, digits, '-', '_' and '.', at most 253 characters)",
    pattern=anchored(CONFIG_MAP_KEY_FMT),
    max_length=DNS1123_SUBDOMAIN_MAX,
    source=f"{APIMACHINERY} IsConfigMapKey",
    extra=(("!self.startsWith('..') && self != '.'", lambda v: not v.startswith("..") and v != ".",
            "a Secret/ConfigMap key may not be '.' or start with '..'"),),
)

QUANTITY = Grammar(
    name="resource quantity",
    rule=("must be a non-negative Kubernetes quantity: a decimal number and an optional suffix Ki, Mi, Gi, Ti, "
          "Pi, Ei, n, u, m, k, M, G, T, P, E or an exponent e<n> (e.g. 40, 500m, 160Gi)"),
    pattern=anchored(QUANTITY_FMT),
    max_length=32,
    source="kubernetes/apimachinery pkg/api/resource/quantity.go ParseQuantity",
    extra=((f"!isQuantity(self) || quantity(self).compareTo(quantity('{2**63 - 1}')) < 0",
            lambda v: quantity.parse(v) < 2**63 - 1,
            "a quantity is less than 2^63-1 (Kubernetes caps larger ones)"),),
)


def _image_name(value: str) -> str:
    m = re.match(IMAGE_NAME_FMT, value)
    return m.group(0) if m else ""


IMAGE = Grammar(
    name="container image reference",
    rule=("must be a container image reference: [registry[:port]/]path[:tag][@digest], the path in lowercase "
          "letters, digits and the separators '.', '_', '__' or '-' between them, a tag of at most 128 letters, "
          "digits, '_', '.' and '-', a digest sha256:<64 hex>, sha384:<96 hex> or sha512:<128 hex>"),
    pattern=anchored(f"{IMAGE_NAME_FMT}(:{IMAGE_TAG_FMT})?(@{IMAGE_DIGEST_FMT})?"),
    max_length=IMAGE_MAX,
    source="distribution/reference ParseNormalizedNamed (kubelet, containerd); opencontainers/go-digest",
    extra=(
        (f"self.find(r'^{IMAGE_NAME_FMT}').size() <= {IMAGE_NAME_MAX}",
         lambda v: len(_image_name(v)) <= IMAGE_NAME_MAX,
         f"the repository name of an image (registry and path) is at most {IMAGE_NAME_MAX} characters"),
        ("!self.matches(r'^[a-f0-9]{64}$')", lambda v: not re.fullmatch("[a-f0-9]{64}", v),
         "an image may not be a bare 64-hex identifier (reserved for image IDs)"),
    ),
)

NODE_LABEL_VALUE = Grammar(
    name="label value, non-empty",
    rule=("must be a non-empty label value (letters, digits, '-', '_' and '.', starting and ending with a letter "
          "or digit, at most 63 characters): it is matched against the nodes' labels"),
    pattern=anchored(QUALIFIED_NAME_FMT),
    max_length=LABEL_VALUE_MAX,
    source=f"{APIMACHINERY} IsValidLabelValue",
)

ALL = (NODE_LABEL_VALUE, DNS1123_SUBDOMAIN, DNS1123_LABEL, LABEL_KEY, LABEL_VALUE, ENV_VAR_NAME, CONFIG_MAP_KEY, QUANTITY, IMAGE)


def by_pattern(pattern: str) -> Grammar | None:
    """The grammar whose CEL rule is `self.matches(r'<pattern>')` (docs/api.md names it)."""
    for g in ALL:
        if g.pattern == pattern:
            return g
    return None


# ------------------------------------------------------------------------------ integer ranges

INT32_MAX = 2**31 - 1  # int32 fields of the pod spec and of KubeRay's RayJob (replicas, TTLs, deadlines)
UINT32_MAX = 2**32 - 1  # seeds: numpy and several data loaders take 32-bit seeds


# ------------------------------------------------------------------------------ pydantic field types


# A str checked by the grammar in Python (Grammar.validate) and described by Grammar.schema() in the CRD: one
# definition, both sides. Spelt out one by one so that type checkers see them as types.
DNSSubdomain = Annotated[str, AfterValidator(DNS1123_SUBDOMAIN.validate), WithJsonSchema(DNS1123_SUBDOMAIN.schema())]
DNSLabel = Annotated[str, AfterValidator(DNS1123_LABEL.validate), WithJsonSchema(DNS1123_LABEL.schema())]
LabelValue = Annotated[str, AfterValidator(LABEL_VALUE.validate), WithJsonSchema(LABEL_VALUE.schema())]
NodeLabelValue = Annotated[str, AfterValidator(NODE_LABEL_VALUE.validate), WithJsonSchema(NODE_LABEL_VALUE.schema())]
EnvVarName = Annotated[str, AfterValidator(ENV_VAR_NAME.validate), WithJsonSchema(ENV_VAR_NAME.schema())]
ConfigMapKey = Annotated[str, AfterValidator(CONFIG_MAP_KEY.validate), WithJsonSchema(CONFIG_MAP_KEY.schema())]
Quantity = Annotated[str, AfterValidator(QUANTITY.validate), WithJsonSchema(QUANTITY.schema())]
Image = Annotated[str, AfterValidator(IMAGE.validate), WithJsonSchema(IMAGE.schema())]


def _check_label_keys(value: dict[str, str]) -> dict[str, str]:
    for key in value:
        message = LABEL_KEY.check(key)
        if message is not None:
            raise ValueError(f"key {_quote(key)} {message}")
    return value


_LABEL_KEYS_CEL = [{"rule": f"self.all(k, {LABEL_KEY.cel('k')})", "message": f"every key {LABEL_KEY.rule}"}]

# nodeSelector-like maps: label keys to label values (the pod spec's ValidateLabels). A key schema would not
# be structural, so the keys are checked by a validator and a CEL rule on the map.
NodeSelector = Annotated[
    dict[str, LabelValue], Field(max_length=32), AfterValidator(_check_label_keys),
    Field(json_schema_extra={"x-kubernetes-validations": _LABEL_KEYS_CEL}),
]
Labels = Annotated[dict[str, LabelValue], AfterValidator(_check_label_keys)]

ANNOTATIONS_MAX_BYTES = 256 * 1024  # TotalAnnotationSizeLimitB (apimachinery ValidateAnnotationsSize)


def _check_annotations(value: dict[str, str]) -> dict[str, str]:
    for key in value:
        message = LABEL_KEY.check(key)
        if message is not None:
            raise ValueError(f"key {_quote(key)} {message.replace('a label key', 'an annotation key')}")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in value.items())
    if size > ANNOTATIONS_MAX_BYTES:
        raise ValueError(f"annotations may hold at most {ANNOTATIONS_MAX_BYTES} bytes in all, got {size}")
    return value


Annotations = Annotated[dict[str, str], AfterValidator(_check_annotations)]
