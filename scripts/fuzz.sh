#!/usr/bin/env bash
# Fuzzes the frame decoder and the daemon's request handling (fuzz/, cargo fuzz with
# libFuzzer) for SECONDS in all (default 60), split between the two targets. A panic, or a cap
# of the daemon exceeded, fails the run; the input is kept in fuzz/artifacts/TARGET/ and
# `cargo fuzz run TARGET fuzz/artifacts/TARGET/crash-...` replays it. What was found is kept in
# fuzz/corpus/ for the next run.
#
#   scripts/fuzz.sh            # a minute (what scripts/test.sh runs)
#   scripts/fuzz.sh 3600       # an hour
#
# cargo-fuzz needs nightly features: the pinned stable toolchain (rust-toolchain.toml) gets them
# with RUSTC_BOOTSTRAP=1. cargo-fuzz itself is installed from crates.io when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
total=${1:-60}
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1
targets=(frame_decoder daemon_requests)
each=$(( total / ${#targets[@]} ))
[ "$each" -ge 1 ] || each=1
for t in "${targets[@]}"; do
    echo "=== fuzz $t for $each s"
    cargo fuzz run --fuzz-dir fuzz "$t" -- -max_total_time="$each" -timeout=20 -rss_limit_mb=4096
done
