"""The attention implementation both model benchmarks add to transformers'."""

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
