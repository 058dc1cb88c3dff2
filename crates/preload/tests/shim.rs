//! Runs a C program under `LD_PRELOAD=libpageone_preload.so` with KSM off: memory must be saved
//! (so pageone answered), and the program checks every byte and `MADV_DONTNEED` semantics.

use std::path::PathBuf;
use std::process::Command;

/// Compiles `tests/c/NAME.c` into a fresh temporary executable.
fn compile(name: &str) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let bin = std::env::temp_dir().join(format!("pageone-{name}-{}", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .expect("a C compiler (cc)");
    assert!(cc.success(), "compiling {} failed", src.display());
    bin
}

fn preload_lib() -> PathBuf {
    // Integration tests live in target/<profile>/deps; cargo builds the cdylib next to it.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let lib = dir.join("libpageone_preload.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    lib
}

#[test]
fn an_unmodified_c_program_gets_pageone_for_madvise_and_prctl() {
    let ksm_run = std::fs::read_to_string("/sys/kernel/mm/ksm/run").unwrap_or_default();
    assert_ne!(
        ksm_run.trim(),
        "1",
        "KSM is running: it would answer MADV_MERGEABLE too, so this test could not tell"
    );
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/c/merge.c");
    let bin = std::env::temp_dir().join(format!("pageone-shim-test-{}", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O2", "-Wall", "-Werror", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .expect("a C compiler (cc)");
    assert!(cc.success(), "compiling {} failed", src.display());
    let out = Command::new(&bin)
        .env("LD_PRELOAD", preload_lib())
        .env_remove("PAGEONE_SOCKET")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&bin);
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the program failed: {stdout}");
    assert!(stdout.contains("OK"));

    // Without the shim the same program fails (KSM is off): the test can tell the difference.
    let bin2 = std::env::temp_dir().join(format!("pageone-shim-test2-{}", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&bin2)
        .arg(&src)
        .status()
        .unwrap();
    assert!(cc.success());
    let plain = Command::new(&bin2)
        .env("PAGEONE_TEST_WAIT", "3")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&bin2);
    assert!(
        !plain.status.success(),
        "without the shim the program should not save memory"
    );
}

/// Where the shim answers for KSM it answers as the kernel does: the same results and errno for
/// unmapped, partly unmapped and unaligned ranges, extra prctl arguments, and the merge flag.
#[test]
fn the_shim_answers_with_the_kernels_results_and_errno() {
    let bin = compile("parity");
    let run = |preload: bool| {
        let mut c = Command::new(&bin);
        c.env_remove("PAGEONE_SOCKET");
        if preload {
            c.env("LD_PRELOAD", preload_lib());
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let (kernel, shim) = (run(false), run(true));
    let _ = std::fs::remove_file(&bin);
    // The program's lines are not trivially equal: the kernel refuses some of the calls.
    assert!(kernel.contains("Cannot allocate memory") && kernel.contains("Invalid argument"));
    assert_eq!(
        shim, kernel,
        "the shim answered differently from the kernel"
    );
}
