"""scripts/ncu_stalls.py, which joins Nsight Compute's per-instruction stall
samples with a SASS line table: the join by offset, inlined lines, the
refusal of a different build, and the report's sums (synthetic inputs in
the two tools' formats)."""

import subprocess
import sys

import pytest

from support import load_script, script_path

SCRIPT = script_path("ncu_stalls.py")

SASS = """\
.text._ZN7openwam6repair13repair_kernelINS0_4Fp16ELi64EEEvNS0_10ScanParamsENS0_10TileParamsE:
        /*0000*/                   NOP ;
.text._ZN7openwam6repair13repair_kernelINS0_4Bf16ELi128EEEvNS0_10ScanParamsENS0_10TileParamsE:
	//## File "/src/csrc/cuda/repair_dq_tile.cuh", line 10
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "/src/csrc/cuda/repair_dq_ptx.cuh", line 40 inlined at "/src/csrc/cuda/repair_dq_tile.cuh", line 11
	//## File "/src/csrc/cuda/repair_dq_ptx.cuh", line 41
        /*0010*/              @!P0 LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
	//## File "/src/csrc/cuda/repair_dq_tile.cuh", line 12
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   EXIT ;
.text._ZN7openwam6repair13repair_kernelINS0_4Bf16ELi64EEEvNS0_10ScanParamsENS0_10TileParamsE:
        /*0000*/                   EXIT ;
"""

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed",'
          '"stall_barrier","stall_long_sb","stall_barrier (Not Issued)"')
KERNEL = ('"Kernel Name","void openwam::repair::repair_kernel<openwam::repair::Bf16, (int)128>'
          '(openwam::repair::ScanParams, openwam::repair::TileParams)",')


def csv_text(rows):
    return "\n".join(["==PROF== Connected to process 1", KERNEL, HEADER] + rows
                     + ["==PROF== Disconnected from process 1"]) + "\n"


ROWS = [
    '"0x7f0000001000","      LDC R1, c[0x0][0x28]","2","2","128","0","0","0"',
    '"0x7f0000001010","@!P0   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]","5","4","512","0","5","0"',
    '"0x7f0000001020","      BAR.SYNC.DEFER_BLOCKING 0x0","9","9","128","9","0","9"',
    '"0x7f0000001030","      EXIT","0","0","128","0","0","0"',
]


def load():
    return load_script("ncu_stalls.py")


def test_join_takes_the_inlined_functions_own_line():
    tool = load()
    samples = tool.read_samples(csv_text(ROWS).splitlines())
    sass = tool.read_sass(SASS.splitlines(), tool.mangled_hint(samples.kernel))
    assert tool.mangled_hint(samples.kernel) == "Bf16ELi128E"
    where = tool.join(samples, sass)
    assert where == [("repair_dq_tile.cuh", 10), ("repair_dq_ptx.cuh", 41),
                     ("repair_dq_tile.cuh", 12), ("repair_dq_tile.cuh", 12)]
    by_file = tool.aggregate(samples, where, lambda l: l[0])
    assert by_file[0][:3] == ("repair_dq_tile.cuh", 11, 384)
    assert by_file[1][:3] == ("repair_dq_ptx.cuh", 5, 512)
    assert dict(by_file[0][3])["barrier"] == 9


def test_a_different_build_is_refused():
    tool = load()
    other = ROWS[:2] + ['"0x7f0000001020","      NOP","9","9","128","9","0","9"'] + ROWS[3:]
    samples = tool.read_samples(csv_text(other).splitlines())
    sass = tool.read_sass(SASS.splitlines(), "Bf16ELi128E")
    with pytest.raises(ValueError, match="1 of 4 opcodes"):
        tool.join(samples, sass)


def test_command_line_report(tmp_path):
    (tmp_path / "s.csv").write_text(csv_text(ROWS))
    (tmp_path / "k.sass").write_text(SASS)
    run = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "s.csv"), str(tmp_path / "k.sass")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "4 SASS instructions (0.1 KB); 16 stall samples, 896 warp instructions executed" \
        in run.stdout
    assert "barrier 56.2%" in run.stdout
    assert "repair_dq_tile.cuh:12" in run.stdout
    bad = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "s.csv"), str(tmp_path / "k.sass"),
                          "--function", "NoSuchKernel"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no function matching" in bad.stderr


def test_several_launches_or_none_are_refused_without_a_traceback(tmp_path):
    """A PROFILE_MATCH that matches several cases puts one table per launch
    in the file; a profile that timed out puts none."""
    (tmp_path / "k.sass").write_text(SASS)
    (tmp_path / "two.csv").write_text(csv_text(ROWS) + csv_text(ROWS))
    (tmp_path / "none.csv").write_text("==PROF== Connected to process 1\n")
    for name, message in (("two.csv", "2 profiled launches"), ("none.csv", "no per-instruction")):
        run = subprocess.run([sys.executable, SCRIPT, str(tmp_path / name), str(tmp_path / "k.sass")],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, name
        assert message in run.stderr and "Traceback" not in run.stderr, run.stderr
