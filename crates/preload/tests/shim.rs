//! Runs a C program under `LD_PRELOAD=libpageone_preload.so` with KSM off: memory must be saved
//! (so pageone answered), and the program checks every byte and `MADV_DONTNEED` semantics.

use std::path::PathBuf;
use std::process::Command;

mod common;
use common::{compile, compile_with, preload_lib};

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

/// The randomized model (tests/c/model.c): writers, maps, unmaps (also inside free()), mremaps,
/// partial madvise, mprotect, mlock, forks and signals on merged memory, checked against a shadow
/// after every step. `PAGEONE_MODEL_SECONDS` (default 30) and `PAGEONE_MODEL_SEED` (default: from
/// the clock, printed) replay or lengthen a run:
/// `PAGEONE_MODEL_SEED=N PAGEONE_MODEL_SECONDS=600 cargo test --release -p pageone-preload --test shim randomized`.
#[test]
fn a_randomized_program_never_reads_a_wrong_page() {
    run_model(false, 30.0);
}

/// The same program with its memory advised `MADV_HUGEPAGE` (before it is made mergeable, as QEMU
/// does, and on parts of it, merged ones too), for a shorter time.
#[test]
fn a_randomized_program_on_huge_pages_never_reads_a_wrong_page() {
    run_model(true, 10.0);
}

/// The model with `PR_SET_MEMORY_MERGE` on: its heap, its shadow and its threads' stacks are
/// registered too, beside the engine's own memory, which must stay apart.
#[test]
fn a_randomized_program_merging_everything_never_reads_a_wrong_page() {
    run_model_with(false, 10.0, &[("MODEL_MERGE_ALL", "1")]);
}

/// The model also dropping pages with a `madvise` no shim sees, with a store small enough that
/// freed copies are reused all along: a dropped page reads zeros or bytes it held, never another
/// page's.
#[test]
fn a_randomized_program_dropping_pages_unseen_never_reads_another_page() {
    run_model_with(
        false,
        10.0,
        &[("MODEL_RAW", "1"), ("PAGEONE_STORE_PAGES", "2048")],
    );
}

/// Runs `tests/c/model.c` under the shim for `PAGEONE_MODEL_SECONDS` (else `default_seconds`),
/// with `MODEL_HUGE` set if `huge`, and fails with its output.
fn run_model(huge: bool, default_seconds: f64) {
    run_model_with(huge, default_seconds, &[]);
}

/// [`run_model`] with more environment variables for the model.
fn run_model_with(huge: bool, default_seconds: f64, env: &[(&str, &str)]) {
    let seconds: f64 = std::env::var("PAGEONE_MODEL_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_seconds);
    let seed: u64 = std::env::var("PAGEONE_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("model seed {seed} for {seconds} s (replay: PAGEONE_MODEL_SEED={seed})");
    let bin = compile_with("model", &["-pthread"]);
    let mut cmd = Command::new(&bin);
    if huge {
        cmd.env("MODEL_HUGE", "1");
    }
    cmd.envs(env.iter().copied());
    let mut child = cmd
        .arg(seed.to_string())
        .arg(seconds.to_string())
        .env("LD_PRELOAD", preload_lib())
        .env("PAGEONE_MERGE_PERIOD_MS", "20")
        .env_remove("PAGEONE_SOCKET")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A hang (a writer blocked for ever on a frozen page, a deadlock) is a failure too.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs_f64(seconds + 60.0);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            println!("{}", threads_of(child.id()));
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    let _ = std::fs::remove_file(&bin);
    println!("{out}");
    let status = status.unwrap_or_else(|| panic!("the model hung (seed {seed})"));
    assert!(status.success(), "the model failed (seed {seed}): {out}");
    let merged: usize = out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("merged_mappings="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        merged > 0,
        "nothing merged, so the model checked nothing (seed {seed}): {out}"
    );
}

/// Where each thread of process `pid` and of its children waits (name, kernel wait channel,
/// system call and kernel stack): what a hang report needs.
fn threads_of(pid: u32) -> String {
    let mut out = String::new();
    let mut pids = vec![pid.to_string()];
    if let Ok(c) = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
        pids.extend(c.split_whitespace().map(String::from));
    }
    for p in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        let maps = std::fs::read_to_string(format!("/proc/{p}/maps")).unwrap_or_default();
        // The mapping holding an address a thread waits on (a futex, a range it changes).
        let mapping_of = |addr: &str| {
            let a = usize::from_str_radix(addr.trim_start_matches("0x"), 16).unwrap_or(0);
            maps.lines()
                .find(|l| {
                    let r = l.split_whitespace().next().unwrap_or("");
                    let (s, e) = r.split_once('-').unwrap_or(("0", "0"));
                    let (s, e) = (
                        usize::from_str_radix(s, 16).unwrap_or(0),
                        usize::from_str_radix(e, 16).unwrap_or(0),
                    );
                    s <= a && a < e
                })
                .unwrap_or("(unmapped)")
                .to_string()
        };
        for t in tasks.flatten() {
            let d = t.path();
            let read = |f: &str| std::fs::read_to_string(d.join(f)).unwrap_or_default();
            let syscall = read("syscall");
            let arg0 = syscall.split_whitespace().nth(1).unwrap_or("0");
            out += &format!(
                "process {p} thread {} {}: wchan {}, syscall {}\n  first argument in {}\n{}",
                t.file_name().to_string_lossy(),
                read("comm").trim(),
                read("wchan").trim(),
                syscall.trim(),
                mapping_of(arg0),
                read("stack")
            );
        }
    }
    out
}

