"""HBM traffic of standard and tiled attention: FlashAttention paper, section 3.2 and Theorem 2.

Theorem 2 (Dao et al. 2022): with sequence length N, head dimension d and SRAM
size M (d <= M <= N d), standard attention (Algorithm 0) makes Theta(N d + N^2)
HBM accesses and FlashAttention (Algorithm 1) makes Theta(N^2 d^2 / M).

This module gives both sides of that statement exactly, not just asymptotically:

* closed forms (``*_io`` functions), one term per "Load ... from HBM" /
  "Write ... to HBM" line of the algorithms, returned as an ``IOCount`` of
  elements per tensor;
* the same oracles as ``reference.standard`` and ``reference.flash``, run with an
  ``IOCount`` attached (``*_counted`` functions), which count their own block loads
  and stores as they go. Without masks, closed form == instrumented count, exactly;
  with causal / window / block_mask the instrumented count is smaller (skipped tiles).

Units. Counts are in **elements**; ``IOCount.bytes(elem_bytes)`` converts them,
counting every tensor at ``elem_bytes`` (the paper does the same; the O(N)
statistics ``l, m, lse, delta`` are float32 in real kernels, which changes the
totals by less than 0.1% at headdim 64). SRAM size is given in **bytes**
(``sram_bytes``, e.g. 192 KiB per A100 SM) and converted to the paper's M in
elements, ``M = sram_bytes // elem_bytes``; the block sizes are then the paper's
Algorithm 1, line 1: ``Bc = ceil(M / (4 d))``, ``Br = min(Bc, d)``.

Traffic that the counts leave out: attn_mask / attn_bias / block_mask / ALiBi
inputs and the dropout mask (none of them is in the paper's analysis; the tiled
algorithms regenerate dropout from the seed and store nothing).
"""
from __future__ import annotations

from collections import Counter

from . import flash as _flash
from . import standard as _standard

__all__ = [
    "IOCount", "paper_block_sizes",
    "standard_forward_io", "standard_backward_io",
    "flash1_forward_io", "flash1_backward_io", "flash2_forward_io", "flash2_backward_io",
    "standard_hbm_bytes", "flash_hbm_bytes", "figure2_comparison", "seqlen_sweep",
    "attention_counted", "attention_backward_counted",
    "flash_forward_counted", "flash_forward_v1_counted", "flash_backward_counted", "flash_backward_v1_counted",
    "A100_SRAM_BYTES", "FIGURE2_SETTING", "FIGURE2_PAPER_GB",
]

A100_SRAM_BYTES = 192 * 1024      # on-chip SRAM (L1 / shared memory) per A100 SM, as in the paper's Figure 1
# Figure 2 (left) of the paper: GPT-2 medium attention on an A100, forward + backward, fp16.
FIGURE2_SETTING = dict(batch=64, nheads=16, seqlen=1024, headdim=64, elem_bytes=2)
FIGURE2_PAPER_GB = dict(standard=40.3, flash=4.4)   # measured HBM reads + writes in the paper, GB


# ----------------------------------------------------------------------------- the counter
class IOCount:
    """Elements read from and written to HBM, per tensor name (``"Q"``, ``"K"``, ``"S"``, ``"lse"``...).

    Pass one as ``io_counter=`` to any oracle, or get one from a ``*_io`` model.
    Two counts compare equal when every (tensor, direction) total matches.
    """

    def __init__(self):
        self.reads: Counter = Counter()
        self.writes: Counter = Counter()

    def read(self, name: str, n: int) -> None:
        if n:
            self.reads[name] += int(n)

    def write(self, name: str, n: int) -> None:
        if n:
            self.writes[name] += int(n)

    @property
    def total_reads(self) -> int:
        return sum(self.reads.values())

    @property
    def total_writes(self) -> int:
        return sum(self.writes.values())

    @property
    def total(self) -> int:
        """Elements read plus elements written."""
        return self.total_reads + self.total_writes

    def bytes(self, elem_bytes: int) -> int:
        """Total HBM traffic in bytes, every element counted at ``elem_bytes``."""
        return self.total * elem_bytes

    def as_dict(self) -> dict:
        """``{(tensor, "read" | "write"): elements}``, zero entries left out."""
        d = {(k, "read"): v for k, v in self.reads.items() if v}
        d.update({(k, "write"): v for k, v in self.writes.items() if v})
        return dict(sorted(d.items()))

    def __eq__(self, other):
        return isinstance(other, IOCount) and self.as_dict() == other.as_dict()

    def __add__(self, other: "IOCount") -> "IOCount":
        out = IOCount()
        out.reads = self.reads + other.reads
        out.writes = self.writes + other.writes
        return out

    def __repr__(self):
        return f"IOCount(total={self.total}, {self.as_dict()})"


