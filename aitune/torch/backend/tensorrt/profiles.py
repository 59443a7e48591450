"""TensorRT optimization profiles: derived from recorded shapes, checked, and selected at run time.

A *profile* here is ``{engine input name: (min, opt, max)}`` with shapes as tuples of ints. These are
pure functions of a :class:`~aitune.torch.record.samples.GraphSpec` and shapes, so they are tested without
TensorRT. TensorRT's rule (``IOptimizationProfile``): a call runs under a profile when, for every input,
``min[i] <= shape[i] <= max[i]`` on every axis; opt is the shape kernels are tuned for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from aitune.errors import ConfigError
from aitune.torch.backend.tensorrt.config import ProfileMode, TensorRTProfile

Shape = tuple[int, ...]
ShapeRange = tuple[Shape, Shape, Shape]
Profile = dict[str, ShapeRange]


def single_profile(graph, names: Sequence[str] | None = None) -> list[Profile]:
    """One profile from the recorded (or user-declared) min/max of every tensor input, opt = max.

    Args:
        graph: the :class:`GraphSpec`.
        names: engine input name per tensor spec (default: each spec's ``name``).
    """
    names = list(names) if names is not None else [spec.name for spec in graph.tensor_specs]
    profile: Profile = {}
    for spec, name in zip(graph.tensor_specs, names):
        low, opt, high = graph.shape_range(spec)
        profile[name] = (tuple(low), tuple(opt), tuple(high))
    return [profile]


def samples_profiles(graph, names: Sequence[str] | None = None) -> list[Profile]:
    """One static profile (min = opt = max) per distinct recorded input shape, in recording order."""
    names = list(names) if names is not None else [spec.name for spec in graph.tensor_specs]
    profiles: list[Profile] = []
    seen: set = set()
    for sample in graph.samples:
        leaves = sample.leaves()
        shapes = tuple(tuple(leaves[spec.leaf_index].shape) for spec in graph.tensor_specs)
        if shapes in seen:
            continue
        seen.add(shapes)
        profiles.append({name: (shape, shape, shape) for name, shape in zip(names, shapes)})
    if not profiles:
        raise ConfigError(f"{graph.name} has no recorded samples to make SAMPLES_USED profiles from")
    return profiles


def user_profiles(graph, profiles: Sequence[TensorRTProfile], names: Sequence[str] | None = None) -> list[Profile]:
    """Check user profiles against the graph's real tensor inputs and key them by engine input name.

    An entry is matched by the input's readable path (``x``, ``inputs.tokens``) or its engine name
    (``input_x``). Every tensor input must have exactly one entry; an axis the recorded samples show as
    static must keep that size (the ONNX export fixes it).

    Raises:
        ConfigError: naming the profile and the unknown, missing or inconsistent input, with the inputs
            the graph has.
    """
    names = list(names) if names is not None else [spec.name for spec in graph.tensor_specs]
    by_key: dict[str, tuple[Any, str]] = {}
    for spec, name in zip(graph.tensor_specs, names):
        by_key[spec.path] = (spec, name)
        by_key[spec.name] = (spec, name)
        by_key[name] = (spec, name)
    known = ", ".join(f"{spec.path} (rank {spec.rank})" for spec in graph.tensor_specs)
    resolved: list[Profile] = []
    for index, profile in enumerate(profiles):
        result: Profile = {}
        for key, (low, opt, high) in profile.shapes.items():
            if key not in by_key:
                raise ConfigError(f"TensorRT profile {index} names input {key!r}, which {graph.name} does not have; "
                                  f"its tensor inputs are: {known}")
            spec, name = by_key[key]
            if name in result:
                raise ConfigError(f"TensorRT profile {index} gives input {spec.path!r} twice")
            if len(low) != spec.rank:
                raise ConfigError(f"TensorRT profile {index}: input {spec.path!r} has rank {spec.rank} but the "
                                  f"profile gives {len(low)} axes ({list(low)})")
            for axis, kind in enumerate(spec.axes):
                size = spec.min_shape[axis]
                if kind == "static" and not (low[axis] == opt[axis] == high[axis] == size):
                    raise ConfigError(f"TensorRT profile {index}: axis {axis} of input {spec.path!r} is static "
                                      f"(size {size}) in the recorded samples, but the profile gives "
                                      f"{low[axis]}..{high[axis]}; record samples that vary it or keep it at {size}")
            result[name] = (tuple(low), tuple(opt), tuple(high))
        missing = [spec.path for spec, name in zip(graph.tensor_specs, names) if name not in result]
        if missing:
            raise ConfigError(f"TensorRT profile {index} has no shapes for input(s) {', '.join(missing)}; "
                              f"every tensor input needs one (inputs: {known})")
        resolved.append(result)
    return resolved


def resolve_profiles(graph, profiles: ProfileMode | Sequence[TensorRTProfile],
                     names: Sequence[str] | None = None) -> list[Profile]:
    """Profiles for ``graph`` under a config's ``profiles`` field (a mode or user profiles)."""
    if profiles is ProfileMode.SINGLE:
        return single_profile(graph, names)
    if profiles is ProfileMode.SAMPLES_USED:
        return samples_profiles(graph, names)
    return user_profiles(graph, profiles, names)


def onnx_input_shapes(path: Path | str) -> dict[str, list[int | None]]:
    """``{input name: [size or None per axis]}`` of an ONNX model's graph inputs (None = symbolic axis).

    Reads only the model's structure (external weights are not loaded). Initializers listed as inputs
    (old IR versions) are skipped.
    """
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}
    shapes: dict[str, list[int | None]] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = []
        for dim in value.type.tensor_type.shape.dim:
            dims.append(int(dim.dim_value) if dim.HasField("dim_value") else None)
        shapes[value.name] = dims
    return shapes


