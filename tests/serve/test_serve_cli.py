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
