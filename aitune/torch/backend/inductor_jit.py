"""TorchInductorJitBackend: ``torch.compile`` with the Inductor compiler."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from aitune.errors import BackendBuildError, ConfigError, one_line
from aitune.torch.backend.base import Backend, BackendConfig, BuildMode, Check, parse_dtype
from aitune.torch.backend.compile_settings import parameter_freezing, resolved_dynamic
from aitune.torch.common.requirements import validate_flags
from aitune.torch.config import config as aitune_config
from aitune.torch.backend.eager import AutocastMixin
from aitune.torch.common.dtypes import is_fp32_model
from aitune.torch.common.environment import native_bf16
from aitune.torch.backend.cuda_graphs import CUDAGraphRunner
from aitune.torch.backend.decode_graphs import DecodeGraphs, captures_cache
from aitune.torch.check.baked_state import forward_hooks
from aitune.torch.check.guard import watch_registrations
from aitune.torch.record.llm import DECODE, PREFILL, find_cache, folds_state, is_kv_cache
from aitune.torch.record.pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def graph_break_count() -> int:
    """Total graph breaks dynamo has counted in this process so far."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def clone_output(output: Any) -> Any:
    """Clone every tensor of an output so later calls cannot overwrite it (the next CUDA-graph replay reuses
    the output buffers; pytorch/pytorch#144386). A key/value cache in the output is returned as it is.

    NOTE [fresh model outputs]: a transformers ``ModelOutput`` (a dict subclass built by the model's forward, so by
    the compiled graph anew at every call) whose values are tensors, None or caches gets its tensors replaced in
    place: rebuilding it (flatten/unflatten, or a copy) runs its ``__post_init__`` and cost ~13 µs of host time per
    call against ~3 µs (a decoder's output at every generated token; this project's CPU)."""
    if isinstance(output, torch.Tensor):  # the common case, without flattening
        return output.clone()
    if (isinstance(output, dict) and type(output).__module__.startswith("transformers.")
            and all(isinstance(value, torch.Tensor) or value is None or is_kv_cache(value)
                    for value in output.values())):
        for key in [key for key, value in output.items() if isinstance(value, torch.Tensor)]:
            output[key] = output[key].clone()
        return output
    # a key/value cache in the output is the caller's own, updated in place: returned as it is (a copy would
    # give generate another cache object, at other addresses, at every step)
    leaves, spec = tree_flatten(output, is_leaf=is_kv_cache)
    return tree_unflatten(spec, [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])


def uses_cuda_graphs(mode: str | None, options: dict | None) -> bool:
    """Does ``torch.compile(mode=..., options=...)`` capture CUDA graphs (reduce-overhead, max-autotune)?"""
    return mode in ("reduce-overhead", "max-autotune") or bool((options or {}).get("triton.cudagraphs"))


MEMORY_FORMATS = (None, "channels_last")
_NO_CONTEXT = contextlib.nullcontext()  # reusable and re-entrant
RECOMPILE_LIMIT = 64


