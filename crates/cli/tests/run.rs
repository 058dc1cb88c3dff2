//! `pageone run`: an unmodified C program under the shim with a private daemon, and exit codes.

use std::path::PathBuf;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_pageone");

/// Makes sure an up-to-date shim sits next to the `pageone` binary (a no-op build when the
/// workspace test run built it already).
fn ensure_shim() {
    let dir = PathBuf::from(BIN).parent().unwrap().to_path_buf();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = Command::new(cargo);
    c.args(["build", "-p", "pageone-preload"]);
    if dir.ends_with("release") {
        c.arg("--release");
    }
    assert!(c.status().unwrap().success(), "building the shim failed");
}

#[test]
fn run_gives_an_unmodified_program_pageone_through_a_private_daemon() {
    ensure_shim();
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../preload/tests/c/merge.c");
    let exe = std::env::temp_dir().join(format!("pageone-run-test-{}", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .expect("a C compiler (cc)");
    assert!(cc.success());
    let out = Command::new(BIN)
        .arg("run")
        .arg("--")
        .arg(&exe)
        .env_remove("PAGEONE_SOCKET")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&exe);
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("OK"), "{stdout}");
}

#[test]
fn run_passes_exit_codes_and_signals_on() {
    ensure_shim();
    let code = |script: &str| {
        Command::new(BIN)
            .args(["run", "--", "sh", "-c", script])
            .status()
            .unwrap()
            .code()
    };
    assert_eq!(code("exit 7"), Some(7));
    assert_eq!(code("kill -9 $$"), Some(128 + 9));
    let none = Command::new(BIN)
        .args(["run", "--", "/nonexistent/program"])
        .output()
        .unwrap();
    assert!(!none.status.success());
    assert!(String::from_utf8_lossy(&none.stderr).contains("could not run"));
}
