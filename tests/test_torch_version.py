"""The torch releases hierremat supports: the installed one checked at import, with a one-line error outside."""

import importlib.metadata

import pytest

from hierremat import _torch_version


@pytest.mark.parametrize("version,supported", [
    ("2.10.1", False), ("2.11.0", True), ("2.13.0+cpu", True), ("2.15.0", True), ("2.16.0.dev20261201", False),
    ("1.13.1", False),
])
def test_releases_outside_the_range_raise_naming_it(monkeypatch, version, supported):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    if supported:
        _torch_version.check_torch_version()
        return
    with pytest.raises(ImportError) as err:
        _torch_version.check_torch_version()
    message = str(err.value)
    assert "torch>=2.11,<2.16" in message and version in message and "\n" not in message


def test_no_torch_is_the_torch_free_core_alone(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    _torch_version.check_torch_version()


def test_the_package_declares_the_range_it_checks():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert f"torch{_torch_version.supported_range()[len('torch'):]}" in project["dependencies"]
