"""The stale-weight watch's per-call read (and the value gate's nan/inf check) in one C call, built once per torch
installation.

NOTE [native watch]: :class:`~aitune.torch.check.guard.StateWatch` must notice an in-place edit of any parameter
or buffer at the next call (README, "Weights changed after tuning are noticed"), so it reads every tensor's version
counter on every call. From Python that costs an attribute lookup and an int object per tensor, tens of ns each:
for ResNet-50's 320 parameters and buffers it was the largest stage of the tuned module's host time on a GPU
(``benchmarks/wrapper_cost.py --stages``). PyTorch has no call that reads many version counters at once, and no hook
on in-place writes. ``native_watch.cpp`` is that call: ``StateReader(tensors).state()`` returns the sum of the
version counters and position-weighted sums of the data pointers and dtype/device codes of a fixed list of tensors
(each tensor's current ``TensorImpl`` unpacked per call: one swapped by ``torch.utils.swap_tensors`` is read as it
is now), so the watch also compares every data pointer on every call, where the Python path samples them
(``FULL_SCAN_EVERY``). The walk prefetches the tensors a few places ahead, so that their cache misses overlap:
after a GPU launch, or any work that evicts the caches, the read is otherwise mostly waiting on memory
(``benchmarks/dispatch_host_cost.py --flush``). ``benchmarks/state_watch_cost.py`` times both paths. The same
extension's ``all_finite(tensor)`` serves the value gate's nan/inf check of small CPU inputs (exponent bits, no
torch op); above ``ALL_FINITE_MAX_ELEMENTS`` torch's vectorised, multi-threaded reduction is faster and is used
instead.

How it is built and trusted:

- compiled with the system's C++ compiler (``$CXX``, else ``c++``/``g++``) against the running torch's headers
  (CPython's C API and torch's Python tensor unpacking; tens of seconds, most of it torch's headers), into
  ``<cache_dir>/native/<key>/`` (``$AITUNE_NATIVE_DIR/<key>/`` where set), the key hashing the source, the compile
  flags, the child's check, torch's version and build, Python's ABI tag and the compiler; processes that need it at
  once wait for one build (a file lock);
- then imported in a child process that checks its sums against the ones Python reads, before and after an in-place
  edit, a ``.data`` swap, a ``swap_tensors`` and a dtype change, and ``all_finite`` against torch (an extension
  built against another torch ABI could crash on import: a child's crash is recorded, not the caller's); the verdict
  (``verdict.json``) is kept beside the library, so later processes import it directly. A failed compile or check
  is not retried for that key (delete the verdict to retry); a timeout or a build that could not start is not
  kept;
- built when a tune or ``ait.load`` first needs it (the first tuned module's dispatch keys its calls with it):
  that call waits for the build once per torch installation; ``aitune env --build-native`` builds it ahead;
- only on Linux; ``AITUNE_NATIVE_WATCH=0`` switches it off. Where it is off or cannot be built (no compiler, no
  torch headers), the watch reads from Python as before: the same promises, the pointer scan sampled. ``aitune
  env`` says which.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
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
# all_finite's loop against torch's reduction (a sum and its read, ~2 µs fixed; vectorised and multi-threaded): the
# loop wins on small inputs and loses on image batches (benchmarks/state_watch_cost.py --finite measures both)
ALL_FINITE_MAX_ELEMENTS = 16384
FLAGS = ("-O3", "-shared", "-fPIC", "-w")

_STATE: dict = {}  # "module": the imported extension or None, "reason": why None (once per process)
_LOCK = threading.Lock()

# The child's check: the extension's sums against Python's, before and after each kind of change StateWatch notices.
_CHECK = r"""
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("aitune_native_watch", sys.argv[1])
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
tensors = [torch.nn.Parameter(torch.randn(3, 4)), torch.randn(5)[1:], torch.zeros(2, dtype=torch.int64)]
reader = module.StateReader(tensors)
def weighted(values):
    return sum((i + 1) * value for i, value in enumerate(values)) % 2 ** 64
