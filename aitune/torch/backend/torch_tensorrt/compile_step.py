"""The isolated step of the Torch-TensorRT AOT path: compile the saved ExportedProgram, save the artifact, load it
and run it once, in a child process (:func:`aitune.torch.backend.isolation.run_isolated`); and the JSON form of
the settings it receives."""

from __future__ import annotations

import torch

from aitune.torch.common.dtypes import dtype_from_name, dtype_name


def settings_to_json(settings: dict) -> dict:
    """Compile settings as JSON (dtypes by name, sets as sorted lists), to travel to the child process."""
    encoded = dict(settings)
    if "enabled_precisions" in encoded:
        encoded["enabled_precisions"] = sorted(dtype_name(p) for p in encoded["enabled_precisions"])
    if "torch_executed_ops" in encoded:
        encoded["torch_executed_ops"] = sorted(encoded["torch_executed_ops"])
    return encoded


def settings_from_json(encoded: dict) -> dict:
    """The inverse of :func:`settings_to_json`."""
    settings = dict(encoded)
    if "enabled_precisions" in settings:
        settings["enabled_precisions"] = {dtype_from_name(name) for name in settings["enabled_precisions"]}
    if "torch_executed_ops" in settings:
        settings["torch_executed_ops"] = set(settings["torch_executed_ops"])
    return settings


def compile_exported_program(*, exported_path: str, output_path: str, inputs: list[dict], settings: dict,
                             pickle_protocol: int, check_inputs_path: str, device_index: int = 0) -> dict:
    """Isolated step: load an ExportedProgram, compile it with Torch-TensorRT, save it, load it, run it once.

    Args:
        exported_path: ``torch.export.save``d program. output_path: the Torch-TensorRT artifact to write.
        inputs: ``[{"name", "min", "opt", "max", "dtype"}]`` per flat input.
        settings: JSON form of :meth:`TorchTensorRTConfig.settings`.
        pickle_protocol: passed to ``torch_tensorrt.save``.
        check_inputs_path: ``torch.save``d flat inputs (loaded with ``weights_only=True``) for the check run.
        device_index: CUDA device.

    Returns:
        ``{"output_path", "check_output_shapes"}``.
    """
    import torch_tensorrt

    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    exported = torch.export.load(exported_path)
    trt_inputs = [torch_tensorrt.Input(min_shape=tuple(entry["min"]), opt_shape=tuple(entry["opt"]),
                                       max_shape=tuple(entry["max"]), dtype=dtype_from_name(entry["dtype"]),
                                       name=entry["name"]) for entry in inputs]
    options = settings_from_json(settings)
    options["device"] = device
    compiled = torch_tensorrt.dynamo.compile(exported, arg_inputs=trt_inputs, **options)
    check_inputs = [tensor.to(device) for tensor in torch.load(check_inputs_path, weights_only=True)]
    torch_tensorrt.save(compiled, output_path, output_format="exported_program", arg_inputs=check_inputs,
                        retrace=False, pickle_protocol=pickle_protocol)
    loaded = torch_tensorrt.load(output_path).module()
    with torch.no_grad():
        outputs = loaded(*check_inputs)
    torch.cuda.synchronize(device)
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    return {"output_path": output_path, "check_output_shapes": [list(output.shape) for output in outputs]}
