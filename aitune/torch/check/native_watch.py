"""The stale-weight watch's per-call read (and the value gate's nan/inf check) in one C call, built once per machine
and torch version.

NOTE [native watch]: :class:`~aitune.torch.check.guard.StateWatch` must notice an in-place edit of any parameter
or buffer at the next call (README, "Weights changed after tuning are noticed"), so it reads every tensor's version
counter on every call. From Python that costs ~55 ns a tensor on this project's CPU (an attribute lookup and an
int object per tensor: 17.7 µs for ResNet-50's 320 parameters and buffers) and ~170 ns on the GPU machine's host
(55 µs a call, the largest stage of the tuned module's host time: ``benchmarks/wrapper_cost.py --stages``).
PyTorch has no call that reads many version counters at once, and no hook on in-place writes. ``native_watch.cpp``
is that call: ``StateReader(tensors).state()`` sums the version counters, data pointers and dtype/device codes of
a fixed list of tensors in C++ (0.4 µs for 320 tensors here), so the watch can also compare every data pointer
on every call, where the Python path samples them (``FULL_SCAN_EVERY``). The same extension's ``all_finite(tensor)``
serves the value gate's nan/inf check of CPU inputs (exponent bits, no torch op: ~0.2 µs against ~2 µs for a
``sum`` and its ``item`` on a small tensor).

How it is built and trusted:

- compiled with the system's C++ compiler (``$CXX``, else ``c++``/``g++``) against the running torch's headers, with
  CPython's C API and c10's ``TensorImpl`` only (no pybind11; ~13 s on this project's 2-core CPU), into
  ``<cache_dir>/native/<key>/`` (``$AITUNE_NATIVE_DIR/<key>/`` where set), the key hashing the source, torch's
  version, Python's ABI tag and the compiler;
- then imported once in a child process that checks its three sums against the ones Python reads, before and after
  an in-place edit, a ``.data`` swap and a dtype change (an extension built against another torch ABI could crash on
  import: a child's crash is recorded, not ours); the verdict (``verdict.json``) is kept beside the library, so
  later processes import it directly, and a failed build or check is not retried for that key;
- only on Linux; ``AITUNE_NATIVE_WATCH=0`` switches it off. Where it is off or fails (no compiler, no torch
  headers, an inference tensor among the weights), the watch reads from Python as before: same promises, the
  pointer scan sampled. ``aitune env`` says which.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import torch

from aitune.torch.config import config

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_watch.cpp")
MODULE_NAME = "aitune_native_watch"
ENV_SWITCH = "AITUNE_NATIVE_WATCH"
DIR_VARIABLE = "AITUNE_NATIVE_DIR"
BUILD_TIMEOUT_S = 300
CHECK_TIMEOUT_S = 120

_STATE: dict = {}  # "module": the imported extension or None, "reason": why None (once per process)
_LOCK = threading.Lock()

# The child's check: the extension's sums against Python's, before and after each kind of change StateWatch notices.
_CHECK = r"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("aitune_native_watch", sys.argv[1])
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
tensors = [torch.nn.Parameter(torch.randn(3, 4)), torch.randn(5)[1:], torch.zeros(2, dtype=torch.int64)]
reader = module.StateReader(tensors)
def python_sums():
    return (sum(t._version for t in tensors), sum(t.data_ptr() for t in tensors))
def check(what):
    versions, pointers, _ = reader.state()
    assert (versions, pointers) == python_sums(), (what, reader.state(), python_sums())
check("fresh")
before = reader.state()
with torch.no_grad():
    tensors[0].add_(1)
check("in place"); assert reader.state()[0] == before[0] + 1
tensors[1].data = torch.randn(4)
check(".data swapped"); assert reader.state()[1] != before[1]
kinds = reader.state()[2]
tensors[2].data = tensors[2].data.to(torch.int32)
check("dtype"); assert reader.state()[2] != kinds
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    values = torch.randn(37).to(dtype)
    assert module.all_finite(values) is True, dtype
    for bad in (float("nan"), float("inf"), float("-inf")):
        spoiled = values.clone(); spoiled[29] = bad
        assert module.all_finite(spoiled) is False, (dtype, bad)
assert module.all_finite(torch.empty(0)) is True and module.all_finite(torch.ones(4, 4).t()) is None
assert module.all_finite(torch.ones(3, dtype=torch.int64)) is None
try:
    with torch.inference_mode():
        module.StateReader([torch.ones(1)])
    raise SystemExit("an inference tensor was accepted")
except TypeError:
    pass
print("ok")
"""


def state_reader(tensors: list[torch.Tensor]) -> Callable[[], tuple[int, int, int]] | None:
    """A callable returning ``(sum of version counters, sum of data pointers, sum of dtype/device codes)`` of
    ``tensors`` (the list as given now; the reader keeps references to them), or None where the extension is off or
    unavailable (NOTE [native watch]) or a tensor has no version counter (an inference tensor). The first call in a
    process may build the extension (seconds, once per machine and torch version)."""
    module = native_module()
    if module is None or not tensors:
        return None
    try:
        return module.StateReader(tensors).state
    except TypeError as error:
        logger.debug("native weight watch not used for this module: %s", error)
        return None