def python_sums():
    return sum(t._version for t in tensors), weighted(t.data_ptr() for t in tensors)
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
swapped = reader.state()
torch.utils.swap_tensors(tensors[0], torch.nn.Parameter(torch.randn(3, 4)))
check("swap_tensors"); assert reader.state()[1] != swapped[1]
kinds = reader.state()[2]
tensors[2].data = tensors[2].data.to(torch.int32)
check("dtype"); assert reader.state()[2] != kinds
pointers = reader.state()[1]
tensors[2].untyped_storage().resize_(64)
check("storage resized"); assert reader.state()[1] != pointers
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
x = torch.randn(2, 3)
count, parts = module.call_key((x, 2, None), {"flag": True, "y": x.double()})
assert count == 3 and parts[1:4] == ((int, 2), (type(None), None), ("flag", bool, True)), parts
assert parts[0][1:] == (2, 0, -1, 1) and parts[4][0] == "y" and parts[4][2:] == (2, 0, -1, 1), parts
assert parts[0][0] != parts[4][1] and module.call_key((x.clone(), 2, None), {"flag": True, "y": x.double()}) == \
    (count, parts)
assert module.call_key((x, [1]), {}) is None and module.call_key((x.t(),), {})[1][0][1:] == (2, 0, -1, 0)
assert module.call_key((torch.empty(0),), {})[1][0][1:] == (1, 0, -1, 0) and module.call_key((), {}) == (0, ())
assert module.call_key((x.to_sparse(),), {}) is NotImplemented
holder = {"a": 1.5, "b": "text"}
value = holder["a"]
reader = module.AttributeReader([holder, holder], ["a", "b"], [value, holder["b"]], [holder], [2])
assert reader.same() is True
holder["a"] = float("1.5")
assert reader.same() is False
holder["a"] = value; holder["c"] = 0
assert reader.same() is False
del holder["c"]; del holder["b"]
assert reader.same() is False
print("ok")
"""


def state_reader(tensors: list[torch.Tensor]):
    """The extension's ``StateReader`` of ``tensors`` (it keeps references to them), or None where the extension is
    off or unavailable (NOTE [native watch]) or a tensor's facts cannot be read in C (an inference tensor has no
    version counter; a storage kept elsewhere than the tensor's own field, or whose data pointer torch will not hand
    out). Its ``state()`` returns ``(sum of version counters, position-weighted sum of data pointers,
    position-weighted sum of dtype/device codes)`` (ints modulo 2**64). The first call in a process may build the
    extension (once per torch installation)."""
    module = native_module()
    if module is None or not tensors:
        return None
    try:
        return module.StateReader(tensors)
    except TypeError as error:
        logger.debug("native weight watch not used for this module: %s", error)
        return None


def all_finite_check() -> Callable[[torch.Tensor], bool | None] | None:
    """A check of a CPU input for nan/inf for the value gate (NOTE [value gate] in
    :mod:`aitune.torch.backend.accepted`): True/False for a contiguous CPU tensor of a floating dtype with at most
    ``ALL_FINITE_MAX_ELEMENTS`` elements (False: it holds nan or inf), None where it does not answer (the caller then
    asks torch); None itself where the extension is off or unavailable. May build the extension (see
    :func:`state_reader`)."""
    module = native_module()
    native = getattr(module, "all_finite", None) if module is not None else None
    if native is None:
        return None

    def check(tensor: torch.Tensor) -> bool | None:
        return native(tensor) if tensor.numel() <= ALL_FINITE_MAX_ELEMENTS else None

    return check


def call_key_function() -> Callable[[tuple, dict], object] | None:
    """The extension's ``call_key(args, kwargs)`` (NOTE [native call key] in :mod:`aitune.torch.dispatch`), or None
    where the extension is off or unavailable. May build the extension (see :func:`state_reader`)."""
    module = native_module()
    return getattr(module, "call_key", None) if module is not None else None


def attribute_reader(dicts: list[dict], keys: list[str], values: list, sized: list[dict],
                     sizes: list[int]) -> Callable[[], bool] | None:
    """A callable returning True while every ``dicts[i][keys[i]] is values[i]`` and every ``len(sized[j]) ==
    sizes[j]`` (one C call; the reader keeps references to all of them), or None where the extension is off or
    unavailable (NOTE [native attribute check] in :mod:`aitune.torch.check.baked_state`). May build the extension
    (see :func:`state_reader`)."""
    module = native_module()
    if module is None:
        return None
    try:
        return module.AttributeReader(dicts, keys, values, sized, sizes).same
    except TypeError as error:
        logger.debug("native attribute check not used for this module: %s", error)
        return None


def native_module():
    """The imported extension, or None (why: :func:`native_status`). Built, checked and imported at the first call
    of the process; nothing raised on the way reaches the caller (the watch then reads from Python)."""
    if "module" not in _STATE:
        with _LOCK:
            if "module" not in _STATE:
                try:
                    module, reason = _load()
                except Exception as error:  # noqa: BLE001 - a speed-up must never fail the call that wanted it
                    logger.debug("native weight watch unavailable", exc_info=True)
                    module, reason = None, f"{type(error).__name__}: {error}"
                _STATE["reason"] = reason
                _STATE["module"] = module
    return _STATE["module"]


def native_status(build: bool = True) -> str:
    """One line for ``aitune env``: whether the native reader is in use here, or why not. ``build=False``: say so
    where it was not built yet, without building it."""
    if not build and "module" not in _STATE:
        blocked = _unavailable()
        if blocked is not None:
            return f"not in use: {blocked}; the watch reads from Python"
        verdict = _read_verdict(_directory(_compiler()) / "verdict.json")
        if verdict is None:
            return ("not built yet: the first tune or load that needs it builds it (once per torch installation), or "
                    "`aitune env --build-native` now")
    module = native_module()
    return "in use (a served call's route, checks and weight watch in C)" if module is not None else \
        f"not in use: {_STATE.get('reason')}; the watch reads from Python"


def native_dir() -> Path:
    """Where builds are kept: ``$AITUNE_NATIVE_DIR``, else ``<cache_dir>/native`` (``ait.config.cache_dir``)."""
    if os.environ.get(DIR_VARIABLE):
        return Path(os.environ[DIR_VARIABLE]).expanduser()
    return Path(config.cache_dir) / "native"


def _compiler() -> list[str] | None:
    if os.environ.get("CXX", "").strip():
        return shlex.split(os.environ["CXX"])
    found = shutil.which("c++") or shutil.which("g++")
    return [found] if found else None


def _unavailable() -> str | None:
    """Why the extension cannot be used here at all (before any build), or None."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return f"switched off by {ENV_SWITCH}"
    if not sys.platform.startswith("linux"):
        return f"built on Linux only (this is {sys.platform})"
    if _compiler() is None:
        return "no C++ compiler found (set $CXX or install g++)"
    header = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "autograd" / "python_variable.h"
    if not header.exists():
        return f"torch's C++ headers are missing ({header})"
    return None


