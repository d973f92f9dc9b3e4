"""What a FinetuneJob may use: the operator's allow-list for images and ServiceAccounts. Pure.

Whoever may create a FinetuneJob would otherwise choose any image to run as any ServiceAccount of the
namespace on GPU nodes. The list lives in one ConfigMap (`finetune-system/finetune-operator-policy`,
deploy/policy.yaml): the ValidatingAdmissionPolicy `finetune-allowed-images` rejects a job at
`kubectl apply` time, and the operator checks the same list before it creates anything (a cluster
without the policy installed, or a job created before the list changed) and reports `SpecValid=False`.
Entries are comma- or newline-separated; one ending in `*` is a prefix; a missing key allows all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .spec import FinetuneJobSpec
from .validation import Issue

POLICY_NAME = "finetune-operator-policy"
IMAGES_KEY = "allowedImages"
ACCOUNTS_KEY = "allowedServiceAccounts"


def _entries(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.replace("\n", ",").split(",") if p.strip())


def matches(value: str, patterns: tuple[str, ...]) -> bool:
    return any(value.startswith(p[:-1]) if p.endswith("*") else value == p for p in patterns)


@dataclass(frozen=True)
class AllowList:
    images: tuple[str, ...] = ("*",)
    service_accounts: tuple[str, ...] = ("*",)
    source: str = "no policy (everything allowed)"

    @classmethod
    def from_data(cls, data: Mapping[str, str], source: str) -> AllowList:
        return cls(
            images=_entries(data[IMAGES_KEY]) if IMAGES_KEY in data else ("*",),
            service_accounts=_entries(data[ACCOUNTS_KEY]) if ACCOUNTS_KEY in data else ("*",),
            source=source,
        )


def policy_issues(spec: FinetuneJobSpec, allow: AllowList) -> list[Issue]:
    out = []
    image = spec.cluster.image
    if not matches(image, allow.images):
        out.append(Issue("spec.cluster.image",
                         f"{image} is not in the allowed images ({', '.join(allow.images)}; {allow.source})"))
    account = spec.cluster.service_account_name or "default"
    if not matches(account, allow.service_accounts):
        out.append(Issue("spec.cluster.serviceAccountName",
                         f"{account} is not in the allowed service accounts "
                         f"({', '.join(allow.service_accounts)}; {allow.source})"))
    return out