def constrain_to_onnx(profiles: list[Profile],
                      onnx_shapes: dict[str, list[int | None]]) -> tuple[list[Profile], list[str]]:
    """Fit profiles to what the exported ONNX graph accepts.

    Inputs the ONNX graph does not have (dropped by the exporter as unused) are removed from every profile.
    An axis the export fixed to size ``n`` (shape-specialized export) is narrowed to ``n`` when
    the profile's range contains it; a profile whose range excludes ``n`` cannot serve and is dropped.

    Returns:
        ``(profiles that remain, notes)``.

    Raises:
        ConfigError: if no profile remains (the message names the fixed axes), or a profile lacks an
            input the ONNX graph has.
    """
    notes: list[str] = []
    kept: list[Profile] = []
    for index, profile in enumerate(profiles):
        fitted: Profile = {}
        usable = True
        for name, (low, opt, high) in profile.items():
            if name not in onnx_shapes:
                notes.append(f"profile {index}: input {name} is not an input of the ONNX graph (unused); skipped")
                continue
            dims = onnx_shapes[name]
            if len(dims) != len(low):
                raise ConfigError(f"input {name} has rank {len(dims)} in the ONNX graph but {len(low)} in profile "
                                  f"{index}")
            low, opt, high = list(low), list(opt), list(high)
            for axis, fixed in enumerate(dims):
                if fixed is None or low[axis] == opt[axis] == high[axis] == fixed:
                    continue
                if low[axis] <= fixed <= high[axis]:
                    notes.append(f"profile {index}: {name} axis {axis} fixed to {fixed} by the export "
                                 f"(was {low[axis]}..{high[axis]})")
                    low[axis] = opt[axis] = high[axis] = fixed
                else:
                    notes.append(f"profile {index} dropped: {name} axis {axis} is fixed to {fixed} in the ONNX "
                                 f"graph, outside the profile's {low[axis]}..{high[axis]}")
                    usable = False
            fitted[name] = (tuple(low), tuple(opt), tuple(high))
        missing = [name for name in onnx_shapes if name not in profile]
        if missing:
            raise ConfigError(f"profile {index} has no shapes for ONNX input(s) {', '.join(missing)}")
        if usable and fitted not in kept:
            kept.append(fitted)
    if not kept:
        raise ConfigError("no TensorRT optimization profile fits the exported ONNX graph: "
                          + "; ".join(note for note in notes if "dropped" in note))
    return kept, notes


def covers(profile: Profile, shapes: dict[str, Shape]) -> bool:
    """True when every input of ``profile`` is given in ``shapes`` and lies within its [min, max]."""
    for name, (low, _, high) in profile.items():
        shape = shapes.get(name)
        if shape is None or len(shape) != len(low):
            return False
        if any(not (a <= s <= c) for a, s, c in zip(low, shape, high)):
            return False
    return True


def select_profile(profiles: Sequence[Profile], shapes: dict[str, Shape]) -> int | None:
    """Index of the first profile that covers ``shapes`` (TensorRT picks nothing itself), or None."""
    for index, profile in enumerate(profiles):
        if covers(profile, shapes):
            return index
    return None


def out_of_profile_message(profiles: Sequence[Profile], shapes: dict[str, Shape],
                           paths: dict[str, str] | None = None) -> str:
    """Error text for a call outside every profile: the offending input(s), their shapes and the ranges.

    Args:
        profiles: the engine's profiles.
        shapes: the call's shape per engine input name.
        paths: readable input path per engine input name (``x`` for ``input_x``), for the message.
    """
    paths = paths or {}
    parts = []
    offending: list[str] = []
    for index, profile in enumerate(profiles):
        ranges = []
        for name, (low, _, high) in profile.items():
            shape = shapes.get(name)
            label = paths.get(name, name)
            ranges.append(f"{label} min {list(low)} max {list(high)}")
            if shape is None or len(shape) != len(low) or any(not (a <= s <= c) for a, s, c in zip(low, shape, high)):
                if label not in offending:
                    offending.append(label)
        parts.append(f"profile {index}: " + ", ".join(ranges))
    given = ", ".join(f"{paths.get(name, name)} {list(shape)}" for name, shape in shapes.items()
                      if paths.get(name, name) in offending) or ", ".join(
        f"{paths.get(name, name)} {list(shape)}" for name, shape in shapes.items())
    return (f"input shape outside every TensorRT optimization profile: {given}; " + "; ".join(parts)
            + ". Record samples covering this shape (or add a TensorRTProfile) and tune again")


def profiles_to_json(profiles: Sequence[Profile]) -> list[dict[str, list[list[int]]]]:
    """JSON form ``[{name: [min, opt, max]}, ...]`` (the reference's ``model_optimization_profiles.json``)."""
    return [{name: [list(low), list(opt), list(high)] for name, (low, opt, high) in profile.items()}
            for profile in profiles]


def profiles_from_json(data: Sequence[dict]) -> list[Profile]:
    """Inverse of :func:`profiles_to_json`."""
    return [{name: (tuple(low), tuple(opt), tuple(high)) for name, (low, opt, high) in profile.items()}
            for profile in data]


def write_profiles(path: Path, profiles: Sequence[Profile]) -> None:
    path.write_text(json.dumps(profiles_to_json(profiles), indent=1))
