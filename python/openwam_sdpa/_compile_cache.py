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
"""

import hashlib

import torch

_PREFIX = "openwam_sdpa="


def build_tag(extension_path: str) -> str:
    """openwam_sdpa=<the first 16 hex digits of the extension file's sha256>."""
    digest = hashlib.sha256()
    with open(extension_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return _PREFIX + digest.hexdigest()[:16]


def with_build_tag(tag: str, ours: str) -> str:
    """`tag` with any openwam_sdpa entry replaced by `ours` (comma-separated)."""
    kept = [t for t in tag.split(",") if t and not t.startswith(_PREFIX)]
    return ",".join(kept + [ours])


def tag_compile_caches(extension_path: str) -> None:
    config = torch.compiler.config
    config.cache_key_tag = with_build_tag(config.cache_key_tag, build_tag(extension_path))
