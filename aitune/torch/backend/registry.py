"""The registry of backend classes by name (``"inductor_jit"``, ``"onnxruntime"``...) and the hooks run on
every new :class:`~aitune.torch.backend.base.Backend` subclass."""

from __future__ import annotations

from aitune.errors import UnknownBackendError


_REGISTRY: dict[str, type] = {}
_SUBCLASS_HOOKS: list = []
_DEFAULT_CANDIDATES: list[type] = []  # classes that set their own default_search_position


def register_subclass_hook(hook) -> None:
    """Call ``hook(cls)`` for every Backend subclass created from now on, before it is registered by name
    (:mod:`aitune.torch.backend.reference_contract` adapts reference-style backends this way)."""
    if hook not in _SUBCLASS_HOOKS:
        _SUBCLASS_HOOKS.append(hook)


def registered_backends() -> dict[str, type]:
    """All registered backend classes by name. The built-in ones are registered when the package
    ``aitune.torch.backend`` is imported, which Python does before this module (its parent) is imported."""
    return dict(_REGISTRY)


def get_backend_class(name: str) -> type:
    """The backend class registered as ``name``.

    Args:
        name: a registry name such as ``"inductor_jit"``, ``"onnxruntime"`` (``aitune env`` lists them).

    Returns:
        The :class:`Backend` subclass.

    Raises:
        UnknownBackendError: for a name nobody registered; the message lists every registered name.
    """
    backends = registered_backends()
    if name not in backends:
        raise UnknownBackendError(f"unknown backend {name!r}; registered backends: {', '.join(sorted(backends))}")
    return backends[name]


def register_backend_class(cls: type) -> None:
    """Run the subclass hooks on a new Backend subclass, then register it under its ``name`` when the class
    declares one itself (``Backend.__init_subclass__`` calls this)."""
    for hook in _SUBCLASS_HOOKS:
        hook(cls)
    if isinstance(cls.__dict__.get("name"), str) and cls.name:  # only classes that declare their name register
        _REGISTRY[cls.name] = cls
    if cls.__dict__.get("default_search_position") is not None:
        _DEFAULT_CANDIDATES.append(cls)


def default_candidate_classes() -> list[type]:
    """The backend classes of the default search (those that set :attr:`Backend.default_search_position`),
    in that order; the built-in backends are registered first."""
    registered_backends()
    return sorted(_DEFAULT_CANDIDATES, key=lambda cls: cls.default_search_position)
