"""scripts/ab_compare.py, the table of device_run.sh's `ab` part: kernel
times of base and new runs of bench_repair_kernel.py on one machine, their
ratio and the base's own spread (synthetic repair_kernel.json files)."""

import json
import subprocess
import sys

from support import load_benchmark, load_script, script_path


def write_run(path, times):
    results = [{"shape": shape, "mask": "none", "head_dim": 128, "share": share,
                "kernels_us": {"repair": us}} for (shape, share), us in times.items()]
    path.write_text(json.dumps({"device": "test", "torch": "x", "cudnn": 0, "results": results}))
    return str(path)


def test_ratio_of_means_and_base_spread(tmp_path):
    tool = load_script("ab_compare.py")
    a, b = ("32x24x360x64", "one_per_head"), ("704", "all")
    base = [tool.kernel_us(write_run(tmp_path / "b1.json", {a: 24.0, b: 570.0})),
            tool.kernel_us(write_run(tmp_path / "b2.json", {a: 25.0, b: 568.0}))]
    new = [tool.kernel_us(write_run(tmp_path / "n1.json", {a: 22.0, b: 583.0})),
           tool.kernel_us(write_run(tmp_path / "n2.json", {b: 581.0}))]  # a: missing in one run
    rows = tool.compare(base, new)
    assert [r["case"][0] for r in rows] == ["704"]  # only cases every run measured
    assert abs(rows[0]["ratio"] - 582.0 / 569.0) < 1e-12
    assert abs(rows[0]["base_spread"] - 570.0 / 568.0) < 1e-12


def test_command_line_table_and_no_common_case(tmp_path):
    case = {("32x24x360x64", "one_per_head"): 24.3}
    b = write_run(tmp_path / "b.json", case)
    n = write_run(tmp_path / "n.json", {("32x24x360x64", "one_per_head"): 22.0})
    run = subprocess.run([sys.executable, script_path("ab_compare.py"), "--base", b, "--new", n],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "| 32x24x360x64 none D128 one_per_head | 24.3 | 22.0 | 0.905 | 1.000 |" in run.stdout
    other = write_run(tmp_path / "o.json", {("704", "all"): 570.0})
    none = subprocess.run([sys.executable, script_path("ab_compare.py"), "--base", b, "--new", other],
                          capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "no case measured in every run" in none.stderr


def test_a_missing_run_is_an_error_not_a_traceback(tmp_path):
    b = write_run(tmp_path / "b.json", {("704", "all"): 570.0})
    run = subprocess.run([sys.executable, script_path("ab_compare.py"), "--base", b, "--new",
                          str(tmp_path / "new_1" / "repair_kernel.json")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "missing or unreadable" in run.stderr and "Traceback" not in run.stderr


def test_every_form_of_the_repair_kernel_is_labelled_repair():
    bench = load_benchmark("bench_repair_kernel.py")
    for name in ("void openwam::repair::repair_kernel<openwam::repair::Bf16, 128, false>(...)",
                 "void openwam::repair::repair_warp_kernel<openwam::repair::Fp16>(...)"):
        assert bench.kernel_label(name) == "repair"
    cudnn = "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64"
    assert bench.kernel_label(cudnn) == cudnn[:40]