def _directory(compiler: list[str] | None) -> Path:
    return native_dir() / _key(compiler or [])


def _load():
    """``(module, None)`` or ``(None, why)``."""
    blocked = _unavailable()
    if blocked is not None:
        return None, blocked
    compiler = _compiler()
    directory = _directory(compiler)
    library = directory / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    verdict_path = directory / "verdict.json"
    verdict = _read_verdict(verdict_path)
    if verdict is None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            return None, f"cannot write {directory}: {error}"
        with _build_lock(directory):
            verdict = _read_verdict(verdict_path)  # another process may have built it while this one waited
            if verdict is None:
                verdict = _build_and_check(compiler, directory, library)
                if verdict.get("keep", True):
                    _write_verdict(verdict_path, verdict)
    if not verdict.get("ok"):
        kept = "kept in" if verdict.get("keep", True) else "not kept; tried again by the next process:"
        return None, f"{verdict.get('reason', 'failed')} ({kept} {verdict_path}; delete it to try again)"
    spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, None


@contextlib.contextmanager
def _build_lock(directory: Path):
    """An exclusive lock on ``directory/.lock`` for the build (``fcntl``, Linux); no lock where it cannot be taken."""
    try:
        import fcntl

        handle = open(directory / ".lock", "a+")  # noqa: SIM115 - closed below
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()


