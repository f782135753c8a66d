"""benchmarks/sass_probe.py compiles the attention kernels and the one-row int4 GEMVs for sm_90 on the CPU machine
and reads their SASS; it also guards the fp8 decode kernel's V path (upcast before the shared-memory staging: no
byte-wide shared loads) and the dp4a GEMV's integer dots."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import sass_probe

ROOT = Path(__file__).resolve().parents[2]  # `-m benchmarks.sass_probe` is found from the repository root


def run_probe(*args: str) -> str:
    """The probe's output, run outside this session's Triton interpreter (it compiles real kernels)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "benchmarks.sass_probe", *args], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.skipif(not os.path.exists(sass_probe.nvdisasm()), reason="Triton ships no nvdisasm here")
def test_fp8_decode_loop_has_no_byte_loads_from_shared_memory():
    fp8 = run_probe("--cache", "fp8", "--top", "200")
    assert "decode over a fp8 cache, sm_90" in fp8 and "HMMA" in fp8
    assert "LDS.U8" not in fp8, fp8  # the V tile read a byte at a time: 128 of them before the fix
    bf16 = run_probe("--top", "200")
    fp8_loop, bf16_loop = (int(re.search(r"largest loop has (\d+) SASS", out).group(1)) for out in (fp8, bf16))
    assert fp8_loop < 1.2 * bf16_loop, (fp8_loop, bf16_loop)  # 934 against 861 (1,234 with the byte loads)
    assert 0 < int(re.search(r"(\d+) registers a thread", fp8).group(1)) <= 255, fp8  # sm_90's most a thread


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        sass_probe.main(["--block-n", "0"])
    assert "--block-n must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists(sass_probe.nvdisasm()), reason="Triton ships no nvdisasm here")
def test_int4_dp4a_gemv_dots_bytes_in_integers():
    """The dp4a GEMV's loop is integer dots (its inline PTX compiled), at under half the float kernel's
    instructions a weight (1.74 against 5.30 at the table's tiles)."""
    dp4a, row = run_probe("--kernel", "int4-dp4a", "--top", "200"), run_probe("--kernel", "int4-row", "--top", "200")
    assert "IDP.4A.U8.S8" in dp4a and "IDP.4A.U8.U8" in dp4a and "IDP.4A" not in row, dp4a
    dp4a_cost, row_cost = (float(re.search(r"\(([\d.]+) a weight\)", out).group(1)) for out in (dp4a, row))
    assert dp4a_cost < 0.5 * row_cost, (dp4a_cost, row_cost)


@pytest.mark.skipif(not os.path.exists(sass_probe.nvdisasm()), reason="Triton ships no nvdisasm here")
@pytest.mark.parametrize("kernel,fmt", [("moe-gate-up", "fp8"), ("moe-down", "nvfp4")])
def test_moe_one_token_kernels_multiply_on_the_cuda_cores(kernel, fmt):
    """The MoE GEMV kernels (A1 with FP8's in-kernel quantization, B1 with NVFP4's word decode) compile for sm_90
    and their loops are float FMAs, no tensor-core MMA (the point of them at one token)."""
    out = run_probe("--kernel", kernel, "--format", fmt, "--top", "200")
    assert f"{kernel} on {fmt} experts" in out and "FFMA" in out, out
    assert "HMMA" not in out and "HGMMA" not in out and "QGMMA" not in out, out


@pytest.mark.skipif(not os.path.exists(sass_probe.nvdisasm()), reason="Triton ships no nvdisasm here")
def test_moe_align_kernel_counts_by_warp_ballots():
    """The align kernel compiles for sm_90 and counts a step's pairs by a histogram (ballots and population counts),
    not by one-hot [pairs, experts] tiles: 1,097 instructions for 1,024 pairs, where one-hot tiles took 344 for 32."""
    out = run_probe("--kernel", "align", "--top", "200")
    assert "align counting 1024 pairs a step" in out and "VOTE.ANY" in out and "POPC" in out, out
    assert int(re.search(r"largest loop has (\d+) SASS", out).group(1)) < 2 * 1024, out


def test_align_count_must_be_a_power_of_two(capsys):
    with pytest.raises(SystemExit):
        sass_probe.main(["--kernel", "align", "--count", "48"])
    assert "--count must be a power of two, got 48" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists(sass_probe.nvdisasm()), reason="Triton ships no nvdisasm here")
