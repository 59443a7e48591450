"""What a tuned backend took for granted when it was built, and a per-call check that it still holds.

A backend that bakes the module in (an exported graph for ONNX Runtime or AOTInductor, a quantized copy, a
frozen or channels-last ``torch.compile`` copy) runs what the module was at build time. Calls the module would
answer differently must run eagerly instead. :class:`BakedState` is captured when a tuned module becomes active
(after tuning, after loading) and asked on every call; :meth:`BakedState.differs` returns why the call must run
eagerly, or None.

What is watched, per backend (NOTE [what a backend follows]):

``grad`` (every backend, plain eager included)
    Backends run under ``no_grad``: with grad mode on and an input or a parameter that requires grad, eager's
    output carries ``grad_fn`` and the call runs eagerly with autograd.
``autocast`` (backends that bake the module in, and those that apply their own autocast)
    The caller's ``torch.autocast`` for the backend's device type: eager's dtypes and values change under it,
    an artifact built without it does not. A plain ``torch.compile`` (Inductor JIT without freezing) follows it
    through Dynamo's guards.
``hooks`` (every backend but plain eager)
    Forward and forward-pre hooks on any submodule, and the global ones of ``torch.nn.modules.module``. A
    baked artifact never runs a Python hook, so a call while any is registered runs eagerly; a compiled module
    that traced the hooks present at build runs eagerly once they differ from those.
``module`` (backends that bake the module in)
    The attributes ``forward`` reads, in every submodule: names found in the code of each submodule class's
    ``forward`` and of the methods and properties it names, transitively (``self._conv_forward`` ->
    ``self.stride``), and names read off any object by any of these classes; ``training`` where the class's
    own code reads it. Plain values (bool, int, float, str, None, enums, tuples) compare by value, other
    objects (tensors that are not parameters or buffers, configs, callables) by identity or their own ``==``;
    tensor attributes' version counters, and attributes added or deleted, count too. One C-level
    ``operator.itemgetter`` per submodule reads its ``__dict__``; the comparison short-cuts on identity. Per call:
    every such attribute of the user's own classes and ``training`` of every submodule; the hyper-parameters of
    ``torch.nn``'s built-in layers (a ``Conv2d``'s ``stride``, a ``BatchNorm``'s ``eps``, a ``LeakyReLU``'s
    ``negative_slope``), set at construction and almost never changed after, and attributes added to or deleted
    from such a layer, only every ``VALUES_CHECK_EVERY`` calls with the sampled values — once one is found
    changed, every call runs eagerly until it is put back.
``stale`` (backends that bake the module in)
    Values of parameters, buffers and tensor attributes edited through ``.data`` (which bumps no version
    counter and keeps the data pointer): a few elements of each CPU tensor, evenly spaced, are compared bit for
    bit with their values at capture every ``VALUES_CHECK_EVERY`` calls (CUDA tensors are not read: that would
    synchronize the device). The other weight changes (in-place edits,
    ``load_state_dict``, ``.to()``) are :class:`aitune.torch.check.guard.StateWatch`'s.

Known limits: an attribute read only by a free function the module passes itself to, or ``training`` read
only from outside the module's class, is not watched; the contents of lists, dicts and other objects held in attributes are not inspected (a list
appended to, a config object's field changed); a ``.data`` edit that touches none of the sampled elements goes
unnoticed, and one that does — like a changed hyper-parameter of a built-in layer — is noticed within
``VALUES_CHECK_EVERY`` calls; state read from globals or from
outside the module is not watched. Inductor JIT without freezing reads the module at every call and Dynamo
guards on what its trace read (training flags, attributes, autocast), so only grad mode and hooks are watched
for it.

Cost per call on CPU: ``benchmarks/baked_state_cost.py`` measures it on a ResNet-50 and a BERT-base sized module,
mostly the attribute comparison; the values check adds its share every ``VALUES_CHECK_EVERY`` calls.
"""

from __future__ import annotations

import enum
import operator
from typing import Any

import torch
import torch.nn.modules.module as nn_module
from torch.utils.hooks import RemovableHandle