def _key(compiler: list[str]) -> str:
    facts = [SOURCE.read_bytes().hex(), " ".join(FLAGS), _CHECK, torch.__version__,
             str(getattr(torch.version, "git_version", "")), str(Path(torch.__file__).parent),
             sysconfig.get_config_var("EXT_SUFFIX") or "", str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")),
             " ".join(compiler), sys.version]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def _read_verdict(path: Path) -> dict | None:
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) else None


def _write_verdict(path: Path, verdict: dict) -> None:
    try:
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        temporary.write_text(json.dumps(verdict, indent=1))
        os.replace(temporary, path)
    except OSError as error:
        logger.debug("could not keep the native watch's verdict in %s: %s", path, error)


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``command`` in its own process group (a timeout kills the compiler's own children too), output as text."""
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, env=_child_environment())
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout.decode(errors="replace"),
                                       stderr.decode(errors="replace"))


def _child_environment() -> dict:
    """The environment of the compiler and of the child check: this one, with this process's import path (the child
    must import the same torch) and without aitune's just-in-time tuning hook."""
    environment = {name: value for name, value in os.environ.items() if name != "AUTOWRAPT_BOOTSTRAP"}
    environment["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    return environment


def _build_and_check(compiler: list[str], directory: Path, library: Path) -> dict:
    """Compile into a private name, check it in a child process, then move it into place. ``keep``: False for a
    failure that may not recur (a timeout, a command that could not start)."""
    started = time.perf_counter()
    logger.info("building aitune's native weight watch once for torch %s (NOTE [native watch]; up to a minute)",
                torch.__version__)
    private = directory / f".build-{uuid.uuid4().hex}{library.suffix}"
    torch_root = Path(torch.__file__).parent
    lib = torch_root / "lib"
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    command = [*compiler, *FLAGS, *([f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}"] if abi is not None else []),
               f"-I{torch_root / 'include'}", f"-I{torch_root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
               f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(private), f"-L{lib}",
               "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    try:
        for standard in ("-std=c++20", "-std=c++17"):  # (torch's own extensions build with C++20 since 2.10)
            result = _run([*compiler, standard, *command[len(compiler):]], BUILD_TIMEOUT_S)
            if result.returncode == 0:
                break
        else:
            lines = result.stderr.strip().splitlines() or ["no output"]
            first_error = next((line for line in lines if "error" in line.lower()), lines[-1]).strip()[:300]
            return {"ok": False, "reason": f"the C++ build failed: {first_error}", "log": result.stderr[-4000:]}
        check = _run([sys.executable, "-c", _CHECK, str(private)], CHECK_TIMEOUT_S)
        if check.returncode != 0 or check.stdout.strip() != "ok":
            last = (check.stderr.strip().splitlines() or [""])[-1][:300]
            return {"ok": False, "reason": f"its check in a child process failed (exit {check.returncode}): {last}"}
        os.replace(private, library)
    except subprocess.TimeoutExpired as error:
        return {"ok": False, "keep": False, "reason": f"{Path(str(error.cmd[0])).name} ran past {error.timeout} s"}
    except OSError as error:
        return {"ok": False, "keep": False, "reason": f"the build could not run: {error}"}
    finally:
        private.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    logger.info("aitune's native weight watch built and checked in %.1f s", seconds)
    return {"ok": True, "torch": torch.__version__, "build_s": round(seconds, 1)}
