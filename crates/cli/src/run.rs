//! `pageone run`: runs a command under the `LD_PRELOAD` shim, sharing through a daemon.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command};

use anyhow::{bail, Context, Result};
use pageone_engine::proto::{self, socket::PrivateDir};

use crate::scope;

/// A daemon for one command's process tree: it listens in a fresh 0700 directory of this user
/// (nobody else can reach or replace its socket), and is stopped, its directory removed, when
/// this is dropped.
struct PrivateDaemon {
    child: Child,
    dir: PrivateDir,
}

impl PrivateDaemon {
    /// In `$XDG_RUNTIME_DIR`, else the temporary directory.
    fn start() -> Result<Self> {
        let parent = proto::setting("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .unwrap_or_else(std::env::temp_dir);
        let dir = PrivateDir::new(&parent, "pageone-run-")
            .context("could not make a private directory for the daemon")?;
        let child = scope::spawn_daemon(&dir.socket())?;
        Ok(Self { child, dir })
    }
}

impl Drop for PrivateDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // (`dir` goes next, with the socket in it.)
    }
}

/// The default daemon's socket, if a daemon this process trusts answers there.
fn default_daemon() -> Option<PathBuf> {
    let path = scope::socket_or_default(None).ok()?;
    scope::connect_trusted(&path).ok().map(|_| path)
}

/// The shim: `$PAGEONE_PRELOAD`, else `libpageone_preload.so` next to this executable.
fn preload_library() -> Result<PathBuf> {
    if let Some(p) = proto::setting("PAGEONE_PRELOAD") {
        return Ok(p.into());
    }
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let lib = exe.with_file_name("libpageone_preload.so");
    if !lib.exists() {
        bail!(
            "{} is missing: build it with `cargo build --release -p pageone -p pageone-preload` \
             (or point PAGEONE_PRELOAD at it)",
            lib.display()
        );
    }
    Ok(lib)
}

/// Runs `cmd` under the shim and returns the exit code to leave with (128 + signal if killed).
pub fn run(scope_name: Option<String>, daemon: Option<PathBuf>, cmd: Vec<OsString>) -> Result<i32> {
    let Some((program, args)) = cmd.split_first() else {
        bail!("no command given: pageone run [--scope S] [--daemon SOCKET] -- CMD ARGS...");
    };
    let lib = preload_library()?;
    // The given daemon, else one already serving the default socket, else a private one for this
    // process tree (stopped when the command exits).
    let mut private = None;
    let socket = match daemon.or_else(default_daemon) {
        Some(s) => s,
        None => {
            let p = PrivateDaemon::start()?;
            let s = p.dir.socket();
            private = Some(p);
            s
        }
    };
    let mut preload = OsString::from(&lib);
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    let mut c = Command::new(program);
    c.args(args)
        .env("LD_PRELOAD", preload)
        .env("PAGEONE_SOCKET", &socket);
    if let Some(s) = &scope_name {
        c.env("PAGEONE_SCOPE", s);
    }
    let status = c.status();
    drop(private);
    let status = status.with_context(|| format!("could not run {}", program.to_string_lossy()))?;
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        _ => 1,
    })
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
