"""Facts about where aitune runs: library versions, the device, the CPU model and whether it runs bf16 natively.

Reports record :func:`environment`; checkpoints record :func:`device_facts` per graph and compare them at
load; the tuning cache keys builds by device facts too (:func:`aitune.torch.search.cache.device_key`); the crash
registry and the AOTInductor canary key what they remember by :func:`environment_id`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from typing import Any

import torch

from aitune import __version__


def environment() -> dict:
    """Versions and device facts recorded in reports and checkpoints.

    Returns:
        ``{"aitune", "torch", "python", "platform", "cuda", "cuda_available"}`` (strings, None for no CUDA
        build, a bool), plus ``"gpu"`` (name) and ``"capability"`` (``"9.0"``) of CUDA device 0 when there is one.
    """
    info = {"aitune": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return info


def device_facts(device: torch.device | str) -> dict:
    """JSON facts about a device, as checkpoints record them per graph.

    Args:
        device: a torch device or its name (``"cpu"``, ``"cuda:1"``).

    Returns:
        ``{"type", "index", "name", "capability"}``: the CUDA device's index, name and capability
        (``[major, minor]``); for the CPU its model name (:func:`cpu_model_name`) and ``"machine"``
        (``platform.machine()``); None where a fact does not apply.
    """
    device = torch.device(device)
    facts: dict[str, Any] = {"type": device.type, "index": device.index, "name": None, "capability": None}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        facts["index"] = index
        facts["name"] = torch.cuda.get_device_name(index)
        facts["capability"] = list(torch.cuda.get_device_capability(index))
    elif device.type == "cpu":
        facts["name"] = cpu_model_name()
        facts["machine"] = platform.machine()
    return facts


@functools.cache
def cpu_model_name() -> str:
    """The CPU's model name: the ``model name`` line of ``/proc/cpuinfo``, else ``platform.processor()``,
    else the machine type (``x86_64``). Read once per process."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine()


def native_bf16(device: torch.device) -> bool:
    """Does ``device`` run bf16 matmuls in hardware, faster than fp32? CPUs with AMX tiles or AVX-512 BF16
    (oneDNN's bf16 kernels; without them bf16 is emulated and slower), CUDA GPUs of compute capability >= 8.0
    (bf16 tensor cores, Ampere onwards)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8
    if device.type != "cpu":
        return False
    probes = (getattr(torch.cpu, "_is_amx_tile_supported", None), getattr(torch.cpu, "_is_avx512_bf16_supported", None))
    try:
        return any(probe is not None and probe() for probe in probes)
    except RuntimeError:  # a build without the cpuinfo probes
        return False


def environment_key(device: torch.device | str) -> dict:
    """What a native crash depends on: torch/CUDA versions, the CUDA driver, the device (name, capability)."""
    facts = device_facts(device)
    driver = None
    if facts["type"] == "cuda" and torch.cuda.is_available():
        try:
            driver = int(torch._C._cuda_getDriverVersion())  # noqa: SLF001 - no public accessor in torch
        except Exception:  # noqa: BLE001 - informative only
            driver = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver, "device": facts["type"],
            "name": facts.get("name"), "capability": facts.get("capability"), "machine": facts.get("machine")}


def environment_id(device: torch.device | str) -> str:
    """A short stable id of :func:`environment_key`: the first 16 hex digits of the SHA-256 of its sorted JSON."""
    return hashlib.sha256(json.dumps(environment_key(device), sort_keys=True).encode()).hexdigest()[:16]
