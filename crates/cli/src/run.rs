//! `pageone run`: runs a command under the `LD_PRELOAD` shim, sharing through a daemon, and
//! behaves like `exec` of it.
//!
//! * With a daemon to join (`--daemon`, or one answering on the default socket), it *is* the
//!   command: it `exec`s it, so the pid, the signals and the exit status are the command's.
//! * Else it starts a private daemon for the command's process tree and stays as the command's
//!   parent: it passes SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 on to the command
//!   (those a terminal sends reach the command directly, as the rest of its process group; only
//!   those sent by a process are passed on, so none arrives twice), exits with the command's
//!   status (128 + the signal if it was killed), and never leaves anything behind: the daemon
//!   is stopped when the command ends, and both die with `pageone run` even when it is killed
//!   with SIGKILL (`PR_SET_PDEATHSIG`). The daemon runs in a process group of its own (a
//!   terminal's Ctrl-C is not for it); if it dies anyway, it is started again on the same
//!   socket, and the command's engines join it again within a second or two.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use pageone_engine::proto::{self, socket::PrivateDir};
use pageone_sys as sys;

use crate::config::Loaded;
use crate::scope;

/// Options of `pageone run`.
#[derive(clap::Args)]
pub struct RunOptions {
    /// Scope (tenant) for the command's processes [config: run.scope; default: $PAGEONE_SCOPE,
    /// else "default"].
    #[arg(long)]
    pub scope: Option<String>,
    /// Daemon socket to join [default: the default socket if a daemon serves it, else a private
    /// daemon for this process tree]. With a daemon to join, `pageone run` execs the command.
    #[arg(long)]
    pub daemon: Option<PathBuf>,
    /// The engines' merge period in milliseconds [config: run.period-ms; default: the
    /// engine's].
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    pub period_ms: Option<u64>,
    /// How the engines' threads are scheduled: `auto` (idle priority, but normal for a while
    /// when busy threads starve them while memory is short), `idle` (spare CPU only) or
    /// `normal` [config: run.priority; default: $PAGEONE_PRIORITY, else auto]. A private
    /// daemon's threads too.
    #[arg(long)]
    pub priority: Option<pageone_engine::Priority>,
    /// The command and its arguments (after `--`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    pub cmd: Vec<OsString>,
}

/// The signals passed on to the command.
const FORWARDED: [i32; 6] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];
/// How often the supervisor looks at its children when no signal comes.
const TICK: Duration = Duration::from_millis(200);
/// Least time between two starts of the private daemon.
const RESTART_INTERVAL: Duration = Duration::from_secs(1);

/// Makes a child start with no signal blocked (this process blocks those it handles), and die
/// with SIGKILL when `pageone run` (pid `parent`) dies, however it dies; a child whose parent
/// is already gone exits at once.
fn die_with(c: &mut Command, parent: i32, own_group: bool) {
    // SAFETY: the closure runs in the child between fork and exec and only makes
    // async-signal-safe calls (pthread_sigmask, prctl, getppid, setpgid).
    unsafe {
        c.pre_exec(move || {
            sys::clear_signal_mask()?;
            sys::die_with_parent(libc::SIGKILL, parent)?;
            if own_group {
                sys::own_process_group()?;
            }
            Ok(())
        });
    }
}

/// A daemon for one command's process tree: it listens in a fresh 0700 directory of this user
/// (nobody else can reach or replace its socket), is started again if it dies, and is stopped,
/// its directory removed, when this is dropped.
struct PrivateDaemon {
    child: Child,
    dir: PrivateDir,
    /// `--priority` for the daemon (`None`: its default).
    priority: Option<pageone_engine::Priority>,
    started: Instant,
}

impl PrivateDaemon {
    /// In `$XDG_RUNTIME_DIR`, else the temporary directory.
    fn start(priority: Option<pageone_engine::Priority>) -> Result<Self> {
        let parent = proto::setting("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .unwrap_or_else(std::env::temp_dir);
        let dir = PrivateDir::new(&parent, "pageone-run-")
            .context("could not make a private directory for the daemon")?;
        let child = spawn_daemon(&dir, priority)?;
        Ok(Self {
            child,
            dir,
            priority,
            started: Instant::now(),
        })
    }

    /// Starts the daemon again if it died (at most once per [`RESTART_INTERVAL`]).
    fn keep_alive(&mut self) {
        let Ok(Some(status)) = self.child.try_wait() else {
            return;
        };
        if self.started.elapsed() < RESTART_INTERVAL {
            return;
        }
        self.started = Instant::now();
        eprintln!("pageone run: the private daemon ended ({status}); starting it again");
        match spawn_daemon(&self.dir, self.priority) {
            Ok(child) => self.child = child,
            Err(e) => eprintln!("pageone run: the daemon could not start again: {e:#}"),
        }
    }
}

impl Drop for PrivateDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // (`dir` goes next, with the socket in it.)
    }
}

