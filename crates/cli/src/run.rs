//! `pageone run`: runs a command under the `LD_PRELOAD` shim, sharing through a daemon.

use std::ffi::OsString;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::scope;

/// The shim: `$PAGEONE_PRELOAD`, else `libpageone_preload.so` next to this executable.
fn preload_library() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PAGEONE_PRELOAD") {
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
    let socket = match daemon {
        Some(s) => s,
        None => {
            let default = scope::socket_or_default(None);
            if UnixStream::connect(&default).is_ok() {
                default
            } else {
                let s =
                    std::env::temp_dir().join(format!("pageone-run-{}.sock", std::process::id()));
                private = Some(scope::spawn_daemon(&s)?);
                s
            }
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
    if let Some(mut d) = private {
        let _ = d.kill();
        let _ = d.wait();
        let _ = std::fs::remove_file(&socket);
    }
    let status = status.with_context(|| format!("could not run {}", program.to_string_lossy()))?;
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        _ => 1,
    })
}
