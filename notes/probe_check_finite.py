# Device probe: does OPENWAM_SDPA_CHECK_FINITE=1 raise cleanly from the cuDNN
# backward (which runs on the autograd engine's CUDA thread)?
import faulthandler
import os
import sys

import torch

faulthandler.enable()
import openwam_sdpa as ow  # noqa: E402
from openwam_sdpa.doctor import adversarial_inputs  # noqa: E402

os.environ.update(OPENWAM_SDPA_CUDNN="1", OPENWAM_SDPA_PAD="never", OPENWAM_SDPA_CHECK_FINITE="1")
q, k, v, go = (t.requires_grad_() if i < 3 else t for i, t in enumerate(
    adversarial_inputs(2, 4, 128, 704, 128, device="cuda")))
print("explain", ow.explain(q, k, v), flush=True)
out = ow.sdpa(q.detach().normal_().requires_grad_(), k, v)
torch.autograd.grad(out, (k,), go)
print("finite data: no exception, ok", flush=True)
os.environ["OPENWAM_SDPA_CHECK_FINITE"] = "0"
out = ow.sdpa(q, k, v)
g = torch.autograd.grad(out, (q,), go)[0]
print("check off: non-finite dQ", int((~torch.isfinite(g)).sum()), flush=True)
os.environ["OPENWAM_SDPA_CHECK_FINITE"] = "1"
out = ow.sdpa(q, k, v)
print("about to raise", flush=True)
try:
    torch.autograd.grad(out, (q,), go)
    print("NO EXCEPTION")
except RuntimeError as e:
    print("raised:", str(e)[:400])
sys.stdout.flush()
