#!/bin/bash
# Before/after benchmark of flashnb in one call: the flashnb in .before/ (before) and in the repo root (after),
# alternating processes, ROUNDS rounds; JSON reports under $OUT.  Usage: bash tools/ab_bench.sh ROUNDS [bench args...]
set -o pipefail
rounds=$1; shift
for r in $(seq 1 $rounds); do
  for ver in before after; do
    dir=.; [ $ver = before ] && dir=.before
    (cd $dir && python3 -m bench --no-check --format json -o $OUT/$ver-$r.json "$@" > /dev/null) || echo "FAILED $ver $r"
    echo "done $ver round $r"
  done
done
python3 tools/ab_table.py $OUT | tee $OUT/ab_table.md
