"""ServedModel (one replica's model, without Ray) on a real tuned checkpoint: load, warm-up, batches, errors,
health, and checkpoints that do not fit this machine."""

import zipfile

import pytest
import torch

import aitune.torch as ait

from aitune.errors import CheckpointError, CheckpointIntegrityError, ConfigError, RequestError, ServeError
from aitune.serve import ServeConfig
from aitune.serve.model import ServedModel
import serve_tiny
from aitune.serve.builder import build_model
from serve_tiny import build_tiny, forge_manifest, tiny_batch

PAD = {"input_ids": 0, "attention_mask": 0}


def config(checkpoint, **changes):
    return ServeConfig(builder="serve_tiny:build_tiny", checkpoint=str(checkpoint), pad_values=PAD, **changes)


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    return ServedModel(config(tiny_checkpoint))


def body(batch):
    return {"inputs": {name: tensor.tolist() for name, tensor in batch.items()}}


def test_loads_the_checkpoint_and_warms_up(served):
    stats = served.stats()
    assert stats["mode"] == "tuned" and stats["backends"] == {"graph0": "onnxruntime"}
    assert stats["problems"] == [] and stats["calls"] == 0  # warm-up calls are not counted
    assert served.batching and served.max_batch_rows == 4
    assert 0.001 <= served.batch_wait_timeout_s <= 0.05


def test_batched_answers_equal_eager_per_request(served):
    eager = build_tiny()
    batches = [tiny_batch(1, 4, seed=10), tiny_batch(2, 7, seed=11), tiny_batch(1, 2, seed=12)]
    results = served.run_batch([served.prepare(body(batch)) for batch in batches])
    assert served.stats()["rows_per_call"] == {"4": 1} and served.stats()["tuned_calls"] == 1
    with torch.no_grad():
        for batch, result in zip(batches, results):
            assert (result.backend, result.rows, result.requests) == ("onnxruntime", 4, 3)
            torch.testing.assert_close(result.output, eager(**batch), atol=1e-5, rtol=1e-4)


def test_a_request_that_breaks_the_model_fails_alone(served):
    good, bad = tiny_batch(1, 4, seed=3), tiny_batch(1, 4, seed=4)
    bad["input_ids"][0, 0] = 10_000  # beyond the vocabulary: the model itself raises
    results = served.run_batch([served.prepare(body(good)), served.prepare(body(bad)), served.prepare(body(good))])
    assert isinstance(results[1], RequestError) and results[1].status == 422 and "raised" in str(results[1])
    with torch.no_grad():
        expected = build_tiny()(**good)
    for result in (results[0], results[2]):  # the good requests still get eager's answer
        torch.testing.assert_close(result.output, expected, atol=1e-5, rtol=1e-4)
    assert results[0].requests == 1
    assert served.run_batch([served.prepare(body(good))])[0].output.shape == (1, 16)  # and the model lives on


def test_body_forms(served):
    with pytest.raises(RequestError) as info:
        served.prepare({"texts": ["no preprocessor here"]})
    assert info.value.status == 400 and '{"inputs"' in str(info.value)


def test_health_fails_when_every_call_runs_eagerly(tiny_checkpoint):
    model = ServedModel(config(tiny_checkpoint, health_min_calls=2, warmup=False))
    request = model.prepare(body(tiny_batch(1, 4)))
    model.run_batch([request])
    assert model.health_problem() is None
    model.wrapper.train()  # a guard: the module was tuned in eval mode, so every call now runs eagerly
    try:
        model.run_batch([request])
        model.run_batch([request])
        problem = model.health_problem()
        assert problem and "ran eagerly" in problem and "onnxruntime" in problem
        assert model.stats()["fallback_calls"] == 2
        assert model.health_problem() is None  # a new window: nothing ran since
    finally:
        model.wrapper.eval()


def test_missing_backend_package_refuses_or_serves_eagerly(tiny_checkpoint, tmp_path):
    def needs_tensorrt(manifest):
        manifest["modules"][0]["graphs"][0]["backend"] = "tensorrt"

    forged = forge_manifest(tiny_checkpoint, tmp_path / "trt.ait", needs_tensorrt)
    with pytest.raises(ServeError, match="backend 'tensorrt' is unavailable here.*on_mismatch='eager'"):
        ServedModel(config(forged))
    model = ServedModel(config(forged, on_mismatch="eager"))
    assert model.mode == "eager" and "tensorrt" in model.stats()["problems"][0]
    batch = tiny_batch(2, 5, seed=7)
    with torch.no_grad():
        answer = model.run_batch([model.prepare(body(batch))])[0]
        torch.testing.assert_close(answer.output, build_tiny()(**batch))
    assert answer.backend == "eager"
    model.run_batch([model.prepare(body(batch))] * 3)
    assert model.health_problem() is None  # eager was announced at start; it is not a fallback


