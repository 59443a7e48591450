"""The AOTInductor canary: does any package load on this device in this environment (NOTE [AOTInductor canary])."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from aitune.torch.backend.inductor_aot.runtime import load_package
from aitune.torch.common.environment import environment_id

logger = logging.getLogger(__name__)


class Canary(torch.nn.Module):
    """The one-op model of the canary package: ``x * 2 + 1``."""

    def forward(self, x):
        return x * 2 + 1


def loads_here(device: str, folder: Path) -> None:
    """NOTE [AOTInductor canary]: in some environments loading *any* AOTInductor package kills the process
    (a SIGSEGV in ``aoti_load_package``, for CPU and CUDA packages alike, even for a one-op
    model), after a compile that takes a minute for a real model. The child step therefore first compiles and
    loads a one-op package on ``device``: if this environment crashes, it crashes here, early, and the crash is
    remembered (:mod:`aitune.torch.search.crashes`). Once a canary loaded on a device in this environment (a marker file
    in the user's cache), later builds skip it. A CPU canary ahead of a CUDA one was tried and dropped: the
    first C++ compile on a fresh machine can take a minute even for one op (later ones seconds;
    ``benchmarks/aoti_canary_time.py`` measures it), so it made the crash come later, not sooner.

    Raises:
        RuntimeError: if the canary package loads but returns a wrong result.
    """
    _canary(device, folder)


def _canary(device: str, folder: Path) -> None:
    # A fact about the environment, not about a tune: kept in the user's cache, whatever AITUNE_CACHE_DIR says.
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    marker = base / "aitune" / "aoti_canary" / f"{environment_id(device)}.ok"
    if marker.exists():
        return
    logger.info("compiling and loading a one-op AOTInductor package on %s (canary: does any package load here?)",
                device)
    started = time.perf_counter()
    example = torch.ones(2, 4, device=device)
    exported = torch.export.export(Canary().to(device), (example,))
    package = folder / f"canary_{torch.device(device).type}.pt2"
    torch._inductor.aoti_compile_and_package(exported, package_path=str(package))
    output = load_package(package, torch.device(device))(example)
    if not torch.equal(output.cpu() if isinstance(output, torch.Tensor) else output[0].cpu(), torch.full((2, 4), 3.0)):
        raise RuntimeError(f"the AOTInductor canary package on {device} returned a wrong result")
    package.unlink(missing_ok=True)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    logger.info("an AOTInductor package loads on %s in this environment (canary, %.1f s); marker %s", device,
                time.perf_counter() - started, marker)
