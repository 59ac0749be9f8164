"""``python -m reference``: the IO model of reference/io_model.py in two tables.

1. The paper's Figure 2 (left) setting, modelled vs measured.
2. A sweep over sequence length: standard attention's HBM traffic grows as
   N d + N^2, FlashAttention's as N^2 d^2 / M (Theorem 2).
"""
from tabulate import tabulate

from .io_model import A100_SRAM_BYTES, figure2_comparison, paper_block_sizes, seqlen_sweep


def main() -> None:
    f = figure2_comparison()
    s = f["setting"]
    print(f"Figure 2 setting: GPT-2 medium attention, batch {s['batch']}, {s['nheads']} heads, "
          f"seqlen {s['seqlen']}, headdim {s['headdim']}, fp16, forward + backward,\n"
          f"SRAM {s['sram_bytes'] // 1024} KiB -> paper block sizes (Br, Bc) = ({f['block_q']}, {f['block_k']})")
    print(tabulate(
        [["standard (Algorithms 0 + 3)", f["standard_gb"], f["paper_standard_gb"]],
         ["FlashAttention-1 (Algorithms 1 + 4)", f["flash1_gb"], f["paper_flash_gb"]],
         ["FlashAttention-2 order", f["flash2_gb"], None]],
        headers=["HBM reads + writes", "model (GB)", "paper, measured (GB)"],
        floatfmt=".1f", missingval="-"))
    print("(docs/algorithm.md, 'The IO model against Figure 2', discusses why model and measurement differ.)\n")

    headdim = 64
    br, bc = paper_block_sizes(headdim, A100_SRAM_BYTES, 2)
    print(f"Per (batch, head), headdim {headdim}, fp16, forward + backward, SRAM {A100_SRAM_BYTES // 1024} KiB "
          f"(Br, Bc) = ({br}, {bc}):")
    rows = [[r["seqlen"], r["standard_bytes"] / 2**20, r["flash1_bytes"] / 2**20, r["flash2_bytes"] / 2**20,
             r["ratio"]] for r in seqlen_sweep()]
    print(tabulate(rows, headers=["seqlen", "standard (MiB)", "FA1 (MiB)", "FA2 (MiB)", "standard / FA1"],
                   floatfmt=("d", ".1f", ".1f", ".1f", ".2f")))


if __name__ == "__main__":
    main()
