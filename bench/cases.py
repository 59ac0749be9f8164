"""The problems to time: one ``Case`` per shape and option set, and the default sweep.

The default sweep is flash-attn's benchmark setting (``benchmarks/benchmark_flash_attention.py``,
also the FlashAttention-2 paper's Figures 4-7): a fixed number of tokens
``batch * seqlen = 16384`` and a fixed model width ``nheads * headdim = 2048``,
for seqlen 512 .. 16k, head dim 64 and 128, causal and not.  Every shape then
moves the same amount of Q/K/V data and only the attention work grows with seqlen.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bench.flops import NO_WINDOW, attention_flops

DTYPES = ("float16", "bfloat16", "float32")
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HEADDIMS = (64, 128)
DEFAULT_TOKENS = 16384       # batch * seqlen
DEFAULT_HIDDEN = 2048        # nheads * headdim
# The quick set, ``python -m bench`` without shape options: the same family of shapes (16k tokens,
# width 2048) at two lengths, the training passes (fwd, fwd+bwd) and the implementations that decide
# "is it worth it?" (bench.impls.QUICK_IMPLS); ``--full`` runs the sweep above.
QUICK_SEQLENS = (1024, 4096)
QUICK_HEADDIMS = (64, 128)
QUICK_PASSES = ("fwd", "fwdbwd")


@dataclass(frozen=True)
class Case:
    """One attention problem, in flash-attn's layout (batch, seqlen, nheads, headdim)."""
    dtype: str
    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    causal: bool
    window: tuple[int, int] = NO_WINDOW
    dropout_p: float = 0.0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        for name in ("batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "headdim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.nheads % self.nheads_k:
            raise ValueError(f"nheads ({self.nheads}) must be a multiple of nheads_k ({self.nheads_k})")
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {self.dropout_p}")

    @property
    def softmax_scale(self) -> float:
        return self.headdim ** -0.5

    def flops(self, pass_: str) -> int:
        return attention_flops(self.batch, self.nheads, self.seqlen_q, self.seqlen_k, self.headdim,
                               self.causal, self.window, pass_)

    def label(self) -> str:
        """Short human description, for progress lines and messages."""
        n = str(self.seqlen_q) if self.seqlen_q == self.seqlen_k else f"{self.seqlen_q}x{self.seqlen_k}"
        heads = str(self.nheads) if self.nheads == self.nheads_k else f"{self.nheads}/{self.nheads_k}"
        extra = "".join([" causal" if self.causal else "",
                         f" window={self.window}" if self.window != NO_WINDOW else "",
                         f" dropout={self.dropout_p}" if self.dropout_p else ""])
        return f"{self.dtype} B={self.batch} H={heads} N={n} d={self.headdim}{extra}"

    def fields(self) -> dict:
        """The case as flat record fields (window split into two integers)."""
        d = dataclasses.asdict(self)
        d["window_left"], d["window_right"] = d.pop("window")
        return d


def sweep(dtypes=("float16",), seqlens=DEFAULT_SEQLENS, headdims=DEFAULT_HEADDIMS,
          causals=(False, True), *, batch=None, nheads=None, nheads_k=None, seqlen_k=None,
          tokens=DEFAULT_TOKENS, hidden=DEFAULT_HIDDEN, window=NO_WINDOW, dropout_p=0.0) -> list[Case]:
    """All cases of a sweep, ordered dtype, headdim, causal, seqlen (like the anchor tables).

    ``batch`` defaults to ``tokens // seqlen`` (at least 1) and ``nheads`` to
    ``hidden // headdim`` (at least 1); ``nheads_k`` defaults to ``nheads``;
    ``seqlen_k`` to ``seqlen_q``.
    """
    cases = []
    for dtype in dtypes:
        for d in headdims:
            for causal in causals:
                for n in seqlens:
                    h = nheads if nheads is not None else max(1, hidden // d)
                    cases.append(Case(
                        dtype=dtype,
                        batch=batch if batch is not None else max(1, tokens // n),
                        nheads=h,
                        nheads_k=nheads_k if nheads_k is not None else h,
                        seqlen_q=n,
                        seqlen_k=seqlen_k if seqlen_k is not None else n,
                        headdim=d, causal=causal, window=tuple(window), dropout_p=dropout_p))
    return cases