def all_finite_check() -> Callable[[torch.Tensor], bool | None] | None:
    """The extension's ``all_finite(tensor)``: True/False for a contiguous CPU tensor of a floating dtype (False: it
    holds nan or inf), None where it cannot tell (the caller then asks torch); None itself where the extension is off
    or unavailable. For the value gate (NOTE [value gate] in :mod:`aitune.torch.backend.accepted`): one C call
    instead of a torch reduction and a read of its result. May build the extension (see :func:`state_reader`)."""
    module = native_module()
    return getattr(module, "all_finite", None) if module is not None else None


def native_module():
    """The imported extension, or None (why: :func:`native_status`). Built, checked and imported at the first call
    of the process."""
    if "module" not in _STATE:
        with _LOCK:
            if "module" not in _STATE:
                module, reason = _load()
                _STATE["reason"] = reason
                _STATE["module"] = module
    return _STATE["module"]


def native_status() -> str:
    """One line for ``aitune env``: whether the native watch is in use here, or why not."""
    module = native_module()
    return "in use (one C call per served call)" if module is not None else \
        f"not in use: {_STATE.get('reason')}; the watch reads from Python"


def native_dir() -> Path:
    """Where builds are kept: ``$AITUNE_NATIVE_DIR``, else ``<cache_dir>/native`` (``ait.config.cache_dir``)."""
    if os.environ.get(DIR_VARIABLE):
        return Path(os.environ[DIR_VARIABLE]).expanduser()
    return Path(config.cache_dir) / "native"


def _load():
    """``(module, None)`` or ``(None, why)``."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return None, f"switched off by {ENV_SWITCH}"
    if not sys.platform.startswith("linux"):
        return None, f"built on Linux only (this is {sys.platform})"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    torch_root = Path(torch.__file__).parent
    if compiler is None:
        return None, "no C++ compiler found (set $CXX or install g++)"
    if not (torch_root / "include" / "torch" / "csrc" / "autograd" / "python_variable.h").exists():
        return None, f"torch's C++ headers are missing under {torch_root / 'include'}"
    directory = native_dir() / _key(compiler)
    library = directory / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    verdict_path = directory / "verdict.json"
    verdict = _read_verdict(verdict_path)
    if verdict is None:
        verdict = _build_and_check(compiler, torch_root, directory, library)
        _write_verdict(verdict_path, verdict)
    if not verdict.get("ok"):
        return None, f"{verdict.get('reason', 'failed')} (kept in {verdict_path}; delete it to try again)"
    try:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as error:
        return None, f"importing {library} failed: {error}"
    return module, None


def _key(compiler: str) -> str:
    facts = [SOURCE.read_bytes().hex(), torch.__version__, sysconfig.get_config_var("EXT_SUFFIX") or "",
             str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")), compiler, sys.version]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def _read_verdict(path: Path) -> dict | None:
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) else None


def _write_verdict(path: Path, verdict: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        temporary.write_text(json.dumps(verdict, indent=1))
        os.replace(temporary, path)
    except OSError as error:
        logger.debug("could not keep the native watch's verdict in %s: %s", path, error)


def _build_and_check(compiler: str, torch_root: Path, directory: Path, library: Path) -> dict:
    """Compile into a private name, check it in a child process, then move it into place (atomic: processes that
    build at the same time each move a complete library)."""
    started = time.perf_counter()
    logger.info("building aitune's native weight watch once for torch %s (NOTE [native watch]; seconds)",
                torch.__version__)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return {"ok": False, "reason": f"cannot write {directory}: {error}"}
    private = directory / f".build-{uuid.uuid4().hex}{library.suffix}"
    lib = torch_root / "lib"
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    command = [compiler, "-O3", "-shared", "-fPIC", "-w", *([f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}"] if abi is not None
                                                           else []),
               f"-I{torch_root / 'include'}", f"-I{torch_root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
               f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(private), f"-L{lib}",
               "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    log = []
    try:
        for standard in ("-std=c++20", "-std=c++17"):  # (torch's own extensions build with C++20 since 2.10)
            result = subprocess.run([command[0], standard, *command[1:]], capture_output=True, text=True,
                                    timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
            log.append(result.stderr[-2000:])
            if result.returncode == 0:
                break
        else:
            return {"ok": False, "reason": f"the C++ build failed: {log[-1].strip().splitlines()[-1:]}",
                    "log": log}
        check = subprocess.run([sys.executable, "-c", _CHECK, str(private)], capture_output=True, text=True,
                               timeout=CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if check.returncode != 0 or check.stdout.strip() != "ok":
            return {"ok": False, "reason": f"its check in a child process failed (exit {check.returncode}): "
                                           f"{(check.stderr.strip().splitlines() or [''])[-1][:300]}"}
        os.replace(private, library)
    except subprocess.TimeoutExpired as error:
        return {"ok": False, "reason": f"{error.cmd[0]} ran past {error.timeout} s"}
    except OSError as error:
        return {"ok": False, "reason": f"the build could not run: {error}"}
    finally:
        private.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    logger.info("aitune's native weight watch built and checked in %.1f s", seconds)
    return {"ok": True, "torch": torch.__version__, "build_s": round(seconds, 1)}
