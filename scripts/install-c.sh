#!/usr/bin/env bash
# Installs the pageone C library into PREFIX (default /usr/local):
#   PREFIX/lib/libpageone.so, PREFIX/lib/libpageone.a, PREFIX/include/pageone.h,
#   PREFIX/lib/pkgconfig/pageone.pc
# Then: cc my.c $(pkg-config --cflags --libs pageone)                              (shared)
#       cc my.c $(pkg-config --cflags pageone) PREFIX/lib/libpageone.a -lpthread -ldl -lm -lrt
#                                                                                  (static)
# Usage: scripts/install-c.sh [PREFIX]      (set NO_BUILD=1 to skip `cargo build --release`)
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${1:-${PREFIX:-/usr/local}}"
if [ "${NO_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p pageone-ffi
fi
target="${CARGO_TARGET_DIR:-target}/release"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
install -d "$prefix/lib/pkgconfig" "$prefix/include"
install -m 0755 "$target/libpageone.so" "$prefix/lib/libpageone.so"
install -m 0644 "$target/libpageone.a" "$prefix/lib/libpageone.a"
install -m 0644 include/pageone.h "$prefix/include/pageone.h"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" include/pageone.pc.in \
    >"$prefix/lib/pkgconfig/pageone.pc"
echo "installed pageone $version into $prefix (pkg-config: PKG_CONFIG_PATH=$prefix/lib/pkgconfig)"
