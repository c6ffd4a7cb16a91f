"""The installed set is the lock, Composer's and streaming's stale pins are the only conflicts, and torch
has kernels for the GPUs people train on (Hopper sm_90, Blackwell sm_100)."""

import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO


def pins(name: str) -> dict[str, str]:
    """{canonical name: version} of a requirements file's `name==version` lines."""
    found = {}
    for line in (REPO / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            (version,) = [spec.version for spec in requirement.specifier if spec.operator == "=="]
            found[canonicalize_name(requirement.name)] = version
    return found


def installed_version(name: str) -> str | None:
    """The version `import` finds: the first distribution on sys.path, not the last one listed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_every_locked_package_is_installed_at_its_version():
    # setuptools >= 71 appends its _vendor folder (packaging, zipp, importlib_metadata, platformdirs of
    # other versions, with their dist-info) to sys.path once anything imports it (torch's cpp_extension
    # does): listing every distribution then shows those too. Imported here so the check always meets it.
    import setuptools  # noqa: F401

    lock = pins("requirements-lock.txt")
    wrong = {name: (version, installed_version(name)) for name, version in lock.items()}
    assert {name: got for name, got in wrong.items() if got[0] != got[1]} == {}, "run `make install`"


def test_direct_pins_and_overrides_are_the_locks_versions():
    lock = pins("requirements-lock.txt")
    for file in ("requirements.txt", "requirements-dev.txt", "requirements-overrides.txt"):
        stale = {
            name: (version, lock.get(name))
            for name, version in pins(file).items()
            if lock.get(name) != version
        }
        assert stale == {}, f"{file} disagrees with requirements-lock.txt: run `make lock`"


@pytest.mark.subprocess
def test_pip_check_finds_only_the_listed_overrides():
    """`pip check` names each declared requirement the installed set breaks: each must be on a package
    requirements-overrides.txt overrides, and each override must still be needed (else drop its line)."""
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    conflicts = [line for line in result.stdout.splitlines() if " has requirement " in line]
    assert result.returncode == 0 or conflicts, result.stdout + result.stderr
    overridden = set(pins("requirements-overrides.txt"))
    broken = {
        canonicalize_name(Requirement(line.split(" has requirement ")[1].split(",")[0]).name)
        for line in conflicts
    }
    others = [line for line in result.stdout.splitlines() if line and " has requirement " not in line]
    assert others == [], "pip check: missing packages"
    assert broken - overridden == set(), f"conflicts not in requirements-overrides.txt: {conflicts}"
    assert overridden - broken == set(), (
        "overrides no longer needed: remove them from requirements-overrides.txt"
    )


def test_torch_has_hopper_and_blackwell_kernels():
    """A CPU-only or CUDA 12.6 torch (2.7's PyPI build: sm_50..sm_90) fails here: on a B200, GB200 or
    RTX 50xx it stops with "no kernel image is available". Read from the build, no GPU needed."""
    import torch

    arches = torch._C._cuda_getArchFlags().split()
    assert {"sm_90", "sm_100"} <= set(arches), (
        f"torch {torch.__version__} has kernels for {arches or 'no GPU'}"
    )
