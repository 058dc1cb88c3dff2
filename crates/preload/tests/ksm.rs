//! The shim beside the kernel's KSM, running: in a test binary of its own, since every other test
//! of the shim needs KSM stopped (cargo runs test binaries one at a time).

use std::process::Command;

mod common;
use common::{compile_with, preload_lib};

const KSM: &str = "/sys/kernel/mm/ksm";

/// KSM's knobs as they were, restored when dropped (also if the test fails), `run` last.
struct KsmKnobs(Vec<(&'static str, String)>);

impl KsmKnobs {
    /// KSM at its fastest, or `None` where its knobs are not writable (not root).
    fn fastest() -> Option<Self> {
        let names = ["sleep_millisecs", "pages_to_scan", "run"];
        let saved = names
            .iter()
            .map(|&n| Some((n, std::fs::read_to_string(format!("{KSM}/{n}")).ok()?)))
            .collect::<Option<Vec<_>>>()?;
        let knobs = KsmKnobs(saved);
        for (n, v) in [
            ("sleep_millisecs", "0"),
            ("pages_to_scan", "10000"),
            ("run", "1"),
        ] {
            std::fs::write(format!("{KSM}/{n}"), v).ok()?;
        }
        Some(knobs)
    }
}

impl Drop for KsmKnobs {
    fn drop(&mut self) {
        // Stopped with its pages unmerged (2), then as it was.
        let _ = std::fs::write(format!("{KSM}/run"), "2");
        for (n, v) in &self.0 {
            let _ = std::fs::write(format!("{KSM}/{n}"), v.trim());
        }
    }
}

/// Mergeable memory that holds pages while it is read-only or `PROT_NONE` is merged by the
/// kernel's KSM where it runs, as without the shim; made read/write, it is pageone's.
#[test]
fn the_kernels_ksm_merges_mergeable_memory_that_is_not_read_write() {
    let Some(knobs) = KsmKnobs::fastest() else {
        eprintln!("skipped: the kernel's KSM knobs are not writable (needs root)");
        return;
    };
    let bin = compile_with("behaviour", &[]);
    let out = Command::new(&bin)
        .arg("protnone-ksm")
        .env("LD_PRELOAD", preload_lib())
        .env("PAGEONE_MERGE_PERIOD_MS", "20")
        .env_remove("PAGEONE_SOCKET")
        .output()
        .unwrap();
    drop(knobs);
    let _ = std::fs::remove_file(&bin);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("OK"),
        "protnone-ksm failed ({}):\n{text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
