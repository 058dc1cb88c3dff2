#!/usr/bin/env bash
# Builds the Debian package, target/debian/pageone_VERSION-1_ARCH.deb (its path is printed last):
# the pageone command, the LD_PRELOAD shim, the C library (libpageone.so/.a, pageone.h, pageone.pc),
# the systemd unit and its sysusers file, the sysctl.d file, /etc/pageone/pageone.toml, the QEMU
# wrapper for libvirt, man pages and shell completions generated from the command line.
# Installs cargo-deb (crates.io) if it is missing.
# Usage: scripts/deb.sh            (NO_BUILD=1: use the release build already there)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo deb --version >/dev/null 2>&1; then
    cargo install cargo-deb --locked --version '^3'
fi
if [ "${NO_BUILD:-0}" != 1 ]; then
    cargo build --release --locked -p pageone -p pageone-preload -p pageone-ffi
fi
target="${CARGO_TARGET_DIR:-target}/release"
extra="$target/deb-extra"
rm -rf "$extra"
mkdir -p "$extra/man" "$extra/completions"
"$target/pageone" manpages "$extra/man"
gzip -9n "$extra"/man/*.1
"$target/pageone" completions bash >"$extra/completions/pageone"
"$target/pageone" completions zsh >"$extra/completions/_pageone"
"$target/pageone" completions fish >"$extra/completions/pageone.fish"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
sed -e "s|@PREFIX@|/usr|" -e "s|@VERSION@|$version|" include/pageone.pc.in >"$extra/pageone.pc"
cargo deb -p pageone --no-build --locked --strip --output target/debian/ | tail -n1
