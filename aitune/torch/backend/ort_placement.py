"""Which execution provider ran each node of an ONNX Runtime session, read from the session's profile.

NOTE [node placement from the profile]: ONNX Runtime's Python API does not list which execution provider
(EP) each node was assigned to; its profiler does. The build session is created with
``SessionOptions.enable_profiling`` (the profile goes to the build folder), runs the recorded samples, and
``InferenceSession.end_profiling()`` writes the JSON: each event with ``"cat": "Node"`` whose name ends in
``_kernel_time`` carries the node's ``op_name`` and ``provider`` in ``args`` (ONNX Runtime's "Profiling tools"
documentation). ``end_profiling()`` stops the profiler, so the session serves afterwards at the cost of one
created without it (the contract tests check that later runs add nothing to the profile).

ONNX Runtime puts shape computations (``Shape`` -> ``Gather`` -> ``Concat`` ... feeding a ``Reshape``) on the
CPU EP on purpose even when a GPU EP is requested, and ops without a kernel in the requested EP also fall back
to it; its own warning says "ORT explicitly assigns shape related ops to CPU to improve perf"
(``VerifyEachNodeIsAssignedToAnEp`` in ``onnxruntime/core/framework/session_state.cc``). Data crossing between
them costs device/host copies, and ONNX Runtime's documentation asks for every node on the CUDA EP before it
captures CUDA graphs (what it does otherwise: :mod:`~aitune.torch.backend.ort_cuda_graph`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from aitune.errors import one_line

logger = logging.getLogger(__name__)

PROFILE_PREFIX = "ort_profile"  # profile files in the build folder: ort_profile_<date>.json

# ops ONNX Runtime inserts to move tensors between the CPU and a GPU EP (assigned to the GPU EP)
COPY_OPS = frozenset({"MemcpyToHost", "MemcpyFromHost"})


@dataclasses.dataclass
class NodePlacement:
    """Nodes that ran, per execution provider.

    Attributes:
        op_types: ``{provider: {op type: node count}}`` for the nodes that ran at least once while profiled
            (nodes constant-folded by ONNX Runtime's optimizer are gone and not counted).
    """

    op_types: dict[str, dict[str, int]]

    @property
    def counts(self) -> dict[str, int]:
        """``{provider: node count}``, e.g. ``{"CUDAExecutionProvider": 120, "CPUExecutionProvider": 4}``."""
        return {provider: sum(ops.values()) for provider, ops in sorted(self.op_types.items())}

    def off(self, provider: str) -> dict[str, int]:
        """``{op type: count}`` of the nodes not on ``provider`` (ONNX Runtime's name, e.g.
        ``CUDAExecutionProvider``)."""
        result: dict[str, int] = {}
        for name, ops in self.op_types.items():
            if name != provider:
                for op, count in ops.items():
                    result[op] = result.get(op, 0) + count
        return dict(sorted(result.items()))

    def copies(self) -> int:
        """Number of device/host copy nodes ONNX Runtime inserted (``MemcpyToHost``/``MemcpyFromHost``)."""
        return sum(count for ops in self.op_types.values() for op, count in ops.items() if op in COPY_OPS)

    def note(self, provider: str) -> str | None:
        """One line for the report when some nodes did not run on ``provider``; None when all did."""
        off = self.off(provider)
        if not off:
            return None
        total = sum(self.counts.values())
        listed = ", ".join(f"{op} {count}" for op, count in sorted(off.items(), key=lambda item: (-item[1], item[0])))
        label = provider.removesuffix("ExecutionProvider")
        copies = self.copies()
        elsewhere = "CUDA or the CPU" if label == "Tensorrt" else "the CPU"  # TensorRT's EP hands the rest to CUDA
        return (f"{sum(off.values())} of {total} nodes not on {label} ({listed}): ONNX Runtime puts shape "
                f"computations and ops without a {label} kernel on {elsewhere}"
                + (f"; {copies} device/host copies" if copies else ""))

    def to_json(self) -> dict:
        return {"counts": self.counts, "op_types": {p: dict(sorted(o.items())) for p, o in self.op_types.items()}}


def read_placement(profile_path: str | Path) -> NodePlacement:
    """The node placement recorded in an ONNX Runtime profile (the JSON ``end_profiling()`` wrote).

    Each node is counted once however many runs were profiled (keyed by its ``node_index``, else its name).

    Raises:
        OSError / ValueError: the file cannot be read or is not a profile.
    """
    events = json.loads(Path(profile_path).read_text())
    if not isinstance(events, list):
        raise ValueError(f"{profile_path} is not an ONNX Runtime profile (a JSON list of events)")
    nodes: dict[object, tuple[str, str]] = {}
    for event in events:
        if not isinstance(event, dict) or event.get("cat") != "Node":
            continue
        name = str(event.get("name", ""))
        args = event.get("args") or {}
        if not name.endswith("_kernel_time") or "provider" not in args:
            continue
        key = args.get("node_index", name)
        nodes[key] = (str(args["provider"]), str(args.get("op_name", "?")))
    op_types: dict[str, dict[str, int]] = {}
    for provider, op in nodes.values():
        ops = op_types.setdefault(provider, {})
        ops[op] = ops.get(op, 0) + 1
    return NodePlacement(op_types)


def placement_info(profile_path: str, provider: str) -> dict:
    """The build_info entries for the profile ``InferenceSession.end_profiling()`` wrote (``profile_path``; empty:
    nothing), which is deleted afterwards (the summary is what is kept): ``node_placement`` (``{provider: node
    count}``), ``node_op_types`` (``{provider: {op type: count}}``) and, when some nodes are not on ``provider``,
    ``placement_note`` (the report row shows it). An unreadable profile is logged and gives ``{}``."""
    if not profile_path:
        return {}
    try:
        placement = read_placement(profile_path)
    except (OSError, ValueError) as exc:
        logger.warning("onnxruntime: node placement not recorded: %s", one_line(exc))
        return {}
    Path(profile_path).unlink(missing_ok=True)
    info = {"node_placement": placement.counts, "node_op_types": placement.to_json()["op_types"]}
    note = placement.note(provider)
    if note is not None:
        info["placement_note"] = note
    return info
