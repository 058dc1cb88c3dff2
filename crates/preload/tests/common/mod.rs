//! What the shim's test programs share: compiling the C programs of `tests/c`, and the shim.

use std::path::PathBuf;
use std::process::Command;

/// Compiles `tests/c/NAME.c` into a fresh temporary executable.
#[allow(dead_code)] // (not every test binary uses it)
pub fn compile(name: &str) -> PathBuf {
    compile_with(name, &[])
}

/// The same with extra compiler arguments. (Each call has an executable of its own: tests run in
/// parallel, and each removes its executable when done.)
pub fn compile_with(name: &str, extra: &[&str]) -> PathBuf {
    static BUILT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let bin = std::env::temp_dir().join(format!("pageone-{name}-{}-{n}", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src)
        .args(extra)
        .status()
        .expect("a C compiler (cc)");
    assert!(cc.success(), "compiling {} failed", src.display());
    bin
}

pub fn preload_lib() -> PathBuf {
    // Integration tests live in target/<profile>/deps; cargo builds the cdylib next to it.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let lib = dir.join("libpageone_preload.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    lib
}
