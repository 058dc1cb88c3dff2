//! Builds `examples/c/dedup.c` with the system C compiler against the library cargo just built
//! (the static and the shared one) and runs it: the C ABI end to end.
//!
//! To link this test, cargo builds every crate type of `pageone-ffi` (cdylib, staticlib, rlib) into
//! `deps/`, the directory of this test binary; so no nested `cargo build` is needed and the
//! profile (debug or release) always matches. (`cargo build` also copies them one level up.)

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The directory holding `libpageone.{a,so}` of this build.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    let deps = exe.parent().expect("deps/");
    for dir in [deps, deps.parent().expect("profile dir")] {
        if dir.join("libpageone.a").exists() && dir.join("libpageone.so").exists() {
            return dir.to_path_buf();
        }
    }
    panic!(
        "libpageone.a / libpageone.so not found next to {}; run this test through \
         `cargo test -p pageone-ffi`",
        exe.display()
    );
}

fn compile(out: &Path, link: &[&str]) {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let root = repo_root();
    let status = Command::new(&cc)
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-std=c11", "-I"])
        .arg(root.join("include"))
        .arg(root.join("examples/c/dedup.c"))
        .args(link)
        .arg("-o")
        .arg(out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}` (set CC): {e}"));
    assert!(status.success(), "compiling examples/c/dedup.c failed");
}

/// Runs the example and checks it merged pages and kept every byte.
fn run(exe: &Path, mib: &str) {
    let out = Command::new(exe)
        .arg(mib)
        .output()
        .expect("run the C example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    assert!(out.status.success(), "the C example failed: {}", out.status);
    let sharing: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("merged: "))
        .and_then(|l| l.split(' ').find_map(|f| f.strip_prefix("pages_sharing=")))
        .and_then(|n| n.parse().ok())
        .expect("the example prints `merged: ... pages_sharing=N`");
    assert!(sharing > 0, "the C example merged nothing");
    assert!(stdout.contains("ok: every byte intact"));
}

#[test]
fn c_example_links_statically_and_merges() {
    let dir = lib_dir();
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pageone-dedup-static");
    let lib = dir.join("libpageone.a");
    let lib = lib.to_str().expect("UTF-8 path");
    // `rustc --print native-static-libs` for this target.
    compile(
        &exe,
        &[
            lib,
            "-lgcc_s",
            "-lutil",
            "-lrt",
            "-lpthread",
            "-lm",
            "-ldl",
            "-lc",
        ],
    );
    run(&exe, "64");
}

#[test]
fn c_example_links_dynamically_and_merges() {
    let dir = lib_dir();
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pageone-dedup-shared");
    let d = dir.to_str().expect("UTF-8 path");
    compile(
        &exe,
        &[&format!("-L{d}"), "-lpageone", &format!("-Wl,-rpath,{d}")],
    );
    run(&exe, "8");
}
