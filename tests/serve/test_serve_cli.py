"""``aitune serve`` without a cluster: help, config errors, and what importing aitune.serve pulls in."""

import subprocess
import sys

import aitune.serve


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "aitune.cli", "serve", *args], capture_output=True, text=True)


def test_help_lists_the_options_that_scale():
    result = run_cli("--help")
    assert result.returncode == 0
    for option in ("--replicas", "--min-replicas", "--num-gpus", "--max-batch-size", "--pad", "--on-mismatch",
                   "--ship-checkpoint", "--address"):
        assert option in result.stdout


def test_a_bad_option_is_named_before_ray_starts():
    result = run_cli("not_an_import_path", "model.ait")
    assert result.returncode == 2 and "ServeConfig.builder" in result.stderr
    result = run_cli("pkg.mod:build", "model.ait", "--pad", "input_ids")
    assert result.returncode != 0 and "NAME=NUMBER" in result.stderr


def test_public_surface_and_no_ray_on_import():
    assert set(aitune.serve.__all__) == {"REQUIREMENTS", "RequestError", "ServeConfig", "availability", "build_app",
                                         "run", "tensor_from_json", "to_json"}
    code = "import sys, aitune.serve, aitune.serve.model; print(sorted({'ray', 'starlette'} & set(sys.modules)))"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"
    assert aitune.serve.availability().ok  # CI installs '.[all]', which includes 'serve'


def test_a_name_given_to_ait_save_is_found_in_checkpoints(tmp_path, monkeypatch):
    """`aitune demo --save minilm.ait` writes checkpoints/minilm.ait; `aitune serve ... minilm.ait` (the README's
    recipe) and `aitune report minilm.ait` resolve the name the same way (aitune.torch.storage.existing_checkpoint)."""
    from pathlib import Path

    from aitune.torch.storage import existing_checkpoint

    monkeypatch.chdir(tmp_path)
    assert existing_checkpoint("m.ait") == Path("m.ait")  # nothing saved: the name as given (the error names it)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "m.ait").write_bytes(b"saved")
    assert existing_checkpoint("m.ait").resolve() == (tmp_path / "checkpoints" / "m.ait").resolve()
    assert existing_checkpoint("m").resolve() == (tmp_path / "checkpoints" / "m.ait").resolve()
    (tmp_path / "m.ait").write_bytes(b"here")
    assert existing_checkpoint("m.ait") == Path("m.ait")  # a file of that name in the working directory wins