def test_fp8_skinny_gemm_multiplies_on_fp8_tensor_cores_and_reports_its_waves():
    """The FP8 skinny decode GEMM at 27B's gate/up: Hopper's FP8 warpgroup MMA in its loop, and how many programs
    an SM holds: at 64 rows a tile of 64 columns (4 stages, pointer loads) takes 64 KB of shared memory, 3 programs
    an SM, so its 544 programs are 1.37 waves of 132 SMs (one row: 40 KB, 5 an SM)."""
    tile = ("--block-n", "64", "--warps", "4", "--stages", "4", "--split-k", "1", "--tma", "0")
    wide = run_probe("--kernel", "fp8-skinny", "--top", "200", *tile)
    one = run_probe("--kernel", "fp8-skinny", "--rows", "1", *tile)
    assert "QGMMA" in wide, wide
    held = [int(re.search(r"(\d+) programs an SM", out).group(1)) for out in (wide, one)]
    assert 0 < held[0] < held[1], held
    shared = int(re.search(r"([\d,]+) B of shared memory", wide).group(1).replace(",", ""))
    assert held[0] == sass_probe.programs_per_sm(shared, int(re.search(r"(\d+) registers", wide).group(1)), 4)
    assert f"{544 / (132 * held[0]):.2f} waves" in wide


@pytest.mark.skipif(not os.path.exists(sass_probe.nvdisasm()), reason="Triton ships no nvdisasm here")
def test_fp8_skinny_gemm_with_tma_copies_its_tiles_by_tma():
    """--tma 1 compiles the kernel's TMA form: bulk tensor copies (UTMALDG) instead of per-thread async copies
    (LDGSTS, --tma 0) feed the same FP8 warpgroup MMA."""
    plain, tma = (run_probe("--kernel", "fp8-skinny", "--top", "200", "--tma", flag) for flag in ("0", "1"))
    assert "LDGSTS" in plain and "UTMALDG" not in plain, plain
    assert "UTMALDG" in tma and "LDGSTS" not in tma and "QGMMA" in tma and ", TMA;" in tma, tma


@pytest.mark.skipif(not os.path.exists(sass_probe.nvdisasm()), reason="Triton ships no nvdisasm here")
def test_prompt_rms_norm_reports_the_rows_its_registers_let_an_sm_hold():
    """The prompt step's RMS norm (a 5,120-column row a program) writing FP8 with the bf16 row kept: as the engine
    launches it (outputs 1,024 columns at a time after the sum, a loop) it takes fewer registers a thread than the
    whole-row form (no loop: the whole kernel's instructions are counted), so an SM holds more rows at once; the
    rows reported are programs_per_sm's for the compiled registers and shared memory."""
    chunked = run_probe("--kernel", "rms-norm", "--norm", "fp8-kept", "--warps", "8")
    whole = run_probe("--kernel", "rms-norm", "--norm", "fp8-kept", "--warps", "8", "--out-chunk", "0")
    assert "outputs 1024 columns at a time" in chunked and "its largest loop has" in chunked, chunked
    assert "no loop:" in whole and "columns at a time" not in whole, whole
    regs = [int(re.search(r"(\d+) registers", out).group(1)) for out in (chunked, whole)]
    held = [int(re.search(r"(\d+) programs an SM", out).group(1)) for out in (chunked, whole)]
    assert regs[0] < regs[1] and held[0] > held[1], (chunked, whole)
    for out, r, h in zip((chunked, whole), regs, held):
        shared = int(re.search(r"([\d,]+) B of shared memory", out).group(1).replace(",", ""))
        assert h == sass_probe.programs_per_sm(shared, r, 8) and f"{132 * h} rows in flight" in out


def test_programs_an_sm_holds_are_bounded_by_shared_memory_registers_and_threads():
    assert sass_probe.programs_per_sm(65536, 121, 4) == 3  # shared memory: 228 KB / (64 + 1) KB
    assert sass_probe.programs_per_sm(40960, 48, 4) == 5
    assert sass_probe.programs_per_sm(1024, 255, 8) == 1  # registers: 65,536 / (255 x 256)
    assert sass_probe.programs_per_sm(256, 29, 32) == 2  # threads: 2,048 / 1,024
