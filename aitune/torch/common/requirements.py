"""What a backend or kernel provider needs to run: optional packages, their versions, and flag checks.

:func:`probe_requirement` answers "is this package importable, and new enough?" without importing it
(``importlib.util.find_spec`` + ``importlib.metadata``), cached and silent: ``availability()`` of backends
and kernel providers is built on it. A missing piece's reason names the fix:
``package 'tensorrt' not found — pip install 'aitune[tensorrt]'``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import re
from pathlib import Path

import torch

from aitune.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Check:
    """Result of :meth:`Backend.availability` / :meth:`Backend.supports`: ``ok`` and a one-line ``reason``."""

    ok: bool
    reason: str = ""
    versions: dict = dataclasses.field(default_factory=dict)
    no_op: bool = False  # supports(): the candidate would change nothing (a quantizer matching no layer)

    def __bool__(self) -> bool:
        return self.ok


@dataclasses.dataclass(frozen=True)
class Requirement:
    """An optional package a backend needs.

    Args:
        module: import name (``onnxruntime``).
        distributions: distribution names that provide it (``onnxruntime``, ``onnxruntime-gpu``).
        extra: the aitune pip extra that installs it. min_version: lowest supported version.
    """

    module: str
    distributions: tuple[str, ...]
    extra: str
    min_version: str | None = None
    declared: bool = dataclasses.field(default=True, compare=False, repr=False)  # False: a probe only, not kept

    def __post_init__(self) -> None:
        if self.declared:
            _DECLARED.setdefault(self.module, self)


# every Requirement declared, by import name (the first declaration of a name): what installed_version reads
_DECLARED: dict[str, Requirement] = {}


@functools.lru_cache(maxsize=None)
def probe_requirement(requirement: Requirement) -> Check:
    """Is ``requirement`` importable and new enough? Cheap and silent (find_spec + metadata only).

    The version is the one of the installed distribution that provides the module an import finds: with
    ``onnxruntime`` installed and ``onnxruntime-gpu`` earlier on ``sys.path``, that is ``onnxruntime-gpu``'s. A
    distribution other than the first of ``requirement.distributions`` is named after the version
    (``"1.31.1 (onnxruntime-gpu)"``), since two builds of one version differ in what they run (execution providers):
    the version strings key the build cache, earlier rankings and a checkpoint's environment check."""
    spec = importlib.util.find_spec(requirement.module)
    if spec is None:
        return Check(False, f"package '{requirement.distributions[0]}' not found — "
                            f"pip install 'aitune[{requirement.extra}]'")
    distribution, version = _imported_distribution(requirement, spec)
    label = version or "unknown"
    if version and distribution != requirement.distributions[0]:
        label = f"{version} ({distribution})"
    if requirement.min_version and version and version_at_least(version, requirement.min_version) is False:
        return Check(False, f"package '{distribution}' {version} is older than "
                            f"{requirement.min_version} — pip install -U 'aitune[{requirement.extra}]'",
                     {requirement.module: label})
    return Check(True, "", {requirement.module: label})