# ----------------------------------------------------------------------------- block sizes
def paper_block_sizes(headdim: int, sram_bytes: int = A100_SRAM_BYTES, elem_bytes: int = 2) -> tuple[int, int]:
    """Algorithm 1, line 1: ``(block_q, block_k) = (Br, Bc)`` with ``Bc = ceil(M / (4 d))``, ``Br = min(Bc, d)``.

    ``M = sram_bytes // elem_bytes`` is the SRAM size in elements. The factor 4
    leaves room for K_j, V_j (2 Bc d <= M / 2) and Q_i, O_i (2 Br d <= M / 2).
    """
    m_elems = sram_bytes // elem_bytes
    if m_elems < headdim:
        raise ValueError(f"SRAM of {sram_bytes} bytes holds fewer than headdim = {headdim} elements (need M >= d)")
    bc = -(-m_elems // (4 * headdim))                           # ceil(M / (4 d))
    return min(bc, headdim), bc


def _ntiles(n: int, block: int) -> int:
    return -(-n // block)                                       # ceil(n / block), 0 for n == 0


def _gqa_epilogue(c: IOCount, batch, nheads, seqlen_k, headdim, nheads_k):
    """Per-query-head dK, dV summed into nheads_k heads (only when nheads_k < nheads)."""
    if nheads_k is not None and nheads_k != nheads:
        for name in ("dK", "dV"):
            c.read(name, batch * nheads * seqlen_k * headdim)
            c.write(name, batch * nheads_k * seqlen_k * headdim)


# ----------------------------------------------------------------------------- closed forms
def standard_forward_io(batch, nheads, seqlen_q, seqlen_k, headdim, *, nheads_k=None) -> IOCount:
    """Algorithm 0: ``4 Nq Nk + 2 (Nq + Nk) d + Nq`` elements per (batch, head).

    line 1: read Q, K, write S;  line 2: read S, write P (and lse);  line 3: read P, V, write O.
    """
    bh, nq, nk, d = batch * nheads, seqlen_q, seqlen_k, headdim
    c = IOCount()
    c.read("Q", bh * nq * d)
    c.read("K", bh * nk * d)
    c.write("S", bh * nq * nk)
    c.read("S", bh * nq * nk)
    c.write("P", bh * nq * nk)
    c.write("lse", bh * nq)
    c.read("P", bh * nq * nk)
    c.read("V", bh * nk * d)
    c.write("O", bh * nq * d)
    return c


def standard_backward_io(batch, nheads, seqlen_q, seqlen_k, headdim, *, nheads_k=None) -> IOCount:
    """Algorithm 3: ``7 Nq Nk + 4 Nq d + 4 Nk d`` elements per (batch, head), plus the GQA sum.

    line 1: read P, dO, write dV;  line 2: read dO, V, write dP;  line 3: read P, dP, write dS;
    line 4: read dS, K, write dQ;  line 5: read dS, Q, write dK.
    """
    bh, nq, nk, d = batch * nheads, seqlen_q, seqlen_k, headdim
    c = IOCount()
    c.read("P", 2 * bh * nq * nk)
    c.read("dO", 2 * bh * nq * d)
    c.read("V", bh * nk * d)
    c.read("dP", bh * nq * nk)
    c.read("dS", 2 * bh * nq * nk)
    c.read("K", bh * nk * d)
    c.read("Q", bh * nq * d)
    c.write("dV", bh * nk * d)
    c.write("dP", bh * nq * nk)
    c.write("dS", bh * nq * nk)
    c.write("dQ", bh * nq * d)
    c.write("dK", bh * nk * d)
    _gqa_epilogue(c, batch, nheads, seqlen_k, headdim, nheads_k)
    return c


def flash1_forward_io(batch, nheads, seqlen_q, seqlen_k, headdim, block_q, block_k, *, nheads_k=None) -> IOCount:
    """Algorithm 1 (outer K_j, V_j; inner Q_i): ``2 Nk d + Tc (3 Nq d + 4 Nq) + Nq d + 5 Nq`` per (batch, head).

    K, V are read once; each of the ``Tc = ceil(Nk / block_k)`` outer steps reads Q, O, l, m
    and writes O, l, m back. With ``Tc ~ 4 N d / M`` this is the Theta(N^2 d^2 / M) of Theorem 2.
    Also counted: line 2's initialisation (write O, l, m) and the lse epilogue (read l, m, write lse).
    """
    bh, nq, nk, d = batch * nheads, seqlen_q, seqlen_k, headdim
    tc = _ntiles(nk, block_k)
    c = IOCount()
    c.write("O", bh * nq * d * (1 + tc))                        # init + every outer step
    c.write("l", bh * nq * (1 + tc))
    c.write("m", bh * nq * (1 + tc))
    if nq > 0:
        c.read("K", bh * nk * d)
        c.read("V", bh * nk * d)
    c.read("Q", tc * bh * nq * d)
    c.read("O", tc * bh * nq * d)
    c.read("l", (tc + 1) * bh * nq)                             # every outer step + epilogue
    c.read("m", (tc + 1) * bh * nq)
    c.write("lse", bh * nq)
    return c


def flash2_forward_io(batch, nheads, seqlen_q, seqlen_k, headdim, block_q, block_k, *, nheads_k=None) -> IOCount:
    """FA2 forward (outer Q_i; inner K_j, V_j): ``Nq d + 2 Tr Nk d + Nq d + Nq`` per (batch, head).

    Q is read once and O, lse written once; K and V are streamed ``Tr = ceil(Nq / block_q)`` times.
    """
    bh, nq, nk, d = batch * nheads, seqlen_q, seqlen_k, headdim
    tr = _ntiles(nq, block_q)
    c = IOCount()
    if nk > 0:
        c.read("Q", bh * nq * d)
    c.read("K", tr * bh * nk * d)
    c.read("V", tr * bh * nk * d)
    c.write("O", bh * nq * d)
    c.write("lse", bh * nq)
    return c


def flash1_backward_io(batch, nheads, seqlen_q, seqlen_k, headdim, block_q, block_k, *, nheads_k=None) -> IOCount:
    """Algorithm 4 (outer K_j, V_j; inner Q_i), with lse_i read in place of l_i, m_i.

    Per (batch, head): init dQ, dK, dV; read K, V once, write dK, dV once; every one of
    the ``Tc`` outer steps reads Q, O, dO, dQ, lse and writes dQ. ``reference.flash.flash_backward_v1``.
    """
    bh, nq, nk, d = batch * nheads, seqlen_q, seqlen_k, headdim
    tc = _ntiles(nk, block_k)
    c = IOCount()
    c.write("dQ", bh * nq * d * (1 + tc))
    c.write("dK", 2 * bh * nk * d)                              # init + final write
    c.write("dV", 2 * bh * nk * d)
    if nq > 0:
        c.read("K", bh * nk * d)
        c.read("V", bh * nk * d)
    for name in ("Q", "O", "dO", "dQ"):
        c.read(name, tc * bh * nq * d)
    c.read("lse", tc * bh * nq)
    _gqa_epilogue(c, batch, nheads, seqlen_k, headdim, nheads_k)
    return c


def flash2_backward_io(batch, nheads, seqlen_q, seqlen_k, headdim, block_q, block_k, *, nheads_k=None) -> IOCount:
    """FA2 backward: ``delta = rowsum(dO * O)`` computed once, then Algorithm 4's loops without O.

    Per (batch, head): preprocessing reads dO, O and writes delta; init dQ; K, V read once and
    dK, dV written once; every one of the ``Tc`` outer steps reads Q, dO, dQ, lse, delta and
    writes dQ. ``reference.flash.flash_backward``.
    """
    bh, nq, nk, d = batch * nheads, seqlen_q, seqlen_k, headdim
    tc = _ntiles(nk, block_k)
    c = IOCount()
    c.read("dO", bh * nq * d * (1 + tc))                        # preprocessing + every outer step
    c.read("O", bh * nq * d)
    c.write("delta", bh * nq)
    c.write("dQ", bh * nq * d * (1 + tc))                       # init + every outer step
    if nq > 0:
        c.read("K", bh * nk * d)
        c.read("V", bh * nk * d)
    c.write("dK", bh * nk * d)
    c.write("dV", bh * nk * d)
    c.read("Q", tc * bh * nq * d)
    c.read("dQ", tc * bh * nq * d)
    c.read("lse", tc * bh * nq)
    c.read("delta", tc * bh * nq)
    _gqa_epilogue(c, batch, nheads, seqlen_k, headdim, nheads_k)
    return c


# ----------------------------------------------------------------------------- totals in bytes
def standard_hbm_bytes(batch, nheads, seqlen, headdim, elem_bytes=2, *, backward=True) -> int:
    """Bytes moved by standard attention (forward, plus backward unless ``backward=False``)."""
    c = standard_forward_io(batch, nheads, seqlen, seqlen, headdim)
    if backward:
        c = c + standard_backward_io(batch, nheads, seqlen, seqlen, headdim)
    return c.bytes(elem_bytes)


def flash_hbm_bytes(batch, nheads, seqlen, headdim, elem_bytes=2, sram_bytes=A100_SRAM_BYTES, *,
                    version=1, backward=True) -> int:
    """Bytes moved by FlashAttention-``version`` with the paper's block sizes for ``sram_bytes``.

    Version 1 uses ``(Br, Bc) = paper_block_sizes(...)`` throughout (Algorithms 1 and 4).
    Version 2's forward keeps a *query* block resident instead, so it takes the
    transposed choice ``(block_q, block_k) = (Bc, Br)``; its backward has the same loop
    order as Algorithm 4 and keeps ``(Br, Bc)``.
    """
    br, bc = paper_block_sizes(headdim, sram_bytes, elem_bytes)
    args = (batch, nheads, seqlen, seqlen, headdim)
    if version == 1:
        c = flash1_forward_io(*args, br, bc)
        if backward:
            c = c + flash1_backward_io(*args, br, bc)
    elif version == 2:
        c = flash2_forward_io(*args, bc, br)
        if backward:
            c = c + flash2_backward_io(*args, br, bc)
    else:
        raise ValueError(f"version must be 1 or 2, got {version!r}")
    return c.bytes(elem_bytes)


def figure2_comparison(sram_bytes: int = A100_SRAM_BYTES) -> dict:
    """The paper's Figure 2 (left) setting, modelled: GPT-2 medium, fwd + bwd, fp16, A100.

    Returns a dict with the setting, the block sizes, and HBM traffic in GB (1e9 bytes):
    ``standard_gb``, ``flash1_gb``, ``flash2_gb`` from this model, and the paper's
    measured ``paper_standard_gb`` (40.3) and ``paper_flash_gb`` (4.4).
    docs/algorithm.md, "The IO model against Figure 2", explains the differences.
    """
    s = FIGURE2_SETTING
    args = (s["batch"], s["nheads"], s["seqlen"], s["headdim"], s["elem_bytes"])
    br, bc = paper_block_sizes(s["headdim"], sram_bytes, s["elem_bytes"])
    return dict(
        setting=dict(s, sram_bytes=sram_bytes),
        block_q=br, block_k=bc,
        standard_gb=standard_hbm_bytes(*args) / 1e9,
        flash1_gb=flash_hbm_bytes(*args, sram_bytes, version=1) / 1e9,
        flash2_gb=flash_hbm_bytes(*args, sram_bytes, version=2) / 1e9,
        paper_standard_gb=FIGURE2_PAPER_GB["standard"],
        paper_flash_gb=FIGURE2_PAPER_GB["flash"],
    )


def seqlen_sweep(seqlens=(512, 1024, 2048, 4096, 8192, 16384), *, batch=1, nheads=1, headdim=64,
                 elem_bytes=2, sram_bytes=A100_SRAM_BYTES, backward=True) -> list[dict]:
    """Standard vs FlashAttention-1/2 bytes for each sequence length (square attention).

    Each row: ``seqlen``, ``standard_bytes``, ``flash1_bytes``, ``flash2_bytes``, ``ratio``
    (standard / flash1). Standard grows as ``N d + N^2``, flash as ``N^2 d^2 / M``: both
    are quadratic for large N, and the ratio tends to a constant of order ``M / d^2``.
    """
    rows = []
    for n in seqlens:
        std = standard_hbm_bytes(batch, nheads, n, headdim, elem_bytes, backward=backward)
        f1 = flash_hbm_bytes(batch, nheads, n, headdim, elem_bytes, sram_bytes, version=1, backward=backward)
        f2 = flash_hbm_bytes(batch, nheads, n, headdim, elem_bytes, sram_bytes, version=2, backward=backward)
        rows.append(dict(seqlen=n, standard_bytes=std, flash1_bytes=f1, flash2_bytes=f2, ratio=std / f1))
    return rows


# ----------------------------------------------------------------------------- instrumented oracles
def attention_counted(q, k, v, **opts):
    """``reference.attention`` with its HBM traffic: ``(out, lse, IOCount)``."""
    c = IOCount()
    return (*_standard.attention(q, k, v, io_counter=c, **opts), c)


def attention_backward_counted(dout, q, k, v, **opts):
    """``reference.attention_backward`` with its HBM traffic (Algorithm 3, P given): ``(dq, dk, dv, IOCount)``."""
    c = IOCount()
    return (*_standard.attention_backward(dout, q, k, v, io_counter=c, **opts), c)


def flash_forward_counted(q, k, v, block_q, block_k, **opts):
    """``reference.flash_forward`` (FA2) with its HBM traffic: ``(out, lse, IOCount)``."""
    c = IOCount()
    return (*_flash.flash_forward(q, k, v, block_q, block_k, io_counter=c, **opts), c)


def flash_forward_v1_counted(q, k, v, block_q, block_k, **opts):
    """``reference.flash_forward_v1`` (FA1 Algorithm 1) with its HBM traffic: ``(out, lse, IOCount)``."""
    c = IOCount()
    return (*_flash.flash_forward_v1(q, k, v, block_q, block_k, io_counter=c, **opts), c)


def flash_backward_counted(dout, q, k, v, out, lse, block_q, block_k, **opts):
    """``reference.flash_backward`` (FA2 delta) with its HBM traffic: ``(dq, dk, dv, IOCount)``."""
    c = IOCount()
    return (*_flash.flash_backward(dout, q, k, v, out, lse, block_q, block_k, io_counter=c, **opts), c)


def flash_backward_v1_counted(dout, q, k, v, out, lse, block_q, block_k, **opts):
    """``reference.flash_backward_v1`` (FA1 Algorithm 4) with its HBM traffic: ``(dq, dk, dv, IOCount)``."""
    c = IOCount()
    return (*_flash.flash_backward_v1(dout, q, k, v, out, lse, block_q, block_k, io_counter=c, **opts), c)
