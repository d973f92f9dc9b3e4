"""The runtime's start-up version check: the real check function, fed versions, and its call site."""

from __future__ import annotations

import pytest
from finetune_training import stackcheck
from finetune_training.stackcheck import SUPPORTED, Supported, UnsupportedStack, check

GOOD = {"python": "3.13.5", "ray": "2.58.0", "torch": "2.13.0+cu130", "transformers": "5.13.0", "pydantic": "2.14.4"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"torch": "2.12.1+cu128"},
         "torch 2.12.1+cu128 is not supported by the training runtime (supported: >=2.13.0,<2.16)"),
        ({"torch": "2.16.0"}, "torch 2.16.0 is not supported by the training runtime (supported: >=2.13.0,<2.16)"),
        ({"ray": "2.57.1"}, "ray 2.57.1 is not supported by the training runtime (supported: >=2.58.0,<2.61)"),
        ({"ray": "3.0.0"}, "ray 3.0.0 is not supported by the training runtime (supported: >=2.58.0,<2.61)"),
        ({"python": "3.10.14"}, "python 3.10.14 is not supported by the training runtime (supported: >=3.11,<3.14)"),
        ({"transformers": "4.57.1"},
         "transformers 4.57.1 is not supported by the training runtime (supported: >=5.13.0,<6)"),
        ({"pydantic": None}, "pydantic is not installed; the training runtime needs pydantic>=2.10,<3"),
    ],
    ids=["torch-too-old", "torch-too-new", "ray-too-old", "ray-too-new", "python-3.10", "transformers-4", "no-pydantic"],
)
def test_unsupported_version_is_one_clear_line(override: dict[str, str | None], message: str) -> None:
    with pytest.raises(UnsupportedStack) as e:
        check({**GOOD, **override})
    assert str(e.value) == message
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "found",
    [GOOD, {**GOOD, "python": "3.11.7", "ray": "2.60.0", "torch": "2.15.0", "transformers": "5.24.0"},
     {**GOOD, "ray": "2.60.9", "torch": "2.15.1+cpu"}],
    ids=["dlc", "project-pins", "patch-releases"],
)
def test_supported_versions_pass(found: dict[str, str]) -> None:
    assert check(found) == found


def test_the_stack_this_test_runs_on_is_supported() -> None:
    found = check()  # real lookups: run on both stacks, so both must be inside the ranges
    assert set(found) == set(SUPPORTED)


def test_entrypoint_refuses_an_unsupported_stack_before_importing_torch(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from importlib import metadata

    from finetune_training.__main__ import main

    torch_version = metadata.version("torch")
    monkeypatch.setitem(SUPPORTED, "torch", Supported("99", "100"))
    assert main(["--config", "/nonexistent.yaml"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: torch {torch_version} is not supported by the training runtime (supported: >=99,<100)"]


def test_parse_ignores_local_versions_and_trailing_zeros() -> None:
    assert stackcheck.parse("2.13.0+cu130") == (2, 13)
    assert stackcheck.parse("3") == stackcheck.parse("3.0.0")
    assert stackcheck.parse("0.66b2") == (0, 66)
    with pytest.raises(ValueError):
        stackcheck.parse("dev")