def allow_many_variants() -> None:
    """NOTE [recompile limit]: dynamo keeps at most ``recompile_limit`` (8) compiled entries per code object,
    and every ``torch.compile`` variant of one module (mode, freezing, memory format, a quantized copy)
    counts. A search compiles one module several ways, so beyond 8 the later variants — and new shapes of
    the chosen one after tuning — would silently run eagerly. aitune raises the limit to 64 (never lowers
    it) for the process. It also installs the weight watch's registration hooks, which Dynamo guards on."""
    import torch._dynamo.config as dynamo_config

    watch_registrations()  # (before any aitune compile: NOTE [registration hooks before compiling])
    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(dynamo_config, name, RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
            setattr(dynamo_config, name, RECOMPILE_LIMIT)


def has_4d_convolution(module: torch.nn.Module, graph) -> bool:
    """A model for which ``channels_last`` is worth trying: a 2-D convolution and a 4-D floating input."""
    if not any(isinstance(sub, torch.nn.Conv2d) for sub in module.modules()):
        return False
    return any(len(spec.min_shape) == 4 and spec.dtype.is_floating_point for spec in graph.tensor_specs)


def has_1x1_convolution(module: torch.nn.Module) -> bool:
    """A 2-D convolution Inductor's ``conv_1x1_as_mm`` lowers to a matrix multiply: 1x1 kernel, stride 1, no
    padding or dilation, one group (``torch/_inductor/kernel/conv.py``)."""
    return any(isinstance(sub, torch.nn.Conv2d) and sub.kernel_size == (1, 1) and sub.stride == (1, 1)
               and sub.dilation == (1, 1) and sub.groups == 1 and sub.padding in ((0, 0), "valid")
               for sub in module.modules())


# reduce-overhead's own options (``torch._inductor.list_mode_options("reduce-overhead")``) plus 1x1
# convolutions as matrix multiplies: ``mode`` and ``options`` cannot be combined (``torch.compile``)
REDUCE_OVERHEAD_1X1_AS_MM = {"triton.cudagraphs": True, "conv_1x1_as_mm": True}
# NOTE [a C++ wrapper for phase graphs on CPU]: a decoder's prefill and decode graphs launch many small kernels per
# call (one token, or a short prompt, through every layer), and on CPU the Python wrapper Inductor generates around
# them is a large share of a call. Inductor's ``cpp_wrapper`` generates that wrapper in C++: the tiny test decoder's
# decode step took 364 µs against 503 µs, its prefill (dynamic) 614 against 707 µs (this project's CPU, torch 2.13;
# benchmarks/cpu_phase_steps.py). Its compile adds a C++ build of the wrapper: a re-tune took 13.2 s against 11.1 s,
# a tune from cold compile caches 22.5 s (benchmarks/RESULTS.md). So on CPU a phase graph's first variant compiles
# with it, and the plain compile is the fallback variant, built where the C++ wrapper's variant fails its build or
# its checks (a C++ wrapper variant that passes but is slower than eager does not bring the plain one in).
CPP_WRAPPER = {"cpp_wrapper": True}


def to_contiguous(value: Any) -> Any:
    """Channels-last 4-D tensors of an output back to contiguous (eager's layout for contiguous inputs)."""
    if isinstance(value, torch.Tensor):
        return value.contiguous() if value.dim() == 4 and not value.is_contiguous() else value
    leaves, spec = tree_flatten(value)
    return tree_unflatten(spec, [leaf.contiguous() if isinstance(leaf, torch.Tensor) and leaf.dim() == 4
                                 and not leaf.is_contiguous() else leaf for leaf in leaves])


@dataclasses.dataclass(kw_only=True)
class TorchInductorJitBackendConfig(BackendConfig):
    """Config of :class:`TorchInductorJitBackend` (arguments of ``torch.compile``).

    Args:
        mode: ``default``, ``reduce-overhead`` (CUDA graphs), ``max-autotune``,
            ``max-autotune-no-cudagraphs`` or None. Mutually exclusive with ``options``.
        options: Inductor options dict (``torch.compile(options=...)``).
        fullgraph: fail on any graph break instead of falling back to Python.
        dynamic: True/False as in ``torch.compile``; None = True when the graph has dynamic axes, except for
            a ``decode`` graph: False (NOTE [decode per cache length]).
        autocast_enabled / autocast_dtype: as in :class:`TorchEagerBackendConfig`.
        freezing: Inductor's inference weight folding (``options["freezing"]``, combined with ``mode``'s own
            options): parameters become constants of the compiled graph, so the build bakes the weights in
            (weights changed later make it stale, see ``Backend.bakes_weights``).
        memory_format: ``"channels_last"``: compile a channels-last copy of the module (inputs are passed as
            given: the compiled graph converts them where the first convolution needs it; 4-D outputs are
            returned contiguous, as eager's); None = as given.
        capture_cuda_graphs: CUDA only: compile without CUDA graphs of Inductor's own and with ``fullgraph``, and
            capture each call shape into one ``torch.cuda.CUDAGraph`` that aitune replays (NOTE [captured CUDA
            graphs] in :mod:`aitune.torch.backend.decode_graphs`): for a graph without a key/value cache the inputs
            are copied into the graph's buffers (:class:`~aitune.torch.backend.cuda_graphs.CUDAGraphRunner`; not for
            a graph that changes its inputs in place); for an LLM's decode graph with a static cache the cache's
            tensors are read and written in place (:class:`~aitune.torch.backend.decode_graphs.DecodeGraphs`).
            Needs a mode without CUDA graphs (None, ``default``, ``max-autotune-no-cudagraphs``).
    """

    mode: str | None = None
    options: dict | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    autocast_enabled: bool = False
    autocast_dtype: torch.dtype | str | None = None
    freezing: bool = False
    memory_format: str | None = None
    capture_cuda_graphs: bool = False

    def validate(self) -> None:
        if self.memory_format not in MEMORY_FORMATS:
            raise ConfigError(f"memory_format must be one of {MEMORY_FORMATS}, got {self.memory_format!r}")
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise ConfigError(f"mode must be one of {COMPILE_MODES} or None, got {self.mode!r}")
        if self.mode is not None and self.options:
            raise ConfigError("torch.compile takes either mode or options, not both: drop one of them")
        if self.options is not None and not isinstance(self.options, dict):
            raise ConfigError(f"options must be a dict of Inductor options, got {type(self.options).__name__}")
        validate_flags(self, ("fullgraph", "autocast_enabled", "freezing", "capture_cuda_graphs"))
        if self.capture_cuda_graphs and uses_cuda_graphs(self.mode, self.options):
            raise ConfigError("capture_cuda_graphs captures the compiled call into CUDA graphs itself: use a mode "
                              "without CUDA graphs (None, 'default', 'max-autotune-no-cudagraphs')")
        self.autocast_dtype = parse_dtype(self.autocast_dtype, "autocast_dtype")

    def compile_arguments(self) -> tuple[str | None, dict | None]:
        """``(mode, options)`` for ``torch.compile``: with ``freezing`` the mode's options plus freezing."""
        return compile_arguments(self.mode, self.options, self.freezing)


def compile_arguments(mode: str | None, options: dict | None, freezing: bool) -> tuple[str | None, dict | None]:
    """``torch.compile`` takes a mode or options, not both: with ``freezing`` the mode becomes its options
    (``torch._inductor.list_mode_options``) plus ``freezing=True``.

    The options alone apply freezing only half-way: trace the first calls inside
    :func:`~aitune.torch.backend.compile_settings.parameter_freezing`
    (NOTE [freezing is decided while Dynamo traces])."""
    if not freezing:
        return mode, options
    from torch._inductor import list_mode_options

    return None, {**list_mode_options(mode or "default"), **(options or {}), "freezing": True}


def fresh_state_copy(module: torch.nn.Module) -> torch.nn.Module:
    """The module's structure with new parameter and buffer objects that share the original storage (no data
    copied; the user's module is not changed).

    NOTE [a frozen compile per build]: Dynamo keeps compiled code per code object (``forward.__code__``), and
    two ``torch.compile`` calls with the same mode and options share those entries. A frozen entry guards on
    the *identity* of the parameters whose values it folded in, so after ``load_state_dict`` (same objects,
    new values) a re-tune's build would reuse the old entry with the old weights folded in
    (``tests/unit/test_search.py::test_a_frozen_variant_retuned_after_new_weights_uses_them``).
    Compiling a copy whose tensors are new objects makes every build trace afresh.
    """
    import copy

    memo = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in memo:
            fresh = tensor.detach()
            if isinstance(tensor, torch.nn.Parameter):
                fresh = torch.nn.Parameter(fresh, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = fresh
    return copy.deepcopy(module, memo)


class TorchInductorJitBackend(AutocastMixin, Backend):
    """``torch.compile(module, backend="inductor")``, warmed up on every recorded sample at build.

    Wraps: TorchInductor (CPU: C++/OpenMP; CUDA: Triton). Extra: none (torch only).
    ``mode="reduce-overhead"`` captures CUDA graphs; outputs are then cloned so they stay valid (the next
    replay reuses the output buffers; pytorch/pytorch#144386).
    Known limitations: graph breaks fall back to Python (counted in ``build_info["graph_breaks"]``);
    shapes outside the recorded range may recompile. Checkpoints keep weights + samples and recompile on load.
    """

    _channels_last = False
    _freezing = contextlib.nullcontext()  # parameter_freezing(...) once built
    _bare = False  # NOTE [a bare served call]
    _own_copy = False  # the compile took a copy of the module (runs_own_copy)
    _graphs = None  # with capture_cuda_graphs: DecodeGraphs (a decode graph), else CUDAGraphRunner

    name = "inductor_jit"
    config_class = TorchInductorJitBackendConfig
    build_mode = BuildMode.JIT
    rank = 20
    default_search_position = 10  # in the default search (Backend.default_search_position)

    @property
    def bakes_weights(self) -> bool:
        """Inductor reads the parameters at every call, except with ``freezing`` (weights folded in), a
        channels-last copy of the module, or ``capture_cuda_graphs`` (the captured graphs read the weights where they
        were at capture)."""
        return folds_state(self.config) or bool(self.config.memory_format) or self.config.capture_cuda_graphs

    @property
    def cuda_graph_stats(self) -> dict | None:
        """With ``capture_cuda_graphs``, once built: a copy of its graphs' counters (``captures``, ``replays``, ...;
        ``DecodeGraphs.stats``/``CUDAGraphRunner.stats``), counted since the build (the tune's own calls included)."""
        return dict(self._graphs.stats) if self._graphs is not None else None

    @property
    def runs_own_copy(self) -> bool:
        """A channels-last or frozen build compiles a copy of the module (a frozen build whose copy failed compiles
        the user's module itself, and a call that recompiles would trace it)."""
        return self._own_copy

    def search_space(self, module, graph, device) -> list["Backend"]:
        """The configurations worth trying. On CPU: plain and with ``freezing``, and for models
        with 2-D convolutions and 4-D inputs also freezing + channels-last, all in the first tier (no
        max-autotune: on CPU it keeps MKL's linear kernels and gains nothing).

        On CUDA, for a graph without a dynamic axis (one input shape recorded, no batch axis): freezing with aitune's
        own CUDA graphs (``capture_cuda_graphs``, NOTE [captured CUDA graphs]; for a convnet with channels-last) and
        reduce-overhead (Inductor's CUDA graphs) with freezing, measured side by side; reduce-overhead without
        freezing as the fallback (:attr:`Backend.search_fallback`: built by default only when no variant before it
        passes its checks); then — with a time budget — the other variants below. Measured on an H100
        (``benchmarks/gpu_captured.py``, benchmarks/RESULTS.md, 2026-12-07): ResNet-50 b1 fp16 captured + freezing +
        channels-last 1.15x the hand-picked reduce-overhead + freezing + channels-last; BERT-base b32 captured +
        freezing 1.22x hand-picked reduce-overhead, aitune's reduce-overhead + freezing 1.06x: the same kernels, less
        host work per call. With a dynamic axis (the runner captures any shape it meets, a graph and memory pool
        each, eight kept, and captures anew past them): reduce-overhead with freezing, reduce-overhead without it as
        the fallback, then — with a time budget — the captured variant, channels-last (with freezing) for convnets,
        default mode, and the max-autotune modes (expensive).

        Reduce-overhead without freezing did not win a measured tune against it on ResNet-50 or BERT-base fp16
        (``benchmarks/gpu_search.py``), and building it costs seconds of every default tune.

        An fp32 model on hardware with native bf16 (:func:`native_bf16`) also gets a bf16-autocast variant
        (with freezing; reduce-overhead on CUDA). It reduces precision (:attr:`reduces_precision`), so it is
        selected only when the strategy allows that; otherwise its row shows what it would give. On a CPU
        with AMX it can be several times faster than exact fp32 on a transformer encoder, at a cosine close to 1
        (``benchmarks/cpu_search.py``).

        On CUDA, a model with 1x1 convolutions (:func:`has_1x1_convolution`) also gets reduce-overhead + freezing
        with Inductor's ``conv_1x1_as_mm`` (those convolutions become matrix multiplies: cuBLAS instead of cuDNN)
        in the first tier where reduce-overhead leads (a dynamic axis), an extra otherwise. Which of the two wins
        depends on the batch: on ResNet-50 fp16 it can be a few percent faster at batch 1 and slower at batch 32,
        with the same error vs eager
        (``benchmarks/gpu_conv_options.py``).

        A language model's phase graph (prefill or decode) compiles without freezing (its key/value cache is
        written in place); on CPU its first variant uses Inductor's C++ wrapper (``cpp_wrapper``), with the plain
        compile as its fallback (NOTE [a C++ wrapper for phase graphs on CPU]); on CUDA a decode graph with a static
        cache gets ``capture_cuda_graphs`` first and reduce-overhead as its fallback."""
        config = self.config
        if config != TorchInductorJitBackendConfig():  # a configuration the user chose is tried as given
            return [self]
        device = torch.device(device)
        first_tier = 1  # on CUDA, the first configurations are tried by default, the others with a budget
        if device.type == "cuda":  # reduce-overhead without freezing: the fallback (docstring)
            configs = [dict(mode="reduce-overhead", freezing=True), dict(mode="reduce-overhead"), dict(),
                       dict(mode="max-autotune-no-cudagraphs", freezing=True), dict(mode="max-autotune", freezing=True)]
            conv = module is not None and graph is not None and has_4d_convolution(module, graph)
            if conv:
                configs.insert(2, dict(mode="reduce-overhead", freezing=True, memory_format="channels_last"))
                if has_1x1_convolution(module):  # first tier too: which wins depends on the batch (docstring)
                    configs.insert(1, dict(options=dict(REDUCE_OVERHEAD_1X1_AS_MM), freezing=True))
                    first_tier = 2
            # NOTE [captured CUDA graphs]: the same kernels as reduce-overhead + freezing, less host time per call
            captured = dict(capture_cuda_graphs=True, freezing=True, fullgraph=True)
            if graph is not None and not graph.is_dynamic:  # (one recorded shape: a shape that differs is dynamic)
                # beside reduce-overhead + freezing in the first tier (docstring); the 1x1 variant an extra
                head, fallback, rest = configs[:first_tier], configs[first_tier], configs[first_tier + 1:]
                lead = dict(captured, memory_format="channels_last") if conv else captured
                configs = [lead, head[0], fallback, *([captured] if conv else []), *head[1:], *rest]
                first_tier = 2
            else:  # a dynamic axis: a graph per shape met, eight kept (docstring); an extra
                configs.insert(first_tier + 1, captured)
        else:
            configs = [dict(), dict(freezing=True)]
            if module is not None and graph is not None and has_4d_convolution(module, graph):
                configs.append(dict(freezing=True, memory_format="channels_last"))
        if is_fp32_model(module) and native_bf16(device):
            base = dict(mode="reduce-overhead") if device.type == "cuda" else {}
            configs.append(dict(base, freezing=True, autocast_enabled=True, autocast_dtype=torch.bfloat16))
        if getattr(graph, "phase", None) is not None:  # no freezing with a key/value cache (FROZEN_CACHE_REASON)
            configs = [kwargs for kwargs in configs if not kwargs.get("freezing")] or [dict(mode="reduce-overhead")]
            first_tier = 1
            if graph.phase == PREFILL and device.type == "cuda":  # no CUDA graphs (NOTE [no CUDA graphs for prefill])
                configs = [dict()]
            elif graph.phase == DECODE and device.type == "cuda" and graph.samples and captures_cache(
                    find_cache(graph.samples[0].kwargs, graph.samples[0].args)):  # NOTE [captured CUDA graphs]
                configs = [dict(capture_cuda_graphs=True, fullgraph=True), *configs]
            elif device.type == "cpu":  # NOTE [a C++ wrapper for phase graphs on CPU]
                configs = [dict(options=dict(CPP_WRAPPER)), *configs]
        variants = [TorchInductorJitBackend(TorchInductorJitBackendConfig(**kwargs)) for kwargs in configs]
        # on CUDA, and for a phase graph on CPU (the plain compile after the C++ wrapper's; a CUDA prefill graph has
        # one variant), the variants after the first tier need a budget, the first of them the fallback
        if (device.type == "cuda" or getattr(graph, "phase", None) is not None) and len(variants) > first_tier:
            for variant in variants[first_tier:]:  # with a time budget: channels-last, default mode (bf16
                if not variant.config.autocast_enabled:  # tensor cores, the largest win for an fp32 model, always)
                    variant._tier = 1
            variants[first_tier]._fallback = True
        return variants

    @property
    def search_tier(self) -> int:
        """max-autotune modes benchmark many kernels while compiling (minutes on a large model): tier 2. On
        CUDA, the first tier of :meth:`search_space` is tried by default (its fallback when none passes) and the
        other variants (channels-last, default mode) are extras (tier 1): on ResNet-50 fp16 they rarely beat
        reduce-overhead + freezing (``benchmarks/gpu_channels_last.py``), and each variant costs a compile. See
        :meth:`Backend.search_tier`."""
        if (self.config.mode or "").startswith("max-autotune"):
            return 2
        return self._tier

    def _supports(self, module, graph, device) -> Check:
        if uses_cuda_graphs(self.config.mode, self.config.options) and device.type != "cuda":
            return Check(False, f"mode {self.config.mode!r} captures CUDA graphs and needs a CUDA device")
        if self.config.capture_cuda_graphs:
            if device.type != "cuda":
                return Check(False, "capture_cuda_graphs captures CUDA graphs and needs a CUDA device")
            phase = getattr(graph, "phase", None)
            sample = graph.samples[0] if graph is not None and graph.samples else None
            if phase is not None and (phase != DECODE or sample is None or not captures_cache(
                    find_cache(sample.kwargs, sample.args))):
                return Check(False, "capture_cuda_graphs serves an LLM's decode graph with a static key/value cache "
                                    "of full-attention layers (transformers' StaticLayer), not this phase or cache")
            if graph is not None and any(path != graph.cache_input for path in graph.mutated_inputs):
                return Check(False, "capture_cuda_graphs replays on copies of the inputs (a key/value cache's tensors "
                                    "excepted): a graph that changes other inputs in place would not change the "
                                    "caller's")
            if module is not None and forward_hooks(module):  # (the calls would all run eager: BakedState)
                return Check(False, "forward hooks are registered on the module: a captured graph never runs them")
        if self.config.memory_format == "channels_last" and (graph is None or not any(
                len(spec.min_shape) == 4 for spec in graph.tensor_specs)):
            return Check(False, "memory_format='channels_last' needs a 4-D input")
        return Check(True)

    def _build(self, module, graph, device, workdir: Path) -> None:
        self._probe_output_dtypes(module, graph)
        self._clone_outputs = uses_cuda_graphs(self.config.mode, self.config.options)
        dynamic = resolved_dynamic(self.config.dynamic, graph)
        self.build_info["dynamic"] = dynamic
        self._channels_last = self.config.memory_format == "channels_last"
        mode, options = self.config.compile_arguments()
        frozen = bool((options or {}).get("freezing"))
        self._own_copy = False
        if self._channels_last:  # NOTE: a copy; the user's module keeps its memory format
            import copy

            module = copy.deepcopy(module).to(memory_format=torch.channels_last)
            self._own_copy = True
        elif frozen:
            try:
                module = fresh_state_copy(module)
                self._own_copy = True
            except Exception as exc:  # noqa: BLE001 - a module deepcopy refuses: compile it as it is
                # (a later re-tune's build may then reuse folded old weights; the check against eager rejects it)
                self.build_info["frozen_copy_failed"] = f"{type(exc).__name__}: {exc}"
        self._freezing = parameter_freezing(frozen)
        captured = self.config.capture_cuda_graphs
        self._bare = not (self._clone_outputs or self._channels_last or frozen or self.config.autocast_enabled
                          or self._restore_dtypes is not None or captured)
        allow_many_variants()
        self._compiled = torch.compile(module, backend="inductor", mode=mode, options=options,
                                       fullgraph=self.config.fullgraph or captured, dynamic=dynamic)
        self._graphs = None
        if captured:  # NOTE [captured CUDA graphs]
            self._graphs = DecodeGraphs(self._compiled, graph.cache_input, name=self.name) \
                if graph.phase == DECODE else CUDAGraphRunner(self._compiled, name=self.name)
        # the captured graphs read the weights at their addresses: their storage stays alive while they may replay
        self._held = [tensor.detach() for tensor in (*module.parameters(), *module.buffers())] if captured else None
        breaks_before = graph_break_count()
        for sample in graph.samples:  # warm-up: compile every recorded shape now, not at first use
            sample = sample.clone()
            self._run(sample.args, sample.kwargs)
        self.build_info["graph_breaks"] = graph_break_count() - breaks_before
        logger.debug("inductor_jit: %d graph breaks during warm-up", self.build_info["graph_breaks"])
        if self._graphs is not None and not self._graphs.enabled:  # (else: the compile without graphs, slower)
            raise BackendBuildError(f"capturing the compiled call into a CUDA graph failed: "
                                    f"{self._graphs.disabled_reason}", backend=self.name)

    def _run(self, args, kwargs, copy: bool = True):
        # NOTE [a bare served call]: without CUDA graphs, autocast, freezing, a channels-last copy or outputs cast
        # back, and with grad mode already off (as ait.Module's calls mostly are), a call is the compiled callable
        # alone: the contexts below, even as no-op ones, cost ~1-3 µs of host time per call on this project's CPU
        # (benchmarks/wrapper_cost.py)
        if self._bare and not torch.is_grad_enabled():
            return self._compiled(*args, **kwargs)
        if self._clone_outputs:
            torch.compiler.cudagraph_mark_step_begin()
        # (a caller already under no_grad, as ait.Module's calls mostly are, does not pay for entering it again)
        with torch.no_grad() if torch.is_grad_enabled() else _NO_CONTEXT, self._autocast(), self._freezing:
            if self._graphs is not None:  # NOTE [captured CUDA graphs]
                if isinstance(self._graphs, DecodeGraphs):  # its outputs are copies where asked
                    return self._restore_output_dtypes(self._graphs(args, kwargs, copy))
                output = self._graphs.call(args, kwargs, copy)  # (copies where asked: NOTE [output copies])
                return self._restore_output_dtypes(to_contiguous(output) if self._channels_last else output)
            output = self._compiled(*args, **kwargs)
        if self._channels_last:
            output = to_contiguous(output)
        if self._clone_outputs and copy:
            output = clone_output(output)
        return self._restore_output_dtypes(output)

    def _infer(self, args, kwargs):
        return self._run(args, kwargs)

    def _deactivate(self) -> None:
        if self._graphs is not None:  # captured again by later calls
            self._graphs.reset()

    def _infer_accepted(self, args, kwargs):
        return self._run(args, kwargs, aitune_config._copy_cuda_graph_outputs)  # served (NOTE [output copies])

    def _load(self, directory, metadata, module, graph, device) -> None:
        if module is None:
            raise ConfigError("the inductor_jit backend recompiles on load and needs the original module")
        try:
            self._build(module, graph, device, directory)
        except Exception as exc:  # noqa: BLE001 - the C++ wrapper's plain fallback, as at tuning
            plain = {key: value for key, value in (self.config.options or {}).items() if key != "cpp_wrapper"}
            if plain == (self.config.options or {}):
                raise
            # where the C++ wrapper's compile fails here (NOTE [a C++ wrapper for phase graphs on CPU]), the plain
            # compile is what the tune's fallback variant would have built
            logger.warning("inductor_jit: compiling with the C++ wrapper failed here (%s); retrying without it",
                           one_line(exc))
            self.config = dataclasses.replace(self.config, options=plain or None)
            self._build(module, graph, device, directory)
            self.build_info["cpp_wrapper_failed"] = one_line(exc)
