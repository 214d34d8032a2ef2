# Builds the Python extension openwam_sdpa._C against the torch that is
# already installed. Build with
#     pip install --no-build-isolation .        (or -e .)
# Build isolation would compile against a second, freshly downloaded torch and
# the extension would then fail to load (undefined symbols) in the real one.
#
# Environment knobs:
#   TORCH_CUDA_ARCH_LIST   CUDA targets (default "8.0;9.0;10.0")
#   OPENWAM_SDPA_NO_CUDA=1 build the CPU-only extension even on a CUDA torch
#   CUDNN_FRONTEND_INCLUDE the cuDNN frontend's headers (default: those of the
#                          installed nvidia-cudnn-frontend wheel, version
#                          CUDNN_FRONTEND_VERSION below)
#   OPENWAM_SDPA_NO_FRONTEND=1  a CUDA build without the frontend: every cuDNN
#                          call then runs on ATen's cuDNN attention with padded
#                          inputs (slower; for stacks that cannot have the wheel)
#   OPENWAM_SDPA_CXX_STD   force the C++ standard (17 or 20)
#   OPENWAM_SDPA_DEBUG=1   keep debug info (-g; host code at -O0)
#   OPENWAM_SDPA_ALLOW_PRIVATE_LIBSTDCXX=1  skip the linkage check (BuildAndCheckLinkage)
#   MAX_JOBS               parallel compile jobs (ninja)
#   CUDA_HOME              the CUDA toolkit (else /usr/local/cuda, else nvcc on PATH)
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

try:
    import torch