/// Starts `pageone daemon` in `dir`, with no configuration file (its caps are the defaults; it
/// serves no metrics; its threads' priority is `priority`, else its default), and waits until
/// it listens.
fn spawn_daemon(dir: &PrivateDir, priority: Option<pageone_engine::Priority>) -> Result<Child> {
    let socket = dir.socket();
    let mut c = Command::new(std::env::current_exe()?);
    c.args(["--config", "/dev/null", "daemon", "--socket"])
        .arg(&socket)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if let Some(p) = priority {
        c.arg("--priority").arg(p.to_string());
    }
    die_with(&mut c, std::process::id() as i32, true);
    let mut child = c.spawn().context("could not start the daemon")?;
    if let Err(e) = scope::wait_for_own_daemon(&socket, &mut child) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    Ok(child)
}

/// The default daemon's socket, if a daemon this process trusts answers there.
fn default_daemon(loaded: &Loaded) -> Option<PathBuf> {
    let path = scope::socket_or_default(None, loaded).ok()?;
    scope::connect_trusted(&path).ok().map(|_| path)
}

/// The shim: `$PAGEONE_PRELOAD`, else `libpageone_preload.so` next to this executable, else in
/// `../lib/pageone/` from it (where the package installs it).
fn preload_library() -> Result<PathBuf> {
    if let Some(p) = proto::setting("PAGEONE_PRELOAD") {
        return Ok(p.into());
    }
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let beside = exe.with_file_name("libpageone_preload.so");
    let dir = exe.parent().unwrap_or(std::path::Path::new("/"));
    let installed = dir.join("../lib/pageone/libpageone_preload.so");
    for lib in [&beside, &installed] {
        if lib.exists() {
            return Ok(lib.clone());
        }
    }
    bail!(
        "{} is missing: build it with `cargo build --release -p pageone -p pageone-preload` \
         (or point PAGEONE_PRELOAD at it)",
        beside.display()
    )
}

/// Runs `o.cmd` under the shim and returns the exit code to leave with (128 + signal if
/// killed); with a daemon to join, execs it and returns only if that failed.
pub fn run(o: RunOptions, loaded: &Loaded) -> Result<i32> {
    let Some((program, args)) = o.cmd.split_first() else {
        bail!("no command given: pageone run [--scope S] [--daemon SOCKET] -- CMD ARGS...");
    };
    let lib = preload_library()?;
    let mut preload = OsString::from(&lib);
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    let mut c = Command::new(program);
    c.args(args).env("LD_PRELOAD", preload);
    if let Some(s) = o.scope.as_ref().or(loaded.file.run.scope.as_ref()) {
        c.env("PAGEONE_SCOPE", s);
    }
    if let Some(ms) = o.period_ms.or(loaded.file.run.period_ms.map(|p| p.0)) {
        c.env("PAGEONE_MERGE_PERIOD_MS", ms.to_string());
    }
    let priority = o.priority.or(loaded.file.run.priority.map(|p| p.0));
    if let Some(p) = priority {
        c.env("PAGEONE_PRIORITY", p.to_string());
    }
    let could_not = || format!("could not run {}", program.to_string_lossy());
    // The given daemon, else one already serving the default socket: be the command.
    if let Some(socket) = o.daemon.or_else(|| default_daemon(loaded)) {
        let e = c.env("PAGEONE_SOCKET", &socket).exec();
        return Err(e).with_context(could_not);
    }
    // Else a private daemon for this process tree, and this process stays as its supervisor.
    // The signals to pass on, and children's exits, wait for `supervise` (blocked before any
    // child starts; children start with none blocked).
    let signals = sys::BlockedSignals::block(&[FORWARDED.as_slice(), &[libc::SIGCHLD]].concat())
        .context("could not block signals")?;
    let mut private = PrivateDaemon::start(priority)?;
    c.env("PAGEONE_SOCKET", private.dir.socket());
    die_with(&mut c, std::process::id() as i32, false);
    let child = c.spawn().with_context(could_not)?;
    let status = supervise(child, &mut private, &signals)?;
    drop(private);
    Ok(exit_code(status))
}

/// Waits for the command to end, passing signals on and keeping the daemon alive meanwhile.
fn supervise(
    mut child: Child,
    private: &mut PrivateDaemon,
    signals: &sys::BlockedSignals,
) -> Result<ExitStatus> {
    let pid = child.id() as i32;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        match signals.wait(TICK)? {
            Some(r) if r.signal != libc::SIGCHLD && r.from_process => {
                // (The command may have just exited: then there is nobody to tell.)
                let _ = sys::kill(pid, r.signal);
            }
            // SIGCHLD (the loop looks at both children), or a terminal's signal, which the
            // command, in this process group, got too.
            _ => {}
        }
        private.keep_alive();
    }
}

fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pageone run` uses the daemon it started only if that process is what answers: a socket
    /// answered by anyone else (here, this test) is refused.
    #[test]
    fn a_daemon_that_is_not_our_child_is_refused() {
        let dir = PrivateDir::new(&std::env::temp_dir(), "pageone-run-test-").unwrap();
        let socket = dir.socket();
        let _impostor = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let mut child = Command::new("sleep").arg("10").spawn().unwrap();
        let e = scope::wait_for_own_daemon(&socket, &mut child).unwrap_err();
        let _ = child.kill();
        let _ = child.wait();
        assert!(e.to_string().contains("not by the daemon started"), "{e}");
    }
}
