//! `pageone run`: an unmodified C program under the shim with a private daemon, exit codes,
//! signals passed on, nothing left behind, exec when a daemon is there, and a private daemon
//! that dies started again.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

/// Forked children of a merging program merge through the daemon too: each child's engine joins
/// it as a client of its own (`tests/c/children.c` of the shim).
#[test]
fn run_gives_forked_children_pageone_through_the_daemon() {
    ensure_shim();
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../preload/tests/c/children.c");
    let exe = std::env::temp_dir().join(format!("pageone-run-children-{}", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .expect("a C compiler (cc)");
    assert!(cc.success());
    for check in ["merge", "grandchild"] {
        let out = private_run()
            .arg("--")
            .arg(&exe)
            .arg(check)
            .env("PAGEONE_MERGE_PERIOD_MS", "20")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
        assert!(
            out.status.success() && stdout.contains("OK"),
            "{check}: {stdout}"
        );
    }
    let _ = std::fs::remove_file(&exe);
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

/// `pageone run` with the environment of a machine without a shared daemon or configuration:
/// it starts a private daemon.
fn private_run() -> Command {
    let mut c = Command::new(BIN);
    c.arg("run")
        .env("PAGEONE_SOCKET", "/nonexistent/pageone-test.sock")
        .env("PAGEONE_CONFIG", "/dev/null");
    c
}

/// The children of process `pid` (from /proc/*/stat).
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let ppid: u32 = after.split(' ').nth(1).unwrap().parse().unwrap();
        if ppid == pid {
            out.push(p);
        }
    }
    out
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet: dead all the same).
fn dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat[stat.rfind(')').unwrap() + 2..].starts_with('Z'),
    }
}

fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "timed out: {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts `pageone run -- sh -c SCRIPT` with a private daemon; returns it with its two children
/// (the command, then the daemon) once both run and the script printed its first line.
fn run_script(
    script: &str,
) -> (
    std::process::Child,
    BufReader<std::process::ChildStdout>,
    u32,
    u32,
) {
    let mut run = private_run()
        .args(["--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(run.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let command: u32 = line
        .trim()
        .parse()
        .expect("the script prints its pid first");
    let kids = children(run.id());
    assert!(kids.contains(&command), "{kids:?} {command}");
    let daemon = *kids
        .iter()
        .find(|&&k| k != command)
        .expect("the private daemon");
    (run, out, command, daemon)
}

/// Each signal a process sends `pageone run` reaches the command, `pageone run` exits with the
/// command's status, and the private daemon is gone after it.
#[test]
fn run_passes_signals_on_and_leaves_nothing_behind() {
    ensure_shim();
    for sig in ["TERM", "INT", "HUP", "QUIT", "USR1", "USR2"] {
        let script =
            format!("trap 'echo got {sig}; exit 3' {sig}; echo $$; while :; do sleep 0.05; done");
        let (mut run, mut out, command, daemon) = run_script(&script);
        let k = Command::new("kill")
            .args([&format!("-{sig}"), &run.id().to_string()])
            .status()
            .unwrap();
        assert!(k.success());
        let status = run.wait().unwrap();
        let mut rest = String::new();
        out.read_to_string(&mut rest).unwrap();
        assert_eq!(rest.trim(), format!("got {sig}"), "SIG{sig}");
        assert_eq!(status.code(), Some(3), "SIG{sig}: {status}");
        assert!(dead(command), "SIG{sig}: the command {command} is left");
        assert!(dead(daemon), "SIG{sig}: the daemon {daemon} is left");
    }
}

/// A command that does not catch the signal dies of it: `pageone run` exits with 128 + it.
#[test]
fn run_exits_with_128_plus_the_signal_that_killed_the_command() {
    ensure_shim();
    let (mut run, _out, command, daemon) = run_script("echo $$; exec sleep 100");
    Command::new("kill")
        .args(["-TERM", &run.id().to_string()])
        .status()
        .unwrap();
    let status = run.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{status}");
    assert!(dead(command) && dead(daemon));
}

/// SIGKILL cannot be passed on: the command and the daemon die with `pageone run` all the
/// same (the kernel's parent-death signal).
#[test]
fn kill_9_of_run_takes_the_command_and_daemon_with_it() {
    ensure_shim();
    let (mut run, _out, command, daemon) = run_script("echo $$; exec sleep 100");
    run.kill().unwrap();
    run.wait().unwrap();
    wait_until(
        "the command and the daemon died with pageone run",
        5,
        || dead(command) && dead(daemon),
    );
}

/// With a daemon to join, `pageone run` is the command (exec): same pid, no daemon of its own.
#[test]
fn run_execs_the_command_when_a_daemon_is_there() {
    ensure_shim();
    let dir = std::env::temp_dir().join(format!("pageone-run-exec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("pageone.sock");
    let mut daemon = Command::new(BIN)
        .args(["--config", "/dev/null", "daemon", "--socket"])
        .arg(&socket)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until("the daemon listens", 10, || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let run = Command::new(BIN)
        .args(["--config", "/dev/null", "run", "--daemon"])
        .arg(&socket)
        .args(["--", "sh", "-c", "echo $$ $PAGEONE_SOCKET"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = run.id();
    let out = run.wait_with_output().unwrap();
    let _ = daemon.kill();
    let _ = daemon.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.trim(), format!("{pid} {}", socket.display()));
}

fn status_json(socket: &str) -> Option<serde_json::Value> {
    let out = Command::new(BIN)
        .args([
            "--config",
            "/dev/null",
            "status",
            "--json",
            "--socket",
            socket,
        ])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

/// Pages sharing a copy in scope `name` of the daemon at `socket`, and that daemon's pid.
fn sharing(socket: &str, name: &str) -> Option<(u64, u64)> {
    let v = status_json(socket)?;
    let s = v["scopes"]
        .as_array()?
        .iter()
        .find(|s| s["scope"].as_str() == Some(name))?;
    Some((s["pages_sharing"].as_u64()?, v["pid"].as_u64()?))
}

/// `kill -9` of the private daemon mid-merge: `pageone run` starts it again, the command's
/// engine joins it, and the saving comes back (pages merged before the kill, and pages written
/// after it), with every byte intact.
#[test]
fn a_private_daemon_killed_mid_merge_is_started_again_and_merging_resumes() {
    ensure_shim();
    let dir = std::env::temp_dir().join(format!("pageone-run-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let where_file = dir.join("socket");
    // 32 MiB of 64 contents (many pages per content), merged through the daemon's store.
    let script = format!(
        "printf %s \"$PAGEONE_SOCKET\" > {}; exec {BIN} scope-client --period-ms 50 --mib 32 \
         --distinct 64 --writer",
        where_file.display()
    );
    let mut run = private_run()
        .args(["--scope", "restart", "--", "sh", "-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = run.stdin.take().unwrap();
    let mut out = BufReader::new(run.stdout.take().unwrap());
    let mut ready = String::new();
    out.read_line(&mut ready).unwrap();
    assert!(ready.starts_with("READY"), "{ready}");
    let mut ask = |cmd: &str| {
        use std::io::Write;
        writeln!(stdin, "{cmd}").unwrap();
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        line.trim().to_string()
    };
    let socket = std::fs::read_to_string(&where_file).unwrap();
    let scope = "restart";
    wait_until("pages shared through the private daemon", 30, || {
        sharing(&socket, scope).is_some_and(|(n, _)| n > 1000)
    });
    let (_, first) = sharing(&socket, scope).unwrap();
    Command::new("kill")
        .args(["-KILL", &first.to_string()])
        .status()
        .unwrap();
    // New contents everywhere: merging them needs a daemon again.
    assert_eq!(ask("REWRITE"), "REWRITTEN");
    let t0 = Instant::now();
    wait_until("the saving back on a new daemon", 15, || {
        sharing(&socket, scope).is_some_and(|(n, pid)| pid != first && n > 1000)
    });
    println!(
        "saving back {:.1} s after the kill",
        t0.elapsed().as_secs_f64()
    );
    let stats: serde_json::Value = serde_json::from_str(&ask("STATS")).unwrap();
    assert_eq!(stats["daemon"], "connected", "{stats}");
    assert!(stats["daemon_joins"].as_u64() >= Some(1), "{stats}");
    assert_eq!(ask("VERIFY"), "OK");
    drop(stdin);
    let status = run.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        status.success(),
        "the client's final check failed: {status}"
    );
}
