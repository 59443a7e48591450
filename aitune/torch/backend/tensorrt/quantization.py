"""The optional quantization step of the TensorRT backend, with NVIDIA ModelOpt (``nvidia-modelopt[onnx]``).

* :func:`autocast_onnx` — ONNX mixed precision (fp16/bf16) with ``modelopt.onnx.autocast``; needs no
  TensorRT and no GPU (ModelOpt runs the model with ONNX Runtime on CPU to keep overflowing nodes in fp32).
* :func:`quantize_onnx` — ONNX post-training quantization (int8/fp8/int4 Q/DQ) with
  ``modelopt.onnx.quantization.quantize``, calibrated on the recorded samples.
* :func:`quantize_torch` — PyTorch post-training quantization with ``modelopt.torch.quantization`` on a
  deep copy of the module, before the ONNX export.

The two ONNX steps are file-to-file with JSON-able arguments so the backend runs them in a child process
(:func:`aitune.torch.backend.isolation.run_isolated`). Calibration data travels as ``.npz`` files, one per
recorded sample, keyed by ONNX input name (the format ModelOpt's autocast reads from a directory).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Sequence

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.base import Requirement

logger = logging.getLogger(__name__)

MODELOPT_REQUIREMENT = Requirement("modelopt", ("nvidia-modelopt",), "tensorrt", "0.33")


def _numpy(tensor: torch.Tensor):
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        raise ConfigError("bfloat16 inputs cannot be written as calibration data (numpy has no bfloat16); the model "
                          "is already in low precision: drop the quantization_config")
    return tensor.numpy()


def write_calibration_data(samples: Sequence[Sequence[torch.Tensor]], names: Sequence[str], directory: Path) -> Path:
    """Write one ``sample_<i>.npz`` per sample (``{name: array}``) into ``directory``; returns the directory.

    Args:
        samples: per sample, the flat input tensors in the order of ``names``.
        names: ONNX input name per tensor.
        directory: created if missing; earlier ``sample_*.npz`` files are removed.
    """
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("sample_*.npz"):
        old.unlink()
    for index, tensors in enumerate(samples):
        np.savez(directory / f"sample_{index:04d}.npz", **{name: _numpy(t) for name, t in zip(names, tensors)})
    return directory


def concatenated_calibration(samples: Sequence[Sequence[torch.Tensor]], names: Sequence[str]) -> dict:
    """Calibration data for ONNX PTQ: per input, the samples concatenated along axis 0.

    Only samples whose non-leading axes match can be concatenated; the largest such group of samples is
    used (ties: the earliest). Scalars (rank 0) are stacked.

    Returns:
        ``{name: numpy array}``.
    """
    import numpy as np

    if not samples:
        raise ConfigError("no recorded samples to calibrate with")
    groups: dict[tuple, list[int]] = {}
    for index, tensors in enumerate(samples):
        signature = tuple(tuple(t.shape[1:]) if t.dim() else ("scalar",) for t in tensors)
        groups.setdefault(signature, []).append(index)
    chosen = max(groups.values(), key=len)
    data = {}
    for position, name in enumerate(names):
        arrays = [_numpy(samples[index][position]) for index in chosen]
        data[name] = np.stack(arrays) if arrays[0].ndim == 0 else np.concatenate(arrays, axis=0)
    return data


def autocast_onnx(*, onnx_path: str, output_path: str, precision: str = "fp16", keep_io_types: bool = True,
                  calibration_dir: str | None = None) -> dict:
    """Convert an ONNX model to fp16/bf16 mixed precision with ModelOpt's autocast (file to file).

    Args:
        onnx_path: input model. output_path: converted model (external data beside it when > 2 GiB).
        precision: ``"fp16"`` or ``"bf16"``. keep_io_types: keep fp32 graph inputs/outputs.
        calibration_dir: folder of ``.npz`` input samples (see :func:`write_calibration_data`); ModelOpt runs
            them with ONNX Runtime (CPU) to find nodes whose values would overflow the low-precision type.

    Returns:
        ``{"output_path", "nodes", "cast_nodes"}`` (node counts of the converted graph).
    """
    from modelopt.onnx.autocast import convert_to_mixed_precision
    from modelopt.onnx.utils import save_onnx

    import modelopt

    from packaging.version import Version

    options = {}
    # Recorded samples are passed as calibration data only where ModelOpt reads a folder of .npz files
    # (ModelOpt > 0.42, reference A.6); older versions classify nodes with random inputs.
    if calibration_dir is not None and Version(modelopt.__version__.split("+")[0]) > Version("0.42"):
        options["calibration_data"] = calibration_dir
    model = convert_to_mixed_precision(onnx_path=onnx_path, low_precision_type=precision,
                                       keep_io_types=keep_io_types, providers=["cpu"], **options)
    Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    save_onnx(model, output_path)
    cast_nodes = sum(1 for node in model.graph.node if node.op_type == "Cast")
    logger.info("autocast (%s) wrote %s: %d nodes, %d Cast", precision, output_path, len(model.graph.node), cast_nodes)
    return {"output_path": output_path, "nodes": len(model.graph.node), "cast_nodes": cast_nodes}


def quantize_onnx(*, onnx_path: str, output_path: str, precision: str, calibration_method: str | None,
                  calibration_path: str, calibration_eps: list[str] | None = None) -> dict:
    """Post-training quantization of an ONNX model with ModelOpt (file to file).

    Args:
        onnx_path / output_path: input and quantized model.
        precision: ``"int8"``, ``"fp8"`` or ``"int4"`` (ModelOpt's ``quantize_mode``).
        calibration_method: ModelOpt calibration method or None (its default).
        calibration_path: ``.npz`` with one array per input name (see :func:`concatenated_calibration`).
        calibration_eps: ONNX Runtime execution providers for calibration (default ``["cuda:0", "cpu"]``).

    Returns:
        ``{"output_path", "qdq_nodes"}`` (number of QuantizeLinear/DequantizeLinear nodes written).
    """
    import numpy as np
    import onnx
    from modelopt.onnx.quantization import quantize

    with np.load(calibration_path) as archive:
        calibration = {name: archive[name] for name in archive.files}
    options = {}
    if calibration_method is not None:
        options["calibration_method"] = calibration_method
    Path(output_path).parent.mkdir(parents=True, exist_ok=True)  # ModelOpt asserts the folder exists
    quantize(onnx_path, quantize_mode=precision, calibration_data=calibration, output_path=output_path,
             calibration_eps=list(calibration_eps or ["cuda:0", "cpu"]), **options)
    model = onnx.load(output_path, load_external_data=False)
    qdq = sum(1 for node in model.graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear"))
    logger.info("ONNX PTQ (%s) wrote %s with %d Q/DQ nodes", precision, output_path, qdq)
    return {"output_path": output_path, "qdq_nodes": qdq}


def quantize_torch(module: torch.nn.Module, samples: Sequence, preset: str) -> torch.nn.Module:
    """A quantized deep copy of ``module`` (ModelOpt PyTorch PTQ, ``mtq.quantize``); ``module`` is unchanged.

    Args:
        module: the user's module (eval mode).
        samples: recorded :class:`~aitune.torch.record.samples.Sample` s run as the calibration forward loop.
        preset: name of a ModelOpt config (``"FP8_DEFAULT_CFG"``, ``"INT8_DEFAULT_CFG"``, ...).

    Raises:
        ConfigError: if this ModelOpt has no such preset (``NVFP4_FP8_MHA_CONFIG`` needs ModelOpt >= 0.35).
    """
    import modelopt.torch.quantization as mtq

    config = getattr(mtq, preset, None)
    if config is None:
        raise ConfigError(f"modelopt.torch.quantization has no preset {preset!r} in this ModelOpt version")
    quantized = copy.deepcopy(module)

    def forward_loop(model):
        with torch.no_grad():
            for sample in samples:
                sample = sample.clone()
                model(*sample.args, **sample.kwargs)

    mtq.quantize(quantized, config, forward_loop)
    return quantized.eval()