from aitune.torch.check.generation_names import generation_bookkeeping
from aitune.torch.check.guard import VERSION, named_state
from aitune.torch.check.native_watch import attribute_reader
from aitune.torch.check.read_names import optional_names, read_names
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.state import MODULE_INTERNALS

VALUES_CHECK_EVERY = 64  # calls between comparisons of sampled weight values (see the module docstring)
RENEWALS = 8  # new readers of equal objects, at most, before the comparison by value runs on every call
SAMPLED_ELEMENTS = 8  # elements per tensor compared by the values check

_INTERNAL = MODULE_INTERNALS - {"training"}  # nn.Module's own bookkeeping; `training` is watched
_PLAIN = (bool, int, float, str, type(None), enum.Enum, torch.dtype, torch.device)
_IMMUTABLE = frozenset({bool, int, float, str, type(None), torch.dtype, torch.device})
_ENUM_EQUALITY = (object.__eq__, enum.Enum.__eq__, int.__eq__, float.__eq__, str.__eq__)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
# is autocast on for any of these device types (one C call, ~0.1 µs; the per-device read only then: ~0.3 µs, torch
# 2.13)? It reads the autocast keys of CPU, CUDA, XPU and HPU among others; MPS and MAIA are read per device
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_ANY_AUTOCAST_COVERS = frozenset({"cpu", "cuda", "xpu", "hpu"})
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Policy:
    """What one backend follows by itself and what must be watched for it (NOTE [what a backend follows])."""

    __slots__ = ("grad_only", "autocast", "hooks", "module", "device_type")

    def __init__(self, backend: Any) -> None:
        passthrough = bool(getattr(backend, "passthrough", False))
        bakes = bool(getattr(backend, "bakes_module_state", getattr(backend, "bakes_weights", False)))
        own_autocast = bool(getattr(getattr(backend, "config", None), "autocast_enabled", False))
        self.grad_only = passthrough
        self.autocast = not passthrough and (bakes or own_autocast)
        self.hooks = not passthrough
        self.module = not passthrough and bakes
        device = getattr(backend, "device", None)
        self.device_type = torch.device(device).type if device is not None else "cpu"


OWN_HOOK_IDS: set[int] = set()  # handle ids of aitune's own global hooks (JIT discovery): not the user's


def forward_hooks(module: torch.nn.Module) -> tuple:
    """The forward/forward-pre hooks registered now on ``module`` or any submodule, and the global ones (aitune's own
    excluded): ``(module index, kind, handle ids)`` per place; empty when there are none."""
    return _hooks_of(list(dict.fromkeys(module.modules())))


def _hooks_of(modules: list[torch.nn.Module]) -> tuple:
    """Every forward/forward-pre hook registered now: ``(module index, kind, handle ids)``, and the global ones
    (except aitune's own, :data:`OWN_HOOK_IDS`)."""
    found = []
    for index, module in enumerate(modules):
        if module._forward_hooks:
            found.append((index, "forward", tuple(module._forward_hooks)))
        if module._forward_pre_hooks:
            found.append((index, "forward pre", tuple(module._forward_pre_hooks)))
    for name in _GLOBAL_HOOKS:
        hooks = getattr(nn_module, name, None)
        if hooks:
            users = tuple(key for key in hooks if key not in OWN_HOOK_IDS)
            if users:
                found.append((-1, name, users))
    return tuple(found)