def test_missing_cuda_refuses_or_serves_on_the_cpu(tiny_checkpoint):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the case needs a machine without it")
    with pytest.raises(ServeError, match="no CUDA device"):
        ServedModel(config(tiny_checkpoint, device="cuda", warmup=False))
    model = ServedModel(config(tiny_checkpoint, device="cuda", on_mismatch="eager", warmup=False))
    assert str(model.device) == "cpu" and model.mode == "tuned"  # the checkpoint was tuned for the CPU


def test_a_corrupted_checkpoint_is_refused_even_to_serve_eagerly(tiny_checkpoint, tmp_path):
    forged = forge_manifest(tiny_checkpoint, tmp_path / "trt.ait",
                            lambda m: m["modules"][0]["graphs"][0].update(backend="tensorrt"))
    corrupted = tmp_path / "corrupted.ait"
    with zipfile.ZipFile(forged) as source, zipfile.ZipFile(corrupted, "w") as target:
        for name in source.namelist():
            data = source.read(name)
            target.writestr(name, data + b"\0" if name.endswith("samples.safetensors") else data)
    (tmp_path / "corrupted_sha256_sums.txt").write_text((tmp_path / "trt_sha256_sums.txt").read_text())
    with pytest.raises(CheckpointIntegrityError):
        ServedModel(config(corrupted, on_mismatch="eager"))


def test_a_builder_that_cannot_be_imported_says_where_it_must_be(tiny_checkpoint):
    with pytest.raises(ConfigError, match="importable on every node"):
        ServedModel(ServeConfig(builder="no_such_module:build", checkpoint=str(tiny_checkpoint)))


def test_a_load_failure_the_fit_check_cannot_see_is_a_mismatch_too(tiny_checkpoint, tmp_path):
    def bad_config(manifest):  # a stored config this aitune refuses: ait.load raises CheckpointError
        manifest["modules"][0]["graphs"][0]["config"]["data"]["intra_op_num_threads"] = 0

    forged = forge_manifest(tiny_checkpoint, tmp_path / "bad_config.ait", bad_config)
    with pytest.raises(CheckpointError, match="invalid here"):
        ServedModel(config(forged))
    model = ServedModel(config(forged, on_mismatch="eager"))
    assert model.mode == "eager" and "invalid here" in model.stats()["problems"][-1]
    assert model.run_batch([model.prepare(body(tiny_batch(1, 4)))])[0].backend == "eager"


def test_a_builder_with_a_device_parameter_gets_the_replicas_device(tiny_checkpoint):
    serve_tiny.BUILT_ON.clear()
    model = build_model("serve_tiny:build_tiny_on", torch.device("meta"))
    assert serve_tiny.BUILT_ON == ["meta"] and next(model.parameters()).device.type == "meta"
    serve_tiny.BUILT_ON.clear()
    served = ServedModel(ServeConfig(builder="serve_tiny:build_tiny_on", checkpoint=str(tiny_checkpoint),
                                     pad_values=PAD, device="cpu", warmup=False))
    assert serve_tiny.BUILT_ON == ["cpu"] and str(served.device) == "cpu"
    batch = tiny_batch(2, 5, seed=8)
    with torch.no_grad():
        answer = served.run_batch([served.prepare(body(batch))])[0]
        torch.testing.assert_close(answer.output, build_tiny()(**batch), atol=1e-5, rtol=1e-4)


def test_warm_up_turns_batching_off_with_a_warning_when_batched_answers_differ(tmp_path, caplog):
    # Recorded (rows, tokens): two single rows that fit one call with the 4-row batch's limit. Padding the mask
    # with 1 counts padded tokens in the mean, so the 4-token row batched with the 6-token one (padded to 6)
    # gets another answer than alone: warm-up compares them and turns batching off.
    profiling = ait.ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=5, time_budget_s=0.1)
    checkpoint = serve_tiny.save_tiny_checkpoint(tmp_path / "merge.ait", profiling, tmp_path / "cache",
                                                 shapes=((1, 4), (1, 6), (4, 8)))
    wrong_pad = {"input_ids": 0, "attention_mask": 1}
    with caplog.at_level("WARNING", logger="aitune.serve.model"):
        model = ServedModel(ServeConfig(builder="serve_tiny:build_tiny", checkpoint=str(checkpoint),
                                        pad_values=wrong_pad))
    assert model.batching is False and model.stats()["batching"] is False
    assert [r for r in caplog.records if "batched answers" in r.message and "batching off" in r.message]
    requests = [model.prepare(body(tiny_batch(1, 4, seed=20))), model.prepare(body(tiny_batch(1, 6, seed=21)))]
    assert [(a.rows, a.requests) for a in model.run_batch(requests)] == [(1, 1), (1, 1)]  # one call each
    caplog.clear()
    with caplog.at_level("WARNING", logger="aitune.serve.model"):
        right = ServedModel(config(checkpoint))  # pad values that keep the answers: batching stays on
    assert right.batching is True and not [r for r in caplog.records if "batched answers" in r.message]
    assert [(a.rows, a.requests) for a in right.run_batch(requests)] == [(2, 2), (2, 2)]