def _imported_distribution(requirement: Requirement, spec) -> tuple[str, str | None]:
    """``(distribution name, version)`` of the installed distribution whose files hold the module ``spec`` found.

    Candidates are the installed distributions of ``requirement.distributions`` in the folder the module is
    imported from (any installed one, when none is there). Where several share that folder (``pip install
    onnxruntime`` then ``onnxruntime-gpu``: the second overwrote the first's files), the one whose recorded file
    sizes all match the files on disk is taken; when that does not single one out, every candidate is named
    (``"onnxruntime 1.30.0 + onnxruntime-gpu 1.31.1"``) with the first one's version. ``(first name, None)`` when
    none is installed (a source checkout). Never raises: a distribution that cannot be read is passed over."""
    try:
        locations = list(spec.submodule_search_locations or ()) or ([spec.origin] if spec.origin else [])
        homes = {_resolved(Path(location).parent) for location in locations}
        installed, seen = [], set()  # (name, distribution, folder)
        for name in requirement.distributions:
            # names are normalised (torch-tensorrt, torch_tensorrt: one distribution), and a folder twice on
            # sys.path yields its distributions twice: each is taken once
            for distribution in importlib.metadata.distributions(name=name):
                folder = _resolved(Path(str(distribution.locate_file(""))))
                where = (_normalised(distribution.metadata["Name"] or name), folder, distribution.version)
                if where not in seen:
                    seen.add(where)
                    installed.append((name, distribution, folder))
        here = [(name, d) for name, d, folder in installed if folder in homes] or [(n, d) for n, d, _ in installed]
        if len(here) > 1:
            # one that records no file of the package (a meta package) does not provide it; of the others, the
            # one whose recorded file sizes match the files on disk does
            matches = [(found, _files_match(found[1], requirement.module)) for found in here]
            here = [found for found, match in matches if match is not None] or here
            current = [found for found, match in matches if match]
            here = current if len(current) == 1 else here
        if len(here) > 1:
            return " + ".join(f"{name} {d.version}" for name, d in here), here[0][1].version
        if here:
            return here[0][0], here[0][1].version
    except Exception:  # noqa: BLE001 - metadata a probe cannot read: no version, never a failure
        pass
    return requirement.distributions[0], None


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _files_match(distribution, module: str) -> bool | None:
    """Does every file ``distribution`` recorded under the package ``module`` exist with the recorded size? None
    when it records no such file."""
    checked = 0
    for file in distribution.files or ():
        if file.parts and file.parts[0] == module and file.size is not None:
            try:
                if Path(str(distribution.locate_file(file))).stat().st_size != file.size:
                    return False
            except OSError:
                return False
            checked += 1
    return True if checked else None


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return path


def version_at_least(version: str, minimum: str) -> bool | None:
    """``version >= minimum`` by PEP 440 (``packaging.version``: ``1.20.0rc1`` < ``1.20.0`` < ``1.20.0.post1``;
    a local part such as ``+cu130`` is ignored); None when either cannot be parsed."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version.split("+")[0]) >= Version(minimum)
    except InvalidVersion:
        return None


def package_versions(blueprint) -> dict:
    """``{package: version}`` of everything a backend blueprint runs on: its class's packages
    (``availability().versions``), or what its ``package_versions()`` says where it defines one (the kernel
    selector: its own, its delegate's and its kernel providers'). Keys the build cache and earlier rankings."""
    own = getattr(blueprint, "package_versions", None)
    return dict(own()) if callable(own) else dict(type(blueprint).availability().versions)


def installed_version(module: str) -> str:
    """The version label :func:`probe_requirement` gives the package imported as ``module`` here (``"1.31.1
    (onnxruntime-gpu)"``), ``"not installed"`` when it cannot be imported. A name no backend or kernel provider
    imported so far declares is probed as the distributions that install it (``yaml``: PyYAML), without keeping
    that probe as a declaration. A checkpoint's environment check compares it with the label saved for each package
    its graphs ran on (a kernel selector's delegate's and providers' too: :func:`package_versions`)."""
    requirement = _DECLARED.get(module)
    if requirement is None:
        names = tuple(importlib.metadata.packages_distributions().get(module, ())) or (module,)
        requirement = Requirement(module, names, "all", declared=False)
    check = probe_requirement(requirement)
    return check.versions.get(module, "not installed")


def check_requirements(requirements) -> Check:
    """All ``requirements`` importable and new enough? The first failing one's reason, else their versions."""
    versions: dict[str, str] = {}
    for requirement in requirements:
        check = probe_requirement(requirement)
        if not check.ok:
            return Check(False, check.reason, versions)
        versions.update(check.versions)
    return Check(True, "", versions)


def validate_flags(config, bool_fields: tuple[str, ...], optional_bool_fields: tuple[str, ...] = ("dynamic",)) -> None:
    """Raise ConfigError unless each of ``bool_fields`` is a bool and each optional one is a bool or None."""
    for name in bool_fields:
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"{name} must be a bool, got {getattr(config, name)!r}")
    for name in optional_bool_fields:
        value = getattr(config, name)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{name} must be True, False or None, got {value!r}")


def torch_version_at_least(version: str) -> bool:
    """Is the installed torch at least ``version`` (PEP 440; ``2.13.0+cpu`` counts as 2.13.0)?"""
    return bool(version_at_least(torch.__version__, version))
