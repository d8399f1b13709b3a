"""The shaderdsl command line."""
import subprocess
import sys

import pytest

from shaderdsl.__main__ import main


def test_wgsl_prints_a_kernel(capsys):
    assert main(["wgsl", "lora.kernels:add_scaled", "num_elements=100", "scale=2.5", "--info"]) == 0
    out = capsys.readouterr().out
    assert "output[i] += 2.5f * y[i];" in out
    assert "// binding 0: y read f32 length=100" in out


def test_wgsl_info_gives_a_shaped_bindings_shape(capsys):
    assert main(["wgsl", "examples.stencil:conv2d", "height=5", "width=6", "radius=1",
                 "--workgroup-size", "4,4", "--info"]) == 0
    out = capsys.readouterr().out
    assert "// binding 0: img read f32 length=30 shape=(5, 6)" in out
    assert "// binding 1: w read f32 length=9 shape=(3, 3)" in out


def test_wgsl_reports_bad_input(capsys):
    with pytest.raises(SystemExit, match="expected MODULE:FUNCTION"):
        main(["wgsl", "lora.kernels"])
    with pytest.raises(SystemExit, match="has no function"):
        main(["wgsl", "lora.kernels:nope"])
    # a kernel that raises a DSL error: message on stderr, exit status 1
    assert main(["wgsl", "lora.kernels:add_scaled", "num_elements=-1", "scale=1.0"]) == 1
    assert "array length must be a positive int or None, got -1" in capsys.readouterr().err


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "shaderdsl", "wgsl", "lora.kernels:add_scaled",
                        "num_elements=8", "scale=1.0"], capture_output=True, text=True)
    assert r.returncode == 0 and "@compute @workgroup_size(64, 1, 1)" in r.stdout


def test_a_missing_or_unknown_kernel_parameter_is_named(capsys):
    """Named with the kernel function's line, not the compiler's."""
    from shaderdsl.__main__ import main as shaderdsl_main

    assert shaderdsl_main(["wgsl", "examples.rows:softmax", "rows=4", "colz=3"]) == 1
    err = capsys.readouterr().err
    assert "kernel function 'softmax' (examples/rows.py:31) needs cols and takes no colz: " \
           "it takes rows, cols" in err
