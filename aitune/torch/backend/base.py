"""The backend contract: configs, availability, the state machine and the registry.

A backend is a blueprint: strategies copy it (:meth:`Backend.copy`) before each build, so one instance
can serve many modules. Subclasses implement the private hooks ``_build``, ``_infer``, ``_save``,
``_load``, optionally ``_supports``, ``_activate``, ``_deactivate``; every state check lives here.

The config base and the registry live in :mod:`aitune.torch.backend.backend_config` and
:mod:`aitune.torch.backend.registry`; their names stay importable from here.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import logging
import time
import traceback
from pathlib import Path
from typing import Any, ClassVar

import torch

from aitune.errors import BackendBuildError, BackendStateError, BackendUnavailableError, CheckpointError  # noqa: F401
from aitune.errors import ConfigError, one_line  # noqa: F401 - one_line: re-exported
from aitune.torch.backend.backend_config import (  # noqa: F401 - re-exported for backends written against base
    CONFIG_FORMAT_VERSION, BackendConfig, _to_jsonable, parse_dtype)
from aitune.torch.backend.build_log import into_build_log
from aitune.torch.record.llm import cache_object_input, cache_refusal
from aitune.torch.record.onnx_module import onnx_file_refusal
from aitune.torch.common.files import checkpoint_path
from aitune.torch.backend.registry import get_backend_class, register_backend_class  # noqa: F401 - re-exported
from aitune.torch.backend.registry import register_subclass_hook, registered_backends  # noqa: F401 - re-exported
from aitune.torch.common.requirements import (  # noqa: F401 - re-exported for backends written against base
    Check, Requirement, check_requirements, probe_requirement, torch_version_at_least, validate_flags)
from aitune.utils.logging import control_output
from aitune.utils.monitoring import annotate

logger = logging.getLogger(__name__)


class BuildMode(str, enum.Enum):
    """AOT: self-contained artifact. JIT: needs the original module (weights) at run time."""

    AOT = "aot"
    JIT = "jit"


class BackendState(str, enum.Enum):
    """INIT -> (build) ACTIVE <-> INACTIVE; BUILDING while a background build step runs (finish_build ends
    it); CHECKPOINT_LOADED for a restored backend not yet activated."""

    INIT = "init"
    BUILDING = "building"
    ACTIVE = "active"
    INACTIVE = "inactive"
    CHECKPOINT_LOADED = "checkpoint_loaded"


# --------------------------------------------------------------------------------------------- backend


class Backend:
    """Base class of every backend.

    Class attributes set by subclasses:
        name: registry name (``"inductor_jit"``).
        config_class: the ``<Backend>Config`` dataclass.
        build_mode: :class:`BuildMode`.
        requirements: optional packages (:class:`Requirement`).
        device_types: device types it can run on (``{"cpu", "cuda"}``).
        is_quantizing: judged by SQNR/cosine instead of atol/rtol.
        rank: tie-break order (lower = simpler/cheaper); eager is 0.
        default_search_position: where the class's candidates (:meth:`default_candidates`) come in the
            search of a strategy given no backends, lower first; None (default): not in it. Read only from
            the class that sets it, so a subclass joins the default search only by setting its own.
    """

    name: ClassVar[str] = ""
    config_class: ClassVar[type[BackendConfig]] = BackendConfig
    build_mode: ClassVar[BuildMode] = BuildMode.JIT
    requirements: ClassVar[tuple[Requirement, ...]] = ()
    device_types: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    is_quantizing: ClassVar[bool] = False
    rank: ClassVar[int] = 50
    default_search_position: ClassVar[int | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_backend_class(cls)

    @classmethod
    def default_candidates(cls, device: torch.device) -> list["Backend"]:
        """The blueprints this class adds to the default search on ``device``, each then expanded by
        :meth:`search_space`. Default: one with the default config."""
        return [cls()]

    def __new__(cls, *args, **kwargs):
        """Settings passed as keywords (``TorchInductorJitBackend(freezing=True)``) raise a ConfigError that shows
        the config form, instead of Python's ``unexpected keyword argument``."""
        accepted = inspect.signature(cls.__init__).parameters
        unknown = [name for name in kwargs if name not in accepted]
        if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            config_class = cls.config_class
            fields = {field.name for field in dataclasses.fields(config_class)} \
                if dataclasses.is_dataclass(config_class) else set()
            keywords = ", ".join(name for name in accepted if name != "self") or "none"
            if fields and all(name in fields for name in unknown):
                settings = ", ".join(f"{name}={kwargs[name]!r}" for name in unknown)
                raise ConfigError(f"{cls.__name__} takes its settings in a {config_class.__name__}, not as keywords: "
                                  f"write {cls.__name__}({config_class.__name__}({settings})) (keywords of "
                                  f"{cls.__name__}: {keywords})")
            raise ConfigError(f"{cls.__name__} got unknown keyword(s) {', '.join(map(repr, unknown))}: its keywords "
                              f"are {keywords}; its settings ({', '.join(sorted(fields)) or 'none'}) go in a "
                              f"{getattr(config_class, '__name__', 'config')}")
        return super().__new__(cls)

    def __init__(self, config: BackendConfig | None = None):
        if config is None:
            config = self.config_class()
        if not isinstance(config, self.config_class):
            raise ConfigError(f"{type(self).__name__} takes a {self.config_class.__name__}, "
                              f"got {type(config).__name__}")
        self.config = config
        self.state = BackendState.INIT
        self.device: torch.device | None = None
        self.graph = None
        self.module: torch.nn.Module | None = None
        self.workdir: Path | None = None
        self.build_info: dict[str, Any] = {}
        self._pending = None  # a Future of a background build step (see finish_build)

    # ---- identity
    def key(self) -> str:
        return f"{type(self).__name__}_{self.config.key()[:16]}"

    def describe(self) -> str:
        return f"{type(self).__name__}({self.config.describe()})"

    def __repr__(self) -> str:
        return f"<{self.describe()} state={self.state.value}>"

    def copy(self) -> "Backend":
        """A fresh INIT copy of this blueprint (configs are plain data)."""
        return type(self)(copy.deepcopy(self.config))

    # ---- availability / eligibility
    @classmethod
    def availability(cls) -> Check:
        """Are the optional packages importable, at what version. Cached, silent, no side effects."""
        return check_requirements(cls.requirements)

    def supports(self, module: torch.nn.Module, graph, device: torch.device) -> Check:
        """Can this backend build ``module`` for ``graph`` on ``device``? Checked before any build."""
        if (refusal := onnx_file_refusal(module, self)) is not None:
            return Check(False, refusal)
        available = self.availability()
        if not available.ok:
            return available
        device = torch.device(device)
        if device.type not in self.device_types:
            return Check(False, f"runs on {'/'.join(sorted(self.device_types))} only, not {device.type}")
        untunable = getattr(graph, "untunable", None)
        if untunable and not getattr(self, "passthrough", False):
            return Check(False, untunable)
        if cache_object_input(graph) and (reason := cache_refusal(self.build_mode == BuildMode.AOT, self.config)):
            return Check(False, reason)
        return self._supports(module, graph, device)

    def _supports(self, module, graph, device: torch.device) -> Check:
        return Check(True)

    def require_available(self) -> None:
        check = self.availability()
        if not check.ok:
            raise BackendUnavailableError(f"Backend '{self.name}' is unavailable: {check.reason}")

    # ---- lifecycle
    def build(self, module: torch.nn.Module, graph, device: torch.device | str, workdir: Path | str,
              *reference_args, log_file: Path | str | None = None) -> "Backend":
        """INIT -> ACTIVE. Build ``module`` for ``graph`` (its recorded samples) on ``device``.

        Writes files under ``workdir`` and a log to ``workdir/build.log``. Never changes the module's
        parameters, buffers or ``training`` flag, nor the samples. While the backend builds, everything
        written to stdout/stderr (compilers included) goes to the log, and to the console as well with
        ``AITUNE_CONSOLE_OUTPUT=1`` (:func:`aitune.utils.logging.control_output`).

        The reference system's call ``build(module, graph_spec, data, device, cache_dir)`` (custom strategies
        use it) is accepted too: ``data`` must then be the graph's own samples.

        Raises:
            BackendStateError: if not in INIT.
            BackendUnavailableError: if a required package is missing.
            BackendBuildError: on any build failure, the cause chained.
        """
        if isinstance(device, (list, tuple)):  # NOTE [reference build call]: build(module, graph, data, device, dir)
            if not reference_args:
                raise ConfigError("build(module, graph_spec, data, device, cache_dir): cache_dir is missing")
            device, workdir = workdir, reference_args[0]
        elif reference_args:
            raise ConfigError(f"build() takes (module, graph, device, workdir); got {len(reference_args)} extra "
                              "argument(s)")
        if self.state is not BackendState.INIT:
            raise BackendStateError(f"{self.describe()}: build() runs once, from INIT (state: {self.state.value})")
        self.require_available()
        self.device = torch.device(device)
        self.graph = graph
        self.module = module
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_path = Path(log_file) if log_file is not None else self.workdir / "build.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        # Appending: the build's own stdout/stderr (control_output) lands in the same file.
        handler = logging.FileHandler(log_path, mode="a")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package_logger = logging.getLogger("aitune")
        package_logger.addHandler(handler)
        started = time.perf_counter()
        handler.stream.write(f"aitune: building {self.describe()} for {getattr(graph, 'name', '?')} on "
                             f"{self.device} (torch {torch.__version__})\n")
        self._build_started = started
        self._run_build_step(lambda: self._build(module, graph, self.device, self.workdir), handler, log_path)
        if getattr(self, "_pending", None) is not None:
            self.state = BackendState.BUILDING  # a background step runs: finish_build() completes it
            return self
        self.build_info["build_s"] = time.perf_counter() - started
        self.state = BackendState.ACTIVE
        return self

    def finish_build(self) -> "Backend":
        """Wait for a build step started in the background (NOTE [background builds] in
        :mod:`aitune.torch.backend.isolation`) and complete the build: BUILDING -> ACTIVE. No-op in other states.

        Raises:
            BackendBuildError: when the background step failed (the cause chained, build.log appended).
        """
        if self.state is not BackendState.BUILDING:
            return self
        log_path = self.workdir / "build.log"
        handler = logging.FileHandler(log_path, mode="a")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        try:
            self._run_build_step(self._finish_build, handler, log_path)
        finally:
            self._pending = None
        self.build_info["build_s"] = time.perf_counter() - self._build_started
        self.state = BackendState.ACTIVE
        return self

    def _run_build_step(self, step, handler: logging.FileHandler, log_path: Path) -> None:
        """Run a build step with its log in build.log and errors translated at the boundary."""
        package_logger = logging.getLogger("aitune")
        package_logger.addHandler(handler)
        try:
            with torch.no_grad(), annotate(f"build: {self.name}", color="orange"), into_build_log(handler), \
                    control_output(log_path):
                step()
        except BackendBuildError as exc:
            exc.log_path = exc.log_path or log_path
            handler.stream.write("aitune: build failed\n" + traceback.format_exc())
            raise
        except Exception as exc:  # noqa: BLE001 - translated at the boundary, cause chained
            # The full traceback always lands in build.log, whatever the user's logging levels.
            handler.stream.write("aitune: build failed\n" + traceback.format_exc())
            raise BackendBuildError(f"{self.name}: {one_line(exc)}", backend=self.name,
                                    config_key=self.config.key(), log_path=log_path) from exc
        finally:
            package_logger.removeHandler(handler)
            handler.close()

    def search_space(self, module: torch.nn.Module | None, graph, device: torch.device | str) -> list["Backend"]:
        """The configurations of this backend worth trying for ``module``/``graph`` on ``device``
        (docs/adding_a_backend.md, "Variants and the default search"): each one is a candidate and a report row. Default: this blueprint as configured.
        Backends override it to offer variants when they are at their default configuration."""
        return [self]

    @property
    def builds_in_background(self) -> bool:
        """True when this backend's heavy build step runs in a child process and can be started while other
        candidates are evaluated (NOTE [background builds] in :mod:`aitune.torch.backend.isolation`)."""
        return False

    _tier = 0  # set on search-space variants (see search_tier)
    _fallback = False  # set on search-space variants (see search_fallback)

    @property
    def reduces_precision(self) -> bool:
        """Does this backend compute the model's float32 math in a 16-bit float type (autocast to bf16/fp16)?
        Its outputs then differ from eager by design, as a quantizing backend's do, so a strategy selects it only
        when reduced precision is allowed (``allow_reduced_precision``; see :class:`~aitune.torch.TuneStrategy`).
        TF32 (``low_precision`` alone) keeps fp32 storage and accumulation and does not count."""
        return False

    @property
    def search_tier(self) -> int:
        """How much a search may spend on this candidate: 0 = always tried; 1 = an extra variant, tried only
        with an explicit time budget and >= 60 s of it left; 2 = expensive (max-autotune: minutes of kernel
        benchmarking), tried only with >= 300 s left (see ``aitune.torch.search.evaluation.TIER_MIN_S``). A
        ``search_space`` marks its extra variants by setting ``_tier`` on them."""
        return self._tier

    @property
    def search_fallback(self) -> bool:
        """A search-space variant kept as a fallback: an extra (its :attr:`search_tier`) while an earlier
        variant of the same backend class passes its checks in the tune, and tried as a first-tier candidate
        when none did. A ``search_space`` lists it after the variants it backs up and sets ``_fallback``."""
        return self._fallback

    @property
    def expensive(self) -> bool:
        """Builds that take far longer than usual (max-autotune): tried only when the time budget allows."""
        return self.search_tier >= 2

    @property
    def is_jit(self) -> bool:
        """The reference system's name for ``build_mode is BuildMode.JIT`` (needs the original module)."""
        return self.build_mode is BuildMode.JIT

    @property
    def bakes_weights(self) -> bool:
        """True when the built artifact holds a copy of the module's weights (AOT artifacts, quantized copies,
        engines, Inductor ``freezing``): weights changed after tuning make it stale, so ``ait.Module`` runs
        such calls eagerly once it notices (:class:`aitune.torch.check.guard.StateWatch`). JIT backends that read
        the module's own parameters at every call return False."""
        return self.build_mode is BuildMode.AOT

    @property
    def bakes_module_state(self) -> bool:
        """True when the built artifact runs the module as it was at build time rather than reading it at every
        call: submodules' ``training`` flags, attributes ``forward`` reads and hooks are then watched per call,
        and calls that find them changed, or made under the caller's autocast, run eagerly
        (:class:`aitune.torch.check.baked_state.BakedState`). Default: :attr:`bakes_weights` (every artifact that
        copies the weights copies the module)."""
        return self.bakes_weights

    @property
    def runs_own_copy(self) -> bool:
        """True when a served call runs only what the build made (an artifact, an engine, a copy of the module),
        never the user's module: a call made while the module differs from tuning then changes nothing, so its
        module check may follow the launch (NOTE [module check after launch] in aitune/torch/dispatch.py). A
        backend that may trace or capture the live module at a call (a compile, a CUDA-graph capture) is not.
        Default: AOT artifacts."""
        return self.build_mode is BuildMode.AOT

    def accepts(self, leaves: list) -> bool:
        """Can this built backend take a call with these flattened canonical input leaves? See :meth:`rejects`."""
        return self.rejects(leaves) is None

    def rejects(self, leaves: list) -> str | None:
        """Why this built backend cannot take a call with these flattened input leaves, or None (default).

        AOT artifacts name the input outside their accepted range (dtype, device, rank, sizes — see
        :class:`aitune.torch.backend.accepted.AcceptedInputs`); ``ait.Module`` then runs the call eagerly
        and its warning carries this reason. Subclasses override this, not :meth:`accepts`.
        """
        return None

    def __call__(self, *args, **kwargs):
        return self.infer(*args, **kwargs)

    def infer(self, *args, **kwargs):
        """Run inference with the module's call signature; outputs are structured like eager's.

        An INACTIVE backend is reactivated first (see :meth:`run`).

        Raises:
            BackendStateError: when the backend was never built (INIT).
        """
        signature = getattr(self.graph, "signature", None)
        if signature is not None:
            args, kwargs = signature.normalize(args, kwargs)
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict, *, accepted: bool = False):
        """Run a call already normalised to the graph's canonical ``(args, kwargs)`` (``ait.Module``'s hot path).

        Goes through the state machine: an INACTIVE (or CHECKPOINT_LOADED) backend is reactivated first, so
        a module deactivated to free device memory comes back on its next call instead of silently running
        something else. ``accepted=True``: the caller has just had :meth:`rejects` return None for these
        inputs (``ait.Module`` does), so a backend may skip its own copy of that check (:meth:`_infer_accepted`).

        Raises:
            BackendStateError: when the backend was never built (INIT).
        """
        if self.state is not BackendState.ACTIVE:
            if self.state is BackendState.INIT:
                raise BackendStateError(f"{self.describe()}: inference needs a built backend (state: init); call "
                                        "build() or load it from a checkpoint first")
            if self.state is BackendState.BUILDING:
                self.finish_build()
            self.activate()
        return self._infer_accepted(args, kwargs) if accepted else self._infer(args, kwargs)

    def _infer_accepted(self, args: tuple, kwargs: dict):
        """:meth:`_infer` for inputs :meth:`rejects` has accepted; override to skip a duplicate input check."""
        return self._infer(args, kwargs)

    def activate(self) -> None:
        """INACTIVE/CHECKPOINT_LOADED -> ACTIVE (reacquire device memory, reload or recompile)."""
        if self.state is BackendState.ACTIVE:
            return
        if self.state is BackendState.BUILDING:
            self.finish_build()
            return
        if self.state is BackendState.INIT:
            raise BackendStateError(f"{self.describe()}: activate() before build()")
        self._activate()
        self.state = BackendState.ACTIVE

    def deactivate(self) -> None:
        """ACTIVE -> INACTIVE: release what can be reacquired by :meth:`activate`."""
        if self.state is not BackendState.ACTIVE:
            return
        self._deactivate()
        self.state = BackendState.INACTIVE
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- checkpoints
    def save(self, directory: Path) -> dict:
        """Write what is needed to run without re-tuning under ``directory``; returns JSON-able metadata."""
        if self.state not in (BackendState.ACTIVE, BackendState.INACTIVE, BackendState.CHECKPOINT_LOADED):
            raise BackendStateError(f"{self.describe()}: save() needs a built backend")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        return self._save(directory) or {}

    def artifact(self):
        """What another runtime needs to serve this built backend's artifact without aitune (a
        :class:`~aitune.torch.backend.artifact.DeploymentArtifact`), or None: the default, for JIT and eager
        backends, which run the Python module at run time and leave no file that runs on its own."""

    @classmethod
    def artifact_from_metadata(cls, metadata: dict, directory: Path, config: dict, graph):
        """The :meth:`artifact` of a backend :meth:`save` wrote ``metadata`` for, its files in ``directory``
        (``config``: its config's ``to_dict``; ``graph``: a :class:`~aitune.torch.backend.artifact.GraphFacts`)."""

    @classmethod
    def from_checkpoint(cls, directory: Path, config: BackendConfig, metadata: dict, module: torch.nn.Module | None,
                        graph, device: torch.device | str) -> "Backend":
        """Rebuild a backend saved by :meth:`save`, without building it again.

        Args:
            directory: the folder :meth:`save` wrote (for checkpoints: the graph's extracted ``artifacts/``).
            config: the backend's config (from ``BackendConfig.from_dict`` of the stored dict).
            metadata: the JSON-able dict :meth:`save` returned.
            module: the user's module — needed by JIT backends (they recompile it; its weights are used), and
                None when an AOT artifact is loaded on its own (the round-trip check of tuning).
            graph: the :class:`~aitune.torch.record.samples.GraphSpec` restored with its samples (JIT backends
                recompile from them; ``graph.signature`` normalises calls).
            device: where to run (``"cpu"``, ``"cuda:0"``).

        Returns:
            The backend, ACTIVE.

        Raises:
            CheckpointError: a stored file is missing or does not fit (the backend names which).
            BackendUnavailableError / BackendRuntimeError: the runtime cannot load the artifact here.
            Whatever the backend's runtime raises for an artifact it cannot load (callers translate it).
        """
        backend = cls(config)
        backend.device = torch.device(device)
        backend.graph = graph
        backend.module = module
        backend.workdir = Path(directory)
        backend._load(Path(directory), metadata, module, graph, backend.device)
        backend.state = BackendState.ACTIVE
        return backend

    # ---- hooks
    def _build(self, module, graph, device: torch.device, workdir: Path) -> None:
        raise NotImplementedError

    def _infer(self, args: tuple, kwargs: dict):
        raise NotImplementedError

    def _finish_build(self) -> None:
        """Complete a build whose background step ``self._pending`` (a Future) was started by ``_build``."""

    def _activate(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass

    def _save(self, directory: Path) -> dict:
        return {}

    def _load(self, directory: Path, metadata: dict, module, graph, device: torch.device) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be loaded from a checkpoint")

    def _stored_file(self, directory: Path, metadata: dict, key: str, default: str) -> Path:
        """The file ``metadata[key]`` (``default`` when absent) names below ``directory``, checked by
        :func:`~aitune.torch.common.files.checkpoint_path`; CheckpointError when it is not there."""
        name = metadata.get(key, default)
        return checkpoint_path(directory, name, f"{self.name} metadata {key!r}", missing=CheckpointError(
            f"{self.name}: {Path(directory) / str(name)} is missing from the checkpoint"))