def _sampled_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """A view of up to SAMPLED_ELEMENTS elements of ``tensor``, evenly spaced, sharing its storage (None for an
    empty tensor or a layout without a flat view)."""
    data = tensor.detach()
    if data.device.type != "cpu":  # comparing would synchronize the device every VALUES_CHECK_EVERY calls
        return None
    if data.numel() == 0 or data.is_meta or data.is_sparse or data.is_quantized or data.element_size() not in _BITS:
        return None
    if data.is_contiguous():
        flat = data.view(-1)
    elif data.dim() == 4 and data.is_contiguous(memory_format=torch.channels_last):
        flat = data.as_strided((data.numel(),), (1,), data.storage_offset())
    else:
        return None
    step = max(1, flat.numel() // SAMPLED_ELEMENTS)
    return flat[::step][:SAMPLED_ELEMENTS].view(_BITS[data.element_size()])  # bits: NaN equals NaN


class BakedState:
    """A module's state as a baked backend took it, captured at activation; :meth:`differs` per call.

    Args:
        module: the user's module (observed, never modified).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.modules = list(dict.fromkeys(module.modules()))
        self.names = [name for name, _ in module.named_modules(remove_duplicate=True)]
        self.parameters = [p for p in module.parameters() if p is not None]
        self.policies: dict[int, tuple[Any, Policy]] = {}
        self.stale: str | None = None
        self.differing = False  # the last module-state check found a difference (see found)
        self.calls = 0
        self._capture_hooks()
        self._capture_attributes()
        self._capture_values()

    # ---- capture
    def _capture_hooks(self) -> None:
        self.hook_handles = RemovableHandle.next_id
        self.hooks = _hooks_of(self.modules)

    def _capture_attributes(self) -> None:
        reads = {klass: read_names(klass) for klass in {type(module) for module in self.modules}}
        elsewhere = frozenset().union(*reads.values()) - {"training"}  # names any of the classes reads off any object
        self.dicts = [vars(module) for module in self.modules]
        self.watched = [sorted(key for key in attributes if key not in _INTERNAL
                               and (key in reads[type(module)] or key in elsewhere))
                        for module, attributes in zip(self.modules, self.dicts)]
        kept = [index for index, keys in enumerate(self.watched) if keys]
        self.watched_index = kept
        self.watched_dicts = [self.dicts[index] for index in kept]
        self.getters = [operator.itemgetter(*self.watched[index]) for index in kept]
        # per call: every watched attribute of the user's own classes, and `training` of torch.nn's built-in
        # layers; their hyper-parameters (a Conv2d's stride, a BatchNorm's eps) only with the sampled values,
        # every VALUES_CHECK_EVERY calls (NOTE [what a backend follows])
        fast = [(index, keys) for index in kept
                if (keys := self.watched[index] if not _built_in(self.modules[index]) else
                    [key for key in self.watched[index] if key == "training"])]
        self.fast_dicts = [self.dicts[index] for index, _ in fast]
        self.fast_keys = [keys for _, keys in fast]
        self.fast_getters = [operator.itemgetter(*keys) for keys in self.fast_keys]
        # attributes added later matter where forward reads a name by string that the module lacks now
        # ... and where forward reads a plain class attribute that an instance attribute may later shadow
        # (torch.nn's built-in layers among them, a third of a ResNet-50's modules, only every VALUES_CHECK_EVERY
        # calls, like their hyper-parameters: counting their attributes on every call was ~11 µs of its ~30)
        sized = [(module, attributes) for module, attributes in zip(self.modules, self.dicts)
                 if not optional_names(type(module)) <= attributes.keys()
                 or _class_defaults(type(module), reads[type(module)]) - attributes.keys()]
        self.sized = [attributes for module, attributes in sized if not _built_in(module)]
        self.sizes = list(map(len, self.sized))
        self.sized_built_in = [attributes for module, attributes in sized if _built_in(module)]
        self.sizes_built_in = list(map(len, self.sized_built_in))
        # which names may come and go, for a count that changed: transformers' own generate bookkeeping on a causal
        # LM (`_previous_max_cache_length`: names GenerationMixin's methods assign), where no class's code reads
        # them (a name read only by a free function the module passes itself to is not in `reads`: any other name
        # counts, as before)
        self.sized_keys = {id(attributes): set(attributes) for _, attributes in sized}
        self.sized_free = {id(attributes): generation_bookkeeping(type(module)) - reads[type(module)] - elsewhere
                           for module, attributes in sized}
        self.attributes = self._attributes()
        self.fast_attributes = self._fast_attributes()
        self.reader_values: list = []  # the objects the reader compares with (set by _attribute_reader)
        self.reader_rebuilds = 0
        self.attribute_reader = self._attribute_reader()
        tensors = [(f"{name}.{key}".lstrip("."), attributes[key])
                   for name, attributes in zip(self.names, self.dicts)
                   for key in attributes if key not in _INTERNAL and isinstance(attributes[key], torch.Tensor)]
        self.tensor_names = [name for name, _ in tensors]
        self.tensor_values = [tensor for _, tensor in tensors]
        self.tensor_version_list = [tensor._version for tensor in self.tensor_values]
        self.tensor_versions = sum(self.tensor_version_list)

    def _attributes(self) -> list | None:
        try:
            return list(map(_CALL, self.getters, self.watched_dicts))
        except KeyError:  # an attribute was deleted
            return None

    def _fast_attributes(self) -> list | None:
        try:
            return list(map(_CALL, self.fast_getters, self.fast_dicts))
        except KeyError:  # an attribute was deleted
            return None

    def _attribute_reader(self):
        """NOTE [native attribute check]: ``fast_getters``' attributes and ``sized``'s counts in one C call, by identity
        with the objects read here (:func:`~aitune.torch.check.native_watch.attribute_reader`; ~7 ns an attribute
        against ~35 for the getters, this project's CPU). False sends the call to the comparison by value; where
        that finds the module as captured, :meth:`_renew_reader` decides whether a reader of the objects there now
        may take over. None: no extension here."""
        dicts, keys, values = [], [], []
        for attributes, names in zip(self.fast_dicts, self.fast_keys):
            for name in names:
                if name not in attributes:
                    return None
                dicts.append(attributes)
                keys.append(name)
                values.append(attributes[name])
        self.reader_values = values
        return attribute_reader(dicts, keys, values, self.sized, self.sizes)

    def _renew_reader(self) -> None:
        """After the reader said False and the comparison by value found the module as captured: a new reader of the
        objects there now, where each object that replaced an equal one, and the one it replaced, is an immutable
        plain value (a mutable one equal now may change in place later, which identity would not see), at most
        ``RENEWALS`` times (an attribute set to an equal new object on every call would rebuild it every call); else
        the comparison by value on every call from now on, as without the extension."""
        before = self.reader_values
        reader = self._attribute_reader() if self.reader_rebuilds < RENEWALS else None
        self.reader_rebuilds += 1
        if reader is None or not all(now is old or (_immutable(now) and _immutable(old))
                                     for now, old in zip(self.reader_values, before)):
            self.attribute_reader = None
            return
        self.attribute_reader = reader

    def _capture_values(self) -> None:
        views = [(name, _sampled_view(tensor)) for name, tensor in self._named_tensors()]
        self.value_names = [name for name, view in views if view is not None]
        self.value_views = [view for _, view in views if view is not None]
        self.values = [view.clone() for view in self.value_views]
        groups: dict[tuple, list[torch.Tensor]] = {}  # one torch.cat per dtype and device: a few ops per check
        for view in self.value_views:
            groups.setdefault((view.dtype, view.device), []).append(view)
        self.value_groups = [(group, torch.cat(group)) for group in groups.values()]

    def _named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return named_state(self.modules[0]) + list(zip(self.tensor_names, self.tensor_values))

    def policy(self, backend: Any) -> Policy:
        """What is watched for ``backend`` (computed once per backend object)."""
        entry = self.policies.get(id(backend))
        if entry is None or entry[0] is not backend:  # an id can be reused once a replaced backend is freed
            entry = self.policies[id(backend)] = (backend, Policy(backend))
        return entry[1]

    # ---- per call
    def differs(self, backend: Any, args: tuple, kwargs: dict, leaves: list | None = None,
                module: bool = True) -> tuple[str, str] | None:
        """Why this call cannot run on ``backend``, as ``(kind, message)`` (kinds: ``grad``, ``autocast``,
        ``hooks``, ``module``, ``stale``), or None when what the backend baked in still holds.

        Args:
            backend: the tuned backend the call would run on.
            args: the call's positional arguments (any nesting).
            kwargs: the call's keyword arguments.
            leaves: every leaf of ``args`` and ``kwargs`` when the caller has them flat already (None: found here).
            module: also check the module's own state (kinds ``module`` and ``stale``); False: the caller asks
                :meth:`module_differs` itself, after the backend was launched (NOTE [module check after launch]
                in aitune/torch/dispatch.py).
        """
        if torch.is_grad_enabled():
            reason = self._needs_grad(args, kwargs, leaves)
            if reason is not None:
                return "grad", reason
        entry = self.policies.get(id(backend))
        policy = entry[1] if entry is not None and entry[0] is backend else self.policy(backend)
        if policy.grad_only:
            return None
        if (policy.autocast and (_ANY_AUTOCAST() or policy.device_type not in _ANY_AUTOCAST_COVERS)
                and torch.is_autocast_enabled(policy.device_type)):
            dtype = str(torch.get_autocast_dtype(policy.device_type)).removeprefix("torch.")
            return "autocast", (f"the call runs under torch.autocast({policy.device_type!r}, dtype={dtype}), which "
                                f"{backend.name} was not built for: eager runs it")
        if policy.hooks and (self.hooks or RemovableHandle.next_id != self.hook_handles):
            reason = self._hooks_differ(policy)
            if reason is not None:
                return "hooks", reason
        if not policy.module or not module:
            return None
        return self.module_differs(backend)

    @property
    def found(self) -> bool:
        """Did the last check of the module's own state find a difference, or any check a ``.data`` edit (which
        stays found)? While it did, the dispatch checks before the launch again (NOTE [module check after
        launch])."""
        return self.stale is not None or self.differing

    def module_differs(self, backend: Any) -> tuple[str, str] | None:
        """The module-state part of :meth:`differs` alone (kinds ``module`` and ``stale``), for a backend whose
        policy watches the module (:attr:`Policy.module`: the caller knows it)."""
        if self.stale is not None:
            return "stale", self.stale
        self.calls += 1
        every = self.calls % VALUES_CHECK_EVERY == 0
        reader = self.attribute_reader
        quiet = reader is not None and reader()  # (NOTE [native attribute check])
        # (each check only where it has something to read: a module of torch.nn's layers alone has none of them)
        if ((not quiet and ((self.sized and list(map(len, self.sized)) != self.sizes and self._counted_names_changed())
                            or (self.fast_getters and not _same(self._fast_attributes(), self.fast_attributes))))
                or (self.tensor_values and sum(map(VERSION, self.tensor_values)) != self.tensor_versions)
                or (every and (not _same(self._attributes(), self.attributes)
                               or (list(map(len, self.sized_built_in)) != self.sizes_built_in
                                   and self._counted_names_changed())))):
            self.calls -= 1  # checked in full again on the next call
            self.differing = True
            return "module", (f"{self._what_attribute_changed()}; {backend.name} baked the module in as it was at "
                              "tuning, so calls run eager while it differs")
        self.differing = False
        if not quiet and reader is not None:  # as captured by value: identities (or counts) to read from now?
            self._renew_reader()
        if every:
            reason = self.values_changed()
            if reason is not None:
                return "stale", reason
        return None

    def _counted_names_changed(self) -> bool:
        """Were attributes other than transformers' generate bookkeeping added or deleted where a watched module's
        attribute count changed? Counts that changed by such names only are taken as they are now."""
        for sized, sizes in ((self.sized, self.sizes), (self.sized_built_in, self.sizes_built_in)):
            for index, attributes in enumerate(sized):
                if len(attributes) != sizes[index]:
                    if not (attributes.keys() ^ self.sized_keys[id(attributes)]) <= self.sized_free[id(attributes)]:
                        return True
                    self.sized_keys[id(attributes)] = set(attributes)
                    sizes[index] = len(attributes)
        return False

    def _needs_grad(self, args: tuple, kwargs: dict, leaves: list | None = None) -> str | None:
        if leaves is None:
            leaves = [*args, *kwargs.values()]
            if not all(isinstance(leaf, torch.Tensor) or type(leaf) in _PLAIN for leaf in leaves):
                leaves = tree_flatten((args, kwargs))[0]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                return "grad mode is on and an input requires grad: eager runs it with autograd"
        if any(map(_REQUIRES_GRAD, self.parameters)):
            return ("grad mode is on and parameters require grad: eager runs it with autograd (call the module under "
                    "torch.inference_mode() or torch.no_grad(), or freeze the parameters, to use the tuned backend)")
        return None

    def _hooks_differ(self, policy: Policy) -> str | None:
        hooks = _hooks_of(self.modules)
        if hooks == self.hooks:
            self.hook_handles = RemovableHandle.next_id  # a handle made elsewhere (another module, a tensor)
            if not hooks or not policy.module:
                return None
        where = ", ".join(f"{kind} hook on {self.names[index] or 'the module' if index >= 0 else 'every module'}"
                          for index, kind, _ in (hooks or self.hooks)[:3])
        if policy.module:
            return f"forward hooks are registered ({where}); a baked artifact never runs them: eager runs the call"
        return f"the forward hooks differ from those at tuning ({where or 'removed'}): eager runs the call"

    def _what_attribute_changed(self) -> str:
        for name, attributes in zip(self.names, self.dicts):
            if any(attributes is sized and len(attributes) != size for sized, size in
                   zip(self.sized + self.sized_built_in, self.sizes + self.sizes_built_in)):
                key = id(attributes)
                changed = ", ".join(sorted((attributes.keys() ^ self.sized_keys[key]) - self.sized_free[key]))
                return f"attributes of {name or 'the module'} were added or deleted since tuning ({changed})"
        for index, before in zip(self.watched_index, self.attributes):
            keys, attributes = self.watched[index], self.dicts[index]
            values = before if len(keys) > 1 else (before,)
            for key, value in zip(keys, values):
                now = attributes.get(key, _DELETED)
                if now is _DELETED:
                    return f"{self.names[index] or 'the module'}.{key} was deleted"
                if not _same([now], [value]):
                    return f"{self.names[index] or 'the module'}.{key} is {_short(now)} (tuned with {_short(value)})"
        for name, tensor, version in zip(self.tensor_names, self.tensor_values, self.tensor_version_list):
            if tensor._version != version:
                return f"tensor attribute '{name}' was changed in place"
        return "the module's attributes changed"

    def values_changed(self) -> str | None:
        """The first parameter/buffer/tensor attribute whose sampled values differ from capture (edited through
        ``.data``), as a message; sticky once found."""
        if self.stale is not None:
            return self.stale
        if all(torch.equal(torch.cat(group), before) for group, before in self.value_groups):
            return None
        for name, view, before in zip(self.value_names, self.value_views, self.values):
            if not torch.equal(view, before):
                self.stale = (f"'{name}' holds other values than at tuning (edited through .data, which PyTorch "
                              "does not count as a change); the artifact baked the old ones in: calls run eager "
                              "until the module is re-tuned")
                return self.stale
        return None


_CALL = getattr(operator, "call", None) or (lambda function, argument: function(argument))  # Python 3.10


def _class_defaults(klass: type, names: frozenset[str]) -> set[str]:
    """The names among ``names`` that ``klass`` holds as plain class-level values (``scale = 1.0`` in the class
    body), which ``self.scale = ...`` later shadows."""
    return {name for name in names if isinstance(getattr(klass, name, _NOT_IN_CLASS), _PLAIN)
            and not name.startswith("__") and name != "training"}


_NOT_IN_CLASS = object()  # (getattr's default: a name the class lacks is no class-level None)


def _built_in(module: torch.nn.Module) -> bool:
    """A layer class of ``torch.nn`` itself (``torch.nn.modules.conv.Conv2d``), whose hyper-parameters are set
    at construction: checked with the sampled values, not per call."""
    return type(module).__module__.startswith("torch.nn.")


_DELETED = object()


def _immutable(value: Any) -> bool:
    """A plain value no in-place change can alter and whose ``==`` is its type's own (NOTE [native attribute check]):
    exact built-in types (a subclass's ``==`` may read mutable state), enum members compared as such, tuples of
    these."""
    kind = type(value)
    if kind is tuple:
        return all(map(_immutable, value))
    if isinstance(value, enum.Enum):
        return kind.__eq__ in _ENUM_EQUALITY
    return kind in _IMMUTABLE


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _same(now: list, before: list) -> bool:
    """Equal attribute values: identity first (list and tuple comparison), then ``==``; a comparison that raises
    (a tensor replaced by another of several elements) counts as different."""
    try:
        return bool(now == before)
    except Exception:  # noqa: BLE001 - an object whose == raises or is ambiguous: treat as changed
        return False
