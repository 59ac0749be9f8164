"""A stand-in ``flash_attn`` package that runs flash-attn's public API on flashnb, for flash-attn's own tests.

Put ``tools/flash_attn_shim`` first on ``sys.path`` (``python -m tools.flash_attn_upstream`` does) and
``import flash_attn`` finds this package instead of flash-attn. It is an adapter only: the attention calls go to
``flashnb.torch`` / ``flashnb.flash_attn_with_kvcache``, the packed variants split the packed tensor into views
and call the unpacked function, and the two helpers the tests import (``bert_padding``, ``layers.rotary``) are
plain PyTorch written from their documented behaviour. What flashnb cannot serve raises ``NotImplementedError``
naming it (tools/README.md, "flash-attn's upstream tests").
"""
__version__ = "2.8.4+flashnb.shim"      # the flash-attn API this shim follows (tests/test_flash_attn.py's)

from flash_attn.flash_attn_interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
