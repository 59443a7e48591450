"""Optional-package checks compare versions by PEP 440 (packaging.version), not by digits: before, "1.20.0rc1"
ranked above "1.20.0"."""

import pytest

from aitune.torch.common.requirements import Requirement, probe_requirement, torch_version_at_least, version_at_least


@pytest.mark.parametrize("version, minimum, expected", [
    ("1.20.0rc1", "1.20.0", False),   # a release candidate comes before its release
    ("1.20.0", "1.20.0", True),
    ("1.20.0.post1", "1.20.0", True),
    ("2.13.0+cpu", "2.6", True),       # local part ignored
    ("2.6.0a0+git1234", "2.6", False),  # an alpha build of 2.6 is not 2.6
    ("0.10", "0.9", True),             # not string order
    ("not-a-version", "1.0", None),
])
def test_version_at_least_follows_pep440(version, minimum, expected):
    assert version_at_least(version, minimum) is expected


def test_probe_reports_an_old_package_with_the_fix():
    check = probe_requirement(Requirement("pytest", ("pytest",), "test", "9999.0"))
    assert not check.ok and "older than 9999.0" in check.reason and "pip install -U 'aitune[test]'" in check.reason
    assert probe_requirement(Requirement("pytest", ("pytest",), "test", "1.0")).ok
    assert torch_version_at_least("2.0") and not torch_version_at_least("99.0")
