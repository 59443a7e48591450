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


def _distribution(site, name, version, files=()):
    """A dist-info folder of ``name`` ``version`` in ``site`` whose RECORD lists ``files`` (``(path, size)``)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{path},,{size}\n" for path, size in files))


def test_the_version_is_the_one_of_the_distribution_the_import_finds(tmp_path, monkeypatch):
    """Two builds of one package on sys.path (onnxruntime in the environment, onnxruntime-gpu in a --target folder
    put first, as on the GPU machine): the version reported is the imported one's, and the other build is named, so
    that the build cache, earlier rankings and a checkpoint's environment check tell the two apart."""
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    for site, name, version in ((cpu, "fakeort", "1.30.0"), (gpu, "fakeort-gpu", "1.31.1")):
        (site / "fakeort").mkdir(parents=True)
        (site / "fakeort" / "__init__.py").write_text("")
        _distribution(site, name, version)
    monkeypatch.syspath_prepend(str(cpu))
    monkeypatch.syspath_prepend(str(gpu))  # first on sys.path: the import finds this one
    requirement = Requirement("fakeort", ("fakeort", "fakeort-gpu"), "onnx", "1.31")
    check = probe_requirement.__wrapped__(requirement)
    assert check.ok and check.versions == {"fakeort": "1.31.1 (fakeort-gpu)"}
    monkeypatch.syspath_prepend(str(cpu))  # now the CPU build comes first: too old, and said so by its name
    check = probe_requirement.__wrapped__(requirement)
    assert not check.ok and "package 'fakeort' 1.30.0 is older than 1.31" in check.reason
    assert check.versions == {"fakeort": "1.30.0"}


def test_two_builds_installed_into_one_folder_are_told_apart_by_their_files(tmp_path, monkeypatch):
    """pip install onnxruntime, then onnxruntime-gpu into the same site-packages: the second overwrote the package's
    files, and its RECORD is the one whose sizes match them. When the files cannot tell them apart, both are
    named, so the label still changes when a build is added."""
    site = tmp_path / "site"
    (site / "fakeort").mkdir(parents=True)
    (site / "fakeort" / "__init__.py").write_text("")
    (site / "fakeort" / "_native.so").write_bytes(b"g" * 200)  # the GPU build's library, written last
    _distribution(site, "fakeort", "1.30.0", [("fakeort/__init__.py", 0), ("fakeort/_native.so", 100)])
    _distribution(site, "fakeort-gpu", "1.31.1", [("fakeort/__init__.py", 0), ("fakeort/_native.so", 200)])
    monkeypatch.syspath_prepend(str(site))
    requirement = Requirement("fakeort", ("fakeort", "fakeort-gpu"), "onnx", "1.31")
    check = probe_requirement.__wrapped__(requirement)
    assert check.ok and check.versions == {"fakeort": "1.31.1 (fakeort-gpu)"}
    (site / "fakeort" / "_native.so").write_bytes(b"c" * 100)  # the CPU build reinstalled over it
    check = probe_requirement.__wrapped__(requirement)
    assert not check.ok and check.versions == {"fakeort": "1.30.0"}
    record = site / "fakeort-1.30.0.dist-info" / "RECORD"
    record.write_text(record.read_text().replace("_native.so,,100", "_native.so,,200"))
    (site / "fakeort" / "_native.so").write_bytes(b"g" * 200)  # now both records match the files
    check = probe_requirement.__wrapped__(requirement)
    assert check.versions == {"fakeort": "1.30.0 (fakeort 1.30.0 + fakeort-gpu 1.31.1)"}


def test_one_distribution_under_two_spellings_or_beside_a_meta_package_is_named_as_before(tmp_path, monkeypatch):
    """A requirement listing `-` and `_` spellings of one distribution (torch-tensorrt) finds it once, and a meta
    package installed beside the real one (tensorrt beside tensorrt-cu12) records no file of the package: neither
    changes the label."""
    site = tmp_path / "site"
    (site / "fakert").mkdir(parents=True)
    (site / "fakert" / "__init__.py").write_text("")
    _distribution(site, "fake-rt", "10.1", [("fakert/__init__.py", 0)])
    _distribution(site, "fake-rt-meta", "10.1", [])
    monkeypatch.syspath_prepend(str(site))
    spellings = Requirement("fakert", ("fake-rt", "fake_rt"), "tensorrt")
    assert probe_requirement.__wrapped__(spellings).versions == {"fakert": "10.1"}
    meta = Requirement("fakert", ("fake-rt-meta", "fake-rt"), "tensorrt")
    assert probe_requirement.__wrapped__(meta).versions == {"fakert": "10.1 (fake-rt)"}
