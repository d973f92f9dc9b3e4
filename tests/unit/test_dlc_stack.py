"""The default image, the default rayVersion, requirements/dlc.txt and the runtime's supported ranges agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from finetune_operator.api.spec import DEFAULT_IMAGE, DEFAULT_RAY_VERSION, ClusterSpec
from finetune_training.stackcheck import SUPPORTED

ROOT = Path(__file__).resolve().parents[2]


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^]]*\])?==(\S+)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(3)
    return out


def header(path: Path, key: str) -> str:
    m = re.search(rf"^# {key}: (\S+)$", path.read_text(), re.M)
    assert m, f"{path.name} has no '# {key}:' line"
    return m.group(1)


DLC = ROOT / "requirements" / "dlc.txt"


def test_default_image_and_ray_version_are_the_dlc_pinned_in_dlc_txt() -> None:
    assert header(DLC, "dlc-image") == DEFAULT_IMAGE
    assert pins(DLC)["ray"] == DEFAULT_RAY_VERSION
    cluster = ClusterSpec.model_validate({})
    assert (cluster.image, cluster.ray_version) == (DEFAULT_IMAGE, DEFAULT_RAY_VERSION)


def test_dlc_txt_pins_the_documented_stack() -> None:
    p = pins(DLC)
    assert header(DLC, "dlc-python") == "3.13"
    documented = {"ray": "2.58.0", "torch": "2.13.0", "transformers": "5.13.0", "datasets": "5.0.0",
                  "accelerate": "1.14.0"}
    assert {k: p.get(k) for k in documented} == documented
    # What the runtime imports besides those: present, so the image's versions are what the tests use.
    for name in ("pydantic", "pyyaml", "pyarrow", "safetensors", "tokenizers", "numpy"):
        assert name in p, f"dlc.txt lacks {name}"


@pytest.mark.parametrize("file", ["dlc.txt", "constraints.txt"])
def test_both_tested_stacks_lie_inside_the_runtimes_supported_ranges(file: str) -> None:
    p = pins(ROOT / "requirements" / file)
    for name in ("ray", "torch", "transformers", "pydantic"):
        assert SUPPORTED[name].contains(p[name]), f"{file}: {name} {p[name]} outside {SUPPORTED[name]}"
    py = header(DLC, "dlc-python") if file == "dlc.txt" else "3.11"
    assert SUPPORTED["python"].contains(py)
