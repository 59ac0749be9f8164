"""Tables from Nsight Compute exports of flashnb's and FlashAttention-2's kernels (bench/results/h100-ncu-*.md).

    python -m tools.ncu_summary DIR [DIR ...]            # kernel metrics and warp stall reasons; stall samples by
                                                          # instruction class
    python -m tools.ncu_summary --blocks fwd|bwd MIN DIR  # straight-line runs of SASS with one execution count
                                                          # whose instructions executed exceed MIN million

Each DIR holds ``raw.csv`` (``ncu --import REP --page raw --csv``) and ``src.csv`` (``ncu --import REP
--page source --csv --print-source sass``) of one report, taken with the sections SpeedOfLight, Occupancy,
LaunchStats, WarpStateStats, SchedulerStats, InstructionStats and SourceCounters (the command is in the
results file).  Stall samples are attributed to the instruction a warp was waiting to issue.
"""
import argparse
import collections
import csv
import os
import re

STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "mio_throttle", "math_pipe_throttle", "wait",
          "not_selected", "selected", "dispatch_stall", "lg_throttle", "no_instruction", "branch_resolving",
          "membar", "misc", "drain", "sleeping", "tex_throttle", "imc_miss")
SHOWN = STALLS[:10]
CLASSES = ("HMMA", "shared ld/st", "global/cp.async", "local", "float", "integer/control")   # "HMMA": every MMA


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def kind_of(name):
    return "fwd" if ("forward" in name or "fwd" in name or "fprop" in name) else "bwd"


def raw_rows(d):
    rows = list(csv.reader(open(os.path.join(d, "raw.csv"))))
    return [dict(zip(rows[0], r)) for r in rows[2:]]          # row 1: units


def source_sections(d):
    """[(kernel name, [row dict per SASS instruction])] of a source-page export."""
    out, hdr = [], None
    for row in csv.reader(open(os.path.join(d, "src.csv"))):
        if row and row[0] == "Kernel Name":
            out.append((row[1], []))
            hdr = None
        elif hdr is None:
            hdr = row
        else:
            out[-1][1].append(dict(zip(hdr, row)))
    return out


def opcode(source):
    s = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return s.split()[0].split(".")[0] if s else ""


def op_class(op):
    if op in ("HMMA", "HGMMA", "QGMMA", "WARPGROUP"):     # mma.sync; wgmma (16-bit, FP8) and its arrive / waits
        return "HMMA"
    if op in ("LDSM", "LDS", "STS", "STSM"):
        return "shared ld/st"
    if op in ("LDG", "STG", "REDG", "RED", "ATOMG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "UTMALDG", "UBLKRED", "SYNCS"):
        return "global/cp.async"                        # (with the copy engine's loads and its mbarrier waits)
    if op in ("LDL", "STL"):
        return "local"
    if op.startswith("F") or op in ("MUFU", "HADD2", "HMUL2", "HFMA2"):
        return "float"
    return "integer/control"


def metrics_table(dirs):
    print("| report | kernel | time (ms) | registers | threads | dyn. shared (KB) | warps per scheduler | tensor pipe (%) "
          "| issue active (%) | eligible warps per cycle | warp instructions (M) | cycles per issue | "
          + " | ".join(SHOWN) + " |")
    print("|" + "---|" * (12 + len(SHOWN)))
    for d in dirs:
        for k in raw_rows(d):
            stall = {s: num(k[f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"]) for s in STALLS}
            print(f"| {os.path.basename(d.rstrip('/'))} | {kind_of(k['Kernel Name'])} "
                  f"| {num(k['gpu__time_duration.sum']):.3f} | {k['launch__registers_per_thread']} "
                  f"| {k['launch__block_size']} | {num(k['launch__shared_mem_per_block_dynamic']):.1f} "
                  f"| {num(k['sm__warps_active.avg.pct_of_peak_sustained_active']) * 16 / 100:.2f} "
                  f"| {num(k['sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed']):.1f} "
                  f"| {num(k['smsp__issue_active.avg.pct_of_peak_sustained_active']):.1f} "
                  f"| {num(k['smsp__warps_eligible.avg.per_cycle_active']):.2f} "
                  f"| {num(k['smsp__inst_executed.sum']) / 1e6:.0f} | {sum(stall.values()):.2f} | "
                  + " | ".join(f"{stall[s]:.2f}" for s in SHOWN) + " |")


def class_table(dirs):
    print("| report | kernel | stall samples (k) | " + " | ".join(f"at {c}" for c in CLASSES)
          + " | executed (M): HMMA / LDSM / integer+control / float / REDG / LDL+STL |")
    print("|" + "---|" * (3 + len(CLASSES) + 1))
    for d in dirs:
        for name, rows in source_sections(d):
            samples, executed, by_op = collections.Counter(), collections.Counter(), collections.Counter()
            for r in rows:
                op = opcode(r["Source"])
                samples[op_class(op)] += num(r["Warp Stall Sampling (All Samples)"])
                executed[op_class(op)] += num(r["Instructions Executed"])
                by_op[op] += num(r["Instructions Executed"])
            total = sum(samples.values())
            print(f"| {os.path.basename(d.rstrip('/'))} | {kind_of(name)} | {total / 1e3:.0f} | "
                  + " | ".join(f"{samples[c] / 1e3:.0f} ({100 * samples[c] / total:.0f}%)" for c in CLASSES)
                  + f" | {by_op['HMMA'] / 1e6:.0f} / {by_op['LDSM'] / 1e6:.0f} / {executed['integer/control'] / 1e6:.0f}"
                  f" / {executed['float'] / 1e6:.0f} / {(by_op['REDG'] + by_op['RED']) / 1e6:.1f}"
                  f" / {(by_op['LDL'] + by_op['STL']) / 1e6:.1f} |")


def blocks(d, which, min_millions):
    """Runs of consecutive SASS instructions with the same execution count (a loop body or a straight-line
    stretch of one), with their share of the stall samples and their most frequent opcodes."""
    for name, rows in source_sections(d):
        if kind_of(name) != which:
            continue
        runs = []
        for i, r in enumerate(rows):
            n = num(r["Instructions Executed"])
            if not runs or n != runs[-1]["n"]:
                runs.append({"n": n, "start": i, "ops": collections.Counter(), "samples": 0.0})
            runs[-1]["ops"][opcode(r["Source"])] += 1
            runs[-1]["samples"] += num(r["Warp Stall Sampling (All Samples)"])
            runs[-1]["end"] = i
        total = sum(x["samples"] for x in runs)
        print(f"{os.path.basename(d.rstrip('/'))} {which}: | SASS lines | executions (k) | instructions | "
              "executed (M) | stall samples | most frequent opcodes |")
        print("|---|---|---|---|---|---|")
        for x in runs:
            length = x["end"] - x["start"] + 1
            if x["n"] * length > min_millions * 1e6:
                print(f"| {x['start']}-{x['end']} | {x['n'] / 1e3:.0f} | {length} | {x['n'] * length / 1e6:.1f} "
                      f"| {100 * x['samples'] / total:.1f}% | "
                      + " ".join(f"{o} {c}" for o, c in x["ops"].most_common(8)) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", nargs=2, metavar=("fwd|bwd", "MIN"))
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args(argv)
    if args.blocks:
        for d in args.dirs:
            blocks(d, args.blocks[0], float(args.blocks[1]))
        return
    metrics_table(args.dirs)
    print()
    class_table(args.dirs)


if __name__ == "__main__":
    main()
