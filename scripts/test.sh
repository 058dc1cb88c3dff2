#!/usr/bin/env bash
# The whole pageone test suite. Installs what it needs, then runs formatting, lints,
# unit/property/integration tests (debug and release), the loom models and a minute of fuzzing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Toolchain: rust-toolchain.toml pins the version and components; make sure rustup has them.
if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
fi
if command -v rustup >/dev/null 2>&1; then
    rustup show active-toolchain >/dev/null 2>&1 || rustup toolchain install
    rustup component add rustfmt clippy >/dev/null
fi

# System packages the kernel-path tests and tools need.
need_pkgs=()
command -v cc >/dev/null 2>&1 || need_pkgs+=(build-essential)
command -v python3 >/dev/null 2>&1 || need_pkgs+=(python3)
# The unmodified-QEMU test: TCG guests booting the distribution kernel with a busybox initramfs.
command -v qemu-system-x86_64 >/dev/null 2>&1 || need_pkgs+=(qemu-system-x86)
ls /boot/vmlinuz-* >/dev/null 2>&1 || need_pkgs+=(linux-image-amd64)
[ -x /bin/busybox ] && file -L /bin/busybox 2>/dev/null | grep -q static || need_pkgs+=(busybox-static)
command -v cpio >/dev/null 2>&1 || need_pkgs+=(cpio)
# The older-kernel test: Debian's 6.12 kernel fetched from the archive, its index checked with gpgv.
command -v gpgv >/dev/null 2>&1 || need_pkgs+=(gpgv)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need_pkgs+=(debian-archive-keyring)
command -v file >/dev/null 2>&1 || need_pkgs+=(file)
# `pageone-bench ppr` replays its allocator trace under Debian's jemalloc and mimalloc (LD_PRELOAD).
[ -f /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 ] || need_pkgs+=(libjemalloc2)
[ -f /usr/lib/x86_64-linux-gnu/libmimalloc.so.2 ] || need_pkgs+=(libmimalloc2.0)
# The package test: a clean Debian chroot, and the C example built with the installed pkg-config
# file.
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)
command -v pkg-config >/dev/null 2>&1 || need_pkgs+=(pkg-config)
# libvirt-managed guests through contrib/pageone-qemu-wrapper.
command -v virsh >/dev/null 2>&1 || need_pkgs+=(libvirt-clients)
command -v libvirtd >/dev/null 2>&1 || need_pkgs+=(libvirt-daemon-system)
# `pageone top` on a terminal (its test gives it one with `script`).
command -v script >/dev/null 2>&1 || need_pkgs+=(bsdutils)
# `pageone-bench plot` (and its tests) draws text with a TrueType font read at run time.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need_pkgs+=(fonts-dejavu-core)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}"
fi

step() { printf '\n=== %s\n' "$*"; }

step "format"
cargo fmt --all -- --check
(cd fuzz && cargo fmt -- --check)

step "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "tests (debug)"
cargo test --workspace --locked

step "tests (release: stress and kernel paths)"
cargo test --workspace --release --locked

step "unmodified QEMU guests under pageone run, next to KSM"
cargo build --release --locked -p pageone -p pageone-preload -p pageone-ffi
python3 tests/qemu/run.py

step "an older kernel: the engine's tests and the randomized model on Linux 6.12, a TCG guest"
python3 tests/older-kernel/run.py

step "libvirt: two guests booted with virsh, QEMU under contrib/pageone-qemu-wrapper"
python3 tests/libvirt/run.py

step "package: the .deb (scripts/deb.sh) installed in a clean bookworm chroot, used from its files"
NO_BUILD=1 bash scripts/test-package.sh

step "loom models of the SD tree's lock-free races and of PPR's mark/recycle race"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target-loom LOOM_MAX_PREEMPTIONS=3 \
    cargo test -p pageone-index -p pageone-recycler --test loom --release --locked

step "fuzzing: the frame decoder and the daemon's request handling (60 s; scripts/fuzz.sh N for longer)"
bash scripts/fuzz.sh 60

step "all tests passed"