/// Runs `tests/c/behaviour.c CHECK` under the shim (KSM off) and fails with its output.
fn behaves(check: &str) {
    behaves_with(check, |_| {});
}

/// [`behaves`], with `setup` applied to the command first.
fn behaves_with(check: &str, setup: impl FnOnce(&mut Command)) {
    let bin = compile("behaviour");
    let mut cmd = Command::new(&bin);
    setup(&mut cmd);
    let out = cmd
        .arg(check)
        .env("LD_PRELOAD", preload_lib())
        .env("PAGEONE_MERGE_PERIOD_MS", "20")
        .env_remove("PAGEONE_SOCKET")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&bin);
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && stdout.contains("OK"),
        "{check}: {stdout}"
    );
}

/// One page's `MADV_DONTNEED` in merged memory drops that page only: it reads zeros, the other
/// merged pages stay merged (not the whole region unmerged); `MADV_FREE` of merged pages works.
#[test]
fn dropping_part_of_merged_memory_drops_only_that_part() {
    behaves("partial-dontneed");
}

/// A forked child that drops merged pages it inherited reads zeros, as under the kernel.
#[test]
fn a_forked_child_drops_inherited_merged_pages_as_the_kernel_does() {
    behaves("child-drop");
}

/// A program may register its own userfaultfd on memory it marked mergeable (QEMU's postcopy).
#[test]
fn userfaultfd_on_mergeable_memory_works() {
    behaves("userfaultfd");
}

/// Merged memory unmaps and moves (`mremap` across its merged pieces) as one mapping would.
#[test]
fn merged_memory_unmaps_and_moves_like_a_mapping() {
    behaves("unmap");
    behaves("remap");
}

/// Memory marked mergeable while `PROT_NONE` or read-only merges once the program makes it
/// read/write (the kernel keeps `VM_MERGEABLE` on it), part by part.
#[test]
fn prot_none_mergeable_memory_merges_once_made_read_write() {
    behaves("protnone");
}

/// Memory advised `MADV_WIPEONFORK` (a crypto library's fork detection) is found empty by a
/// child, whether it was merged before the advice (the kernel refuses the advice on the store's
/// mappings: it is made private first) or advised first (never merged then).
#[test]
fn memory_advised_wipe_on_fork_is_empty_in_a_child() {
    behaves("wipe-on-fork");
}

