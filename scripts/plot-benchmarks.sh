#!/usr/bin/env bash
# Redraws the plots of docs/benchmarks.md from the JSON beside them in docs/benchmarks/ (the
# page's figures, written out in the benchmarks' own --json format). After a fresh run, plot that
# run's file instead, e.g.:
#   ./target/release/pageone-bench plot target/bench-ksm.json -o docs/benchmarks/ksm.png
# Text needs a TrueType font (fonts-dejavu-core; or PAGEONE_BENCH_FONT=FILE.ttf).
set -euo pipefail
cd "$(dirname "$0")/.."

plot() { # NAME TITLE
    cargo run --quiet --locked -p pageone-bench -- plot "docs/benchmarks/$1.json" \
        -o "docs/benchmarks/$1.png" --title "$2"
}

plot sdtree "SD tree vs memcmp-ordered tree vs xxh3-128 hash index: 262144 keys of 4 KiB, median of 5 runs (409f76c, 2026-11-23)"
plot ksm "pageone vs KSM in one process: 4 x 512 MiB, 100 ms periods, medians of 5 runs (f852a43, 2026-11-24): 5.1x faster on easy data, 5.8x on hard"
plot ksm-processes "pageone, one process per region through the daemon, vs KSM: 4 x 512 MiB, 50 ms periods, medians of 3 runs (0d22a5b, 2026-11-24): 4.8x faster on easy data, 5.4x on hard"
plot qemu "Two QEMU guests under pageone run vs KSM: runs 17 to 62 of tests/qemu/run.py (to 2026-11-24)"
plot ppr "PPR vs madvise(MADV_DONTNEED), the program's cost per freed page: medians of 5 runs (716a551, 2026-11-24)"
plot ppr-allocators "One alloc/free trace (12 phases, peak 256 MiB): PPR heap vs glibc, jemalloc, mimalloc, medians of 3 runs (f877104, 2026-11-25): excess 0.36x jemalloc's, 0.31x mimalloc's, at 9x the CPU"
plot density "192 MiB guests in 1024 MiB, booted together, 45 s of churn (f877104, 2026-11-25, 1 run)"
plot density-staggered "192 MiB guests in 1024 MiB, started 10 s apart, 60 s of churn (5d39c7f, 2026-11-25, 1 run)"
plot scattered-default "Scattered duplicates at the default vm.max_map_count: pageone, pageone handing regions to the kernel's KSM (hybrid), KSM; 4 x 512 MiB, medians of 3 runs (e345bc8, 2026-11-26)"
plot scattered "Scattered duplicates with vm.max_map_count raised: pageone, hybrid, KSM; 4 x 512 MiB, medians of 3 runs (67ac3a4, 2026-11-26)"
