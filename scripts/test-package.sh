#!/usr/bin/env bash
# The Debian package, from its one command (scripts/deb.sh), installed with dpkg in a clean
# Debian bookworm (a debootstrap --variant=minbase chroot, cached as target/pkgtest/*.tar and
# unpacked afresh each run), then used from its installed files only: the demo, `pageone run` of
# an unmodified C program through the installed shim, a C program built against the installed
# header and library through the installed pkg-config file, the shipped configuration checked,
# man pages and completions present; then purged. Root only (chroot, mount). Skips, saying so,
# when debootstrap cannot reach the Debian mirror this machine's apt uses.
# Usage: scripts/test-package.sh          (NO_BUILD=1: package the release build already there)
set -euo pipefail
cd "$(dirname "$0")/.."
work=target/pkgtest
cache="$work/bookworm-minbase.tar"
root="$work/root"
mkdir -p "$work"

skip() {
    echo "package test skipped: $*"
    exit 0
}
say() { echo "[package] $*"; }

[ "$(id -u)" = 0 ] || skip "it needs root (chroot and mount)"
command -v debootstrap >/dev/null || skip "debootstrap is not installed (apt-get install debootstrap)"

deb="$(bash scripts/deb.sh | tail -n1)"
[ -f "$deb" ] || { echo "scripts/deb.sh made no package (it said: $deb)"; exit 1; }
say "built $deb"

if [ ! -f "$cache" ]; then
    mirror="$(apt-cache policy 2>/dev/null |
        awk '$3 == "bookworm/main" && $2 ~ /^https?:/ { print $2; exit }')"
    mirror="${mirror:-http://deb.debian.org/debian}"
    say "making a bookworm minbase chroot from $mirror (cached in $cache)"
    tmp="$work/debootstrap.tmp"
    rm -rf "$tmp"
    if ! debootstrap --variant=minbase bookworm "$tmp" "$mirror" >"$work/debootstrap.log" 2>&1; then
        rm -rf "$tmp"
        skip "debootstrap could not make a bookworm chroot from $mirror (see $work/debootstrap.log)"
    fi
    tar -C "$tmp" -cf "$cache.part" . && mv "$cache.part" "$cache"
    rm -rf "$tmp"
fi

cleanup() {
    umount "$root/proc" 2>/dev/null || true
}
trap cleanup EXIT
cleanup
rm -rf "$root"
mkdir -p "$root"
tar -C "$root" -xf "$cache"
# Nothing of this machine's environment goes in.
in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }

cp "$deb" "$root/tmp/pageone.deb"
# (Installed before /proc is mounted: its postinst finds no vm.max_map_count to raise, so the
# test leaves the machine's setting alone.)
in_root dpkg -i /tmp/pageone.deb
status="$(in_root dpkg -s pageone)"
grep -q '^Status: install ok installed' <<<"$status"
in_root getent passwd pageone >/dev/null
for f in usr/bin/pageone usr/lib/pageone/libpageone_preload.so usr/lib/libpageone.so \
    usr/lib/libpageone.a usr/include/pageone.h usr/lib/pkgconfig/pageone.pc \
    usr/lib/systemd/system/pageone.service usr/lib/sysusers.d/pageone.conf \
    usr/lib/sysctl.d/60-pageone.conf etc/pageone/pageone.toml \
    usr/libexec/pageone/pageone-qemu-wrapper usr/share/man/man1/pageone.1.gz \
    usr/share/man/man1/pageone-run.1.gz usr/share/man/man1/pageone-daemon.1.gz \
    usr/share/man/man1/pageone-top.1.gz usr/share/bash-completion/completions/pageone \
    usr/share/zsh/vendor-completions/_pageone usr/share/fish/vendor_completions.d/pageone.fish \
    usr/share/doc/pageone/README.md; do
    [ -e "$root/$f" ] || { echo "the package did not install /$f"; exit 1; }
done
page="$(zcat "$root/usr/share/man/man1/pageone-daemon.1.gz")"
grep -q 'check\\-config' <<<"$page"
grep -q 'ExecStart=/usr/bin/pageone daemon' "$root/usr/lib/systemd/system/pageone.service"
say "installed: $(in_root pageone --version), every file in place, user pageone made"

checked="$(in_root pageone daemon --check-config)"
grep -q '^# configuration OK: /etc/pageone/pageone.toml' <<<"$checked"
say "the shipped /etc/pageone/pageone.toml checks"

mount -t proc proc "$root/proc"
out="$(in_root pageone demo --mib 128)"
echo "$out" | sed 's/^/    /'
grep -q 'saved' <<<"$out"
say "the demo ran from the installed binary"

# Unmodified C programs, built here against the installed files, run in the chroot.
cc -O2 -o "$root/tmp/merge" crates/preload/tests/c/merge.c
out="$(in_root pageone run -- /tmp/merge)"
echo "$out" | sed 's/^/    /'
grep -q 'OK' <<<"$out"
say "pageone run merged an unmodified program through the installed shim"
flags="$(PKG_CONFIG_SYSROOT_DIR="$root" PKG_CONFIG_LIBDIR="$root/usr/lib/pkgconfig" \
    pkg-config --cflags --libs pageone)"
# shellcheck disable=SC2086
cc -O2 -o "$root/tmp/dedup" examples/c/dedup.c $flags
in_root /tmp/dedup | sed 's/^/    /'
say "a C program built with pkg-config against the installed header and library ran"

umount "$root/proc"
in_root dpkg --purge pageone
[ ! -e "$root/usr/bin/pageone" ] && [ ! -e "$root/etc/pageone/pageone.toml" ]
say "purged; package test passed"