/// Memory advised not to be dumped or inherited (as QEMU advises guest RAM) keeps the advice
/// through the merge, a page merged again and unregistering.
#[test]
fn advice_not_to_dump_or_inherit_stays_with_merged_memory() {
    behaves("advice");
}

/// Memory advised not to be dumped keeps the advice where the program moves it (`mremap`,
/// through the C library or a raw system call): a page merged again there carries it.
#[test]
fn advice_goes_with_memory_the_program_moves() {
    behaves("advice-moved");
}

/// A program that locks all its memory (`mlockall`, as QEMU's `mem-lock=on`) gets it merged,
/// and locked still.
#[test]
fn locked_memory_merges_and_stays_locked() {
    behaves("mlockall");
}

/// An unprivileged program with a limit on locked memory (8 MiB) locks part of its mergeable
/// memory: the engine takes none of the limit, so the program can still lock up to it.
#[test]
fn the_engine_takes_none_of_an_unprivileged_programs_lock_limit() {
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        eprintln!("skipped: needs root to run the program as nobody");
        return;
    }
    behaves_with("mlock-limited", |c| {
        use std::os::unix::process::CommandExt;
        c.uid(65534).gid(65534);
        // SAFETY: only a system call between fork and exec.
        unsafe {
            c.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: 8 << 20,
                    rlim_max: 8 << 20,
                };
                if libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    });
}

/// A program that locks all its memory once pageone runs: the engine's views of its store are not
/// filled (the kernel's `MCL_CURRENT` would fill them, as large as the memory by default), merged
/// pages stay merged, locked, and memory mapped later merges.
#[test]
fn locking_all_memory_after_merging_fills_nothing_of_the_engines() {
    behaves("mlockall-after");
}

/// A `PROT_NONE` guard page inside a mergeable range: the rest merges, the call answers 0, and the
/// guard page merges once made read/write.
#[test]
fn a_guard_page_inside_a_mergeable_range_does_not_keep_the_rest_from_merging() {
    behaves("guard");
}

/// Mergeable `PROT_NONE` memory unmapped, mapped over or marked unmergeable before it is made
/// read/write is not registered later; moved with `mremap`, it merges at its new place only.
#[test]
fn prot_none_mergeable_memory_is_forgotten_when_unmapped_and_moves_with_mremap() {
    behaves("protnone-forgotten");
    behaves("protnone-remap");
}

/// Runs `tests/c/children.c CHECK` under the shim (KSM off) and fails with its output.
fn children(check: &str) {
    let bin = compile("children");
    let out = Command::new(&bin)
        .arg(check)
        .env("LD_PRELOAD", preload_lib())
        .env("PAGEONE_MERGE_PERIOD_MS", "20")
        .env_remove("PAGEONE_SOCKET")
        .env_remove("PAGEONE_MEMORY_MERGE")
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&bin);
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && stdout.contains("OK"),
        "{check}: {stdout}"
    );
}

/// A forked child keeps merging, as under KSM: its writes over the mergeable memory it inherited
/// merge (with no call the shim sees), and so does memory it maps and marks mergeable; pages the
/// parent merged stay right in both, and drop to zeros in the child.
#[test]
fn a_forked_child_merges_what_it_inherited_and_what_it_maps() {
    children("merge");
}

/// A child's child merges the same way (what it inherited from the child's engine).
#[test]
fn a_forked_grandchild_merges_too() {
    children("grandchild");
}

/// Memory the parent marked mergeable while `PROT_NONE` merges in the child once made read/write,
/// also right after the fork (before the child's engine would start by itself).
#[test]
fn a_forked_child_merges_prot_none_mergeable_memory_once_made_read_write() {
    children("protnone");
}

/// `PR_SET_MEMORY_MERGE` is inherited: the child reads it on and its new large mapping merges.
#[test]
fn a_forked_child_inherits_pr_set_memory_merge() {
    children("merge-all");
}

/// A child that execs right after `fork` starts no engine before it; one that lives on starts its
/// engine a merge period after the fork.
#[test]
fn a_forked_child_starts_its_engine_only_if_it_does_not_exec() {
    children("exec");
}
