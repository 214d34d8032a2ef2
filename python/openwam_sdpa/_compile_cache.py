"""Names this build of the extension in torch.compile's cache keys.

torch.compile's caches (AOTAutograd's and inductor's FX graph cache, on disk
under /tmp/torchinductor_<user> by default) key a graph on the ops dynamo
recorded, by name: AOTAutograd counts every OpOverload cacheable (torch 2.11,
`check_node_safe`), so the key holds `openwam::sdpa`, not what this build
decomposes it into. A graph cached by another build of openwam_sdpa would
then run that build's leaf ops and plan numbers. Measured: a model compiled
with a build that converts masks with `openwam::_mask_bias`, then compiled
again with an earlier build, failed from the cache with "no attribute
'_mask_bias'"; a change of a plan's meaning would not fail at all.

`torch.compiler.config.cache_key_tag` enters every one of those keys, so the
extension's file hash is added to it: another build misses the cache once and
compiles afresh. A tag the user set (TORCH_COMPILE_CACHE_KEY_TAG or the
config) is kept in front of ours.

The route and plan a traced graph holds also come from the settings that
choose them (OPENWAM_SDPA_CUDNN, _PAD, _VARLEN) and from the cuDNN that runs
(the guard table's rows are per version). A second tag fingerprints those, set
at import and again by reload_settings(): without it a warm cache kept serving
graphs traced under OPENWAM_SDPA_CUDNN=1 after the switch to 0 (review,
checked on the CPU: an AOTAutograd cache hit after reload_settings() and
torch._dynamo.reset()).
"""

import hashlib
import os

import torch

_PREFIX = "openwam_sdpa="
_SETTINGS_PREFIX = "openwam_sdpa_settings="
# The settings the decision reads while torch.compile traces.
_TRACED_SETTINGS = ("OPENWAM_SDPA_CUDNN", "OPENWAM_SDPA_PAD", "OPENWAM_SDPA_VARLEN")


def build_tag(extension_path: str) -> str:
    """openwam_sdpa=<the first 16 hex digits of the extension file's sha256>."""
    digest = hashlib.sha256()
    with open(extension_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return _PREFIX + digest.hexdigest()[:16]


def settings_tag() -> str:
    """openwam_sdpa_settings=<16 hex digits of the sha256 of the traced settings
    as the environment holds them, and of the running cuDNN's version>."""
    values = [f"{name}={os.environ.get(name, '')}" for name in _TRACED_SETTINGS]
    try:  # cuDNN is loaded with the extension: a query, no load
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except RuntimeError as e:  # torch's own check of its cuDNN: not this import's to fail
        cudnn = f"unavailable ({e})"
    values.append(f"cudnn={cudnn}")
    return _SETTINGS_PREFIX + hashlib.sha256("\n".join(values).encode()).hexdigest()[:16]


def with_build_tag(tag: str, *ours: str) -> str:
    """`tag` with its openwam_sdpa entries (build and settings) replaced by
    `ours` (comma-separated)."""
    kept = [t for t in tag.split(",")
            if t and not t.startswith(_PREFIX) and not t.startswith(_SETTINGS_PREFIX)]
    return ",".join(kept + list(ours))


_build = None  # this process's build tag, set at import


def tag_compile_caches(extension_path: str) -> None:
    global _build
    _build = build_tag(extension_path)
    retag_settings()


def retag_settings() -> None:
    """Our tags again (the settings', after reload_settings()), the build's
    with them: a tag the user assigned since import has lost it (review)."""
    config = torch.compiler.config
    ours = [_build] if _build else []
    config.cache_key_tag = with_build_tag(config.cache_key_tag, *ours, settings_tag())
