"""What both model benchmarks share: the attention implementation they add to
transformers' (sdpa without cuDNN), the AdamW trainer and the wall-time figure."""

import torch

import timing

NO_CUDNN = "sdpa_no_cudnn"


def register_no_cudnn():
    """Register "sdpa_no_cudnn" with transformers: its "sdpa" attention inside
    sdpa_kernel(flash, efficient, math), what users pick today to avoid cuDNN's
    NaN. The restriction sits inside the call, so a compiled layer traces it (a
    global switch outside would not be guarded)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def no_cudnn(module, query, key, value, attention_mask, **kwargs):
        with sdpa_kernel(allowed):
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(NO_CUDNN, no_cudnn)
    AttentionMaskInterface.register(NO_CUDNN, sdpa_mask)


def trainer(model, batch, lr):
    """Training on `batch` (the model's keyword arguments) with a fresh AdamW: (step,
    first_step, losses). first_step() also returns the count of non-finite gradient elements
    before the optimizer uses them; losses holds the last step's loss (on the device: reading
    it would synchronise)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=batch["input_ids"].is_cuda)
    losses = []

    def backward():
        opt.zero_grad(set_to_none=True)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
        del losses[:-1]

    def step():
        backward()
        opt.step()

    def first_step():
        backward()
        bad = sum(int((~torch.isfinite(p.grad)).sum()) for p in model.parameters()
                  if p.grad is not None)
        opt.step()
        return bad

    return step, first_step, losses


def wall_figure(step, steps):
    """wall_ms: the median of `steps` steps timed one by one (after one untimed step)."""
    samples = timing.synced_steps_ms(step, steps, warmup=1)
    return {"wall_ms": timing.percentile(samples, 50), "wall_steps_ms": samples}