except ImportError as e:  # pragma: no cover - only hit on a broken setup
    sys.exit(
        "openwam_sdpa builds against the installed torch; install torch first, "
        "then `pip install --no-build-isolation .` "
        f"(import torch failed: {e})"
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0;10.0"
# The cuDNN frontend release the op's graphs were built and tested with. Its
# wheel carries the header-only C++ library (and Python modules the build does
# not use): `pip install --no-deps nvidia-cudnn-frontend==1.32.0`.
CUDNN_FRONTEND_VERSION = "1.32.0"


def _rel(paths):
    # setuptools wants source paths relative to setup.py.
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _find_cuda_home():
    """The CUDA toolkit root holding nvcc and the CUDA headers, or None.

    Resolved before torch.utils.cpp_extension is imported, because that module
    fixes CUDA_HOME at import time and, when nvcc on PATH is a wrapper script
    (/usr/local/bin/nvcc here), guesses /usr/local, which has no CUDA headers.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        if (home and os.path.exists(os.path.join(home, "bin", "nvcc"))
                and os.path.exists(os.path.join(home, "include", "cuda_runtime.h"))):
            return home
    return None


def _pip_cuda_header_dirs(cuda_home):
    """-isystem dirs for CUDA library headers the toolkit lacks.

    ATen/cuda/CUDAContext.h includes cusparse.h, cublas_v2.h, cublasLt.h and
    cusolverDn.h. A minimal toolkit (nvcc + cudart only, as on the dev boxes)
    does not ship them, but the nvidia-* wheels torch depends on do
    (site-packages/nvidia/cu13/include, or nvidia/<lib>/include for CUDA 12).
    -isystem is searched after every -I, so the toolkit's own headers win.
    """
    needed = ("cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h")
    if all(os.path.exists(os.path.join(cuda_home, "include", h)) for h in needed):
        return []
    try:
        import importlib.util
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    dirs = []
    for root in roots:
        for inc in sorted(glob.glob(os.path.join(root, "*", "include"))):
            if any(os.path.exists(os.path.join(inc, h)) for h in needed):
                dirs.append(inc)
    return dirs


def _cudnn_frontend_include():
    """The include dir holding cudnn_frontend.h, or None.

    The nvidia-cudnn-frontend wheel installs its headers under <site>/include;
    CUDNN_FRONTEND_INCLUDE overrides. A frontend other than the tested release
    is refused: its graph API and validation change between releases.
    """
    override = os.environ.get("CUDNN_FRONTEND_INCLUDE")
    if override:
        candidates = [override]
    else:
        try:
            from importlib import metadata
            dist = metadata.distribution("nvidia-cudnn-frontend")
        except Exception:  # not installed
            return None
        if dist.version != CUDNN_FRONTEND_VERSION:
            sys.exit(
                f"openwam_sdpa: nvidia-cudnn-frontend {dist.version} is installed; this release "
                f"builds its cuDNN graphs with {CUDNN_FRONTEND_VERSION}: "
                f"pip install --no-deps nvidia-cudnn-frontend=={CUDNN_FRONTEND_VERSION} "
                "(or point CUDNN_FRONTEND_INCLUDE at those headers)")
        candidates = [str(dist.locate_file("include"))]
    for inc in candidates:
        if os.path.exists(os.path.join(inc, "cudnn_frontend.h")):
            return inc
    return None


def _cudnn_dirs(cuda_home):
    """(include dir with cudnn.h, path of the libcudnn.so.9 torch loads), or None.

    torch's CUDA wheels depend on nvidia-cudnn-cu1x, which ships both; the
    extension links that file, so the loader finds the library torch already
    loaded (same soname) and both use one cuDNN.
    """
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    roots = []
    try:
        import importlib.util
        spec = importlib.util.find_spec("nvidia")
        if spec and spec.submodule_search_locations:
            roots = [os.path.join(r, "cudnn") for r in spec.submodule_search_locations]
    except (ImportError, ValueError):
        pass
    roots += [cuda_home, "/usr", "/usr/local/cudnn"]
    for root in roots:
        inc = os.path.join(root, "include")
        if not os.path.exists(os.path.join(inc, "cudnn.h")):
            continue
        for lib in (os.path.join(root, "lib", "libcudnn.so.9"),
                    os.path.join(root, "lib64", "libcudnn.so.9"),
                    os.path.join(root, "lib", "x86_64-linux-gnu", "libcudnn.so.9"),
                    os.path.join(lib_dir, "libcudnn.so.9")):
            if os.path.exists(lib):
                return inc, lib
    return None


def _nvrtc_lib(cuda_home):
    """The libnvrtc that torch's CUDA build ships (or the toolkit's), or None.

    The frontend's headers call NVRTC for its open-source engines (never for
    attention); the symbols must resolve when the extension loads.
    """
    roots = []
    try:
        import importlib.util
        spec = importlib.util.find_spec("nvidia")
        if spec and spec.submodule_search_locations:
            roots = list(spec.submodule_search_locations)
    except (ImportError, ValueError):
        pass
    found = [p for r in roots for p in sorted(glob.glob(os.path.join(r, "*", "lib", "libnvrtc.so.1*")))
             if re.search(r"libnvrtc\.so\.\d+$", p)]
    found += [p for p in (os.path.join(cuda_home, "lib64", "libnvrtc.so"),
                          os.path.join(cuda_home, "lib", "libnvrtc.so")) if os.path.exists(p)]
    return found[0] if found else None


def _cxx_standard():
    """17 if the installed torch headers accept C++17, else 20.

    ATen/ATen.h states its minimum (`__cplusplus < 201703L` up to torch 2.13,
    `< 202002L` from torch 2.14 on, which then #errors under C++17).
    """
    forced = os.environ.get("OPENWAM_SDPA_CXX_STD")
    if forced:
        if forced not in ("17", "20"):
            sys.exit(f"OPENWAM_SDPA_CXX_STD must be 17 or 20, got {forced!r}")
        return forced
    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ATen.h")
    try:
        with open(header) as f:
            m = re.search(r"__cplusplus\s*<\s*(\d{6})L", f.read())
    except OSError:
        m = None
    if m is None:
        return "20"  # unknown layout: the newer standard is the safe guess
    return "17" if int(m.group(1)) <= 201703 else "20"


want_cuda = bool(torch.version.cuda) and os.environ.get("OPENWAM_SDPA_NO_CUDA", "0") in ("", "0")
cuda_home = _find_cuda_home() if want_cuda else None
if want_cuda and cuda_home is None:
    print(
        "openwam_sdpa: WARNING: torch was built with CUDA "
        f"{torch.version.cuda} but no CUDA toolkit (nvcc + headers) was found; "
        "set CUDA_HOME. Building the CPU-only extension (no CUDA kernels).",
        file=sys.stderr,
    )
with_cuda = cuda_home is not None
if with_cuda:
    os.environ["CUDA_HOME"] = cuda_home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH_LIST)

# Imported only now: it reads CUDA_HOME at import time.
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

std = _cxx_standard()
sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "*.cpp"))) + [
    os.path.join("csrc", "python", "module.cpp")
]
debug = os.environ.get("OPENWAM_SDPA_DEBUG", "0") not in ("", "0")
# Python's sysconfig adds -g; -g0 (later on the line, so it wins) cuts compile
# time by about a quarter and the .so from ~23 MB to ~0.6 MB (CPU build).
cxx_flags = ["-O3", f"-std=c++{std}"] + (["-g", "-O0"] if debug else ["-g0"])
if std == "17":
    # torch 2.13 headers use C++20 bit-field initialisers, which GCC and clang
    # accept in C++17 mode with a warning in every translation unit.
    cxx_flags.append("-Wno-c++20-extensions")
define_macros = []
ext_kwargs = dict(
    include_dirs=[os.path.join(ROOT, "csrc")],
    define_macros=define_macros,
)

with_frontend = with_cuda and os.environ.get("OPENWAM_SDPA_NO_FRONTEND", "0") in ("", "0")
if with_cuda:
    define_macros.append(("OPENWAM_WITH_CUDA", None))
    # define_macros reach nvcc too; -lineinfo only maps SASS to source lines
    # for ncu / compute-sanitizer and does not change the generated code.
    nvcc_flags = ["-O3", f"-std=c++{std}", "-lineinfo"]
    for inc in _pip_cuda_header_dirs(cuda_home):
        cxx_flags += ["-isystem", inc]
        nvcc_flags += ["-isystem", inc]
    link_args = []
    sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    if with_frontend:
        frontend_inc = _cudnn_frontend_include()
        cudnn = _cudnn_dirs(cuda_home)
        nvrtc = _nvrtc_lib(cuda_home)
        missing = ([f"the cuDNN frontend's headers (pip install --no-deps "
                    f"nvidia-cudnn-frontend=={CUDNN_FRONTEND_VERSION})"]
                   if frontend_inc is None else [])
        missing += (["cudnn.h and libcudnn.so.9 (the nvidia-cudnn-cu1x wheel that torch's "
                     "CUDA build depends on)"] if cudnn is None else [])
        missing += (["libnvrtc (the nvidia-cuda-nvrtc wheel or the CUDA toolkit)"]
                    if nvrtc is None else [])
        if missing:
            sys.exit("openwam_sdpa: a CUDA build needs " + " and ".join(missing)
                     + "; OPENWAM_SDPA_NO_FRONTEND=1 builds without the frontend (every cuDNN "
                     "call then runs on ATen's cuDNN attention with padded inputs).")
        cudnn_inc, cudnn_lib = cudnn
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cudnn_frontend", "*.cpp")))
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "cudnn_frontend", "*.cu")))
        define_macros.append(("OPENWAM_WITH_CUDNN_FRONTEND", None))
        for inc in (frontend_inc, cudnn_inc):
            cxx_flags += ["-isystem", inc]
            nvcc_flags += ["-isystem", inc]
        # The files themselves, no rpath: at import torch has loaded these
        # sonames (libcudnn.so.9; libnvrtc through its CUDA libraries), and
        # the loader reuses them.
        link_args += [cudnn_lib, nvrtc]
    ext = CUDAExtension(
        name="openwam_sdpa._C",
        sources=sources,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_args,
        **ext_kwargs,
    )
else:
    ext = CppExtension(
        name="openwam_sdpa._C",
        sources=sources,
        extra_compile_args={"cxx": cxx_flags},
        **ext_kwargs,
    )


def _private_stream_symbols(library):
    """Names of std::ostream members (mangled _ZNSo...) that `library` defines
    itself, or None when binutils' nm is not there to tell."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    out = subprocess.run([nm, "-D", "--defined-only", library], capture_output=True, text=True)
    names = [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith("_ZNSo")]


class BuildAndCheckLinkage(BuildExtension):
    """torch's BuildExtension, then a check of what the linker put in _C.so.

    A compiler that links its own copy of libstdc++'s stream code into the .so
    makes it crash formatting its first error message; such a build is refused.
    """

    def build_extensions(self):
        super().build_extensions()
        if os.environ.get("OPENWAM_SDPA_ALLOW_PRIVATE_LIBSTDCXX", "0") not in ("", "0"):
            return
        for ext in self.extensions:
            library = self.get_ext_fullpath(ext.name)
            private = _private_stream_symbols(library)
            if private:
                compiler = " ".join(getattr(self.compiler, "compiler_so", ["?"])[:1])
                sys.exit(
                    f"openwam_sdpa: {os.path.basename(library)} defines {len(private)} "
                    f"std::ostream functions itself (e.g. {private[0]}): the compiler "
                    f"({compiler}) linked a private copy of libstdc++ into it, and such a "
                    "build crashes when it formats an error message. Rebuild with the "
                    "compiler of the system libstdc++, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc "
                    "pip install --no-build-isolation . (OPENWAM_SDPA_ALLOW_PRIVATE_LIBSTDCXX=1 "
                    "skips this check)."
                )


print(
    f"openwam_sdpa: torch {torch.__version__}, "
    + (f"CUDA build ({cuda_home}, arch {os.environ['TORCH_CUDA_ARCH_LIST']}, "
       + (f"cuDNN frontend {CUDNN_FRONTEND_VERSION})" if with_frontend else "no cuDNN frontend)")
       if with_cuda else "CPU-only build")
    + f", C++{std}",
    file=sys.stderr,
)

setup(
    packages=sorted({"openwam_sdpa", *find_packages("python")}),
    package_dir={"": "python"},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildAndCheckLinkage},
    zip_safe=False,
)
