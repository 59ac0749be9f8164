"""Table of before/after medians from ab.sh's JSON reports: per (dtype, d, causal, N, pass), the best median of
each version over its rounds (ms), after / before, and each version's spread over its rounds."""
import collections, glob, json, os, sys

out = sys.argv[1]
runs = collections.defaultdict(lambda: collections.defaultdict(list))   # key -> ver -> [ms]
for path in sorted(glob.glob(os.path.join(out, "*-*.json"))):
    ver = os.path.basename(path).split("-")[0]
    for rec in json.load(open(path))["results"]:
        if rec.get("status") != "ok":
            continue
        key = (rec["impl"], rec["dtype"], rec["headdim"], rec["causal"], rec["seqlen_q"], rec["pass"])
        runs[key][ver].append(rec["ms"])
print("| impl | dtype | d | causal | N | pass | before ms | after ms | after/before | spread before | spread after |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
worst = 0
for key in sorted(runs):
    b, a = runs[key]["before"], runs[key]["after"]
    if not a or not b:
        continue
    ratio = min(a) / min(b)
    worst = max(worst, ratio)
    print("| " + " | ".join(map(str, key)) + f" | {min(b):.3f} | {min(a):.3f} | {ratio:.3f} | "
          f"{max(b) / min(b) - 1:.1%} | {max(a) / min(a) - 1:.1%} |")
print(f"\nworst after/before: {worst:.3f}")
