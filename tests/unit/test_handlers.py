"""kopf wiring: the watches ask the API server for only the objects the operator needs."""

from __future__ import annotations


def test_watches_are_filtered_by_the_api_server() -> None:
    import kopf
    from finetune_operator.controller.handlers import settings_for_embedding

    selectors = settings_for_embedding().watching.label_selectors
    for (group, version, plural), want in {("", "v1", "pods"): ["finetune.dev/job"],
                                           ("ray.io", "v1", "rayjobs"): ["finetune.dev/job"],
                                           ("", "v1", "nodes"): ["node.kubernetes.io/instance-type"],
                                           ("finetune.dev", "v1alpha1", "finetunejobs"): []}.items():
        assert list(selectors.collect(kopf.Resource(group, version, plural))) == want, plural
