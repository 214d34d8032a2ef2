# Device probe: does OPENWAM_SDPA_CHECK_FINITE=1 raise cleanly from the cuDNN
# backward (which runs on the autograd engine's CUDA thread)? On 2026-11-30 it
# segfaulted; the machine has no gdb, so:
#   gcc -shared -fPIC -o /tmp/segv.so notes/segv_backtrace.c
#   LD_PRELOAD=/tmp/segv.so python3 notes/probe_check_finite.py 2>&1 | python3 notes/symbolize.py
# showed the crash inside std::ostream::_M_insert<long>, a copy of which the
# extension itself defined: /opt/gcc/bin/g++ (the machine's CXX) had linked
# libstdc++ stream code into _C.so. Built with /usr/bin/g++ the probe and
# tests/test_errors.py pass; setup.py now refuses the first kind of build.
import faulthandler
import os
import sys

import torch

faulthandler.enable()
import openwam_sdpa as ow  # noqa: E402
from openwam_sdpa.doctor import adversarial_inputs  # noqa: E402

os.environ.update(OPENWAM_SDPA_CUDNN="1", OPENWAM_SDPA_PAD="never", OPENWAM_SDPA_CHECK_FINITE="1")
q, k, v, go = adversarial_inputs(2, 4, 128, 704, 128, device="cuda")
q, k, v = (t.requires_grad_() for t in (q, k, v))
print("explain", ow.explain(q, k, v), flush=True)

q_random = torch.randn_like(q).requires_grad_()
out = ow.sdpa(q_random, k, v)
torch.autograd.grad(out, (q_random,), go)
print("random q: no exception, ok", flush=True)

os.environ["OPENWAM_SDPA_CHECK_FINITE"] = "0"
out = ow.sdpa(q, k, v)
g = torch.autograd.grad(out, (q,), go)[0]
print("check off: non-finite dQ", int((~torch.isfinite(g)).sum()), flush=True)

os.environ["OPENWAM_SDPA_CHECK_FINITE"] = "1"
for how in ("autograd.grad", "backward"):
    out = ow.sdpa(q, k, v)
    print(f"{how}: about to raise", flush=True)
    try:
        if how == "backward":
            out.backward(go)
        else:
            torch.autograd.grad(out, (q,), go)
        print(f"{how}: NO EXCEPTION", flush=True)
    except RuntimeError as e:
        print(f"{how}: raised: {str(e)[:400]}", flush=True)
torch.cuda.synchronize()
print("probe done", flush=True)
sys.stdout.flush()
