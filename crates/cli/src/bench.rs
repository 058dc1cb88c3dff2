//! `pageone bench ARGS...`: a front for the `pageone-bench` command, which carries the benchmarks
//! (so this binary links no benchmark harness). It runs in this process's place with the same
//! arguments, and is told this executable (`PAGEONE_BIN`) for the runs that start `pageone`
//! processes.

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};

const BENCH: &str = "pageone-bench";

fn executable(p: &Path) -> bool {
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `pageone-bench` in `dir` (this executable's directory), else in a directory of `path`.
pub fn locate(dir: Option<&Path>, path: Option<&OsStr>) -> Result<PathBuf> {
    dir.map(|d| d.join(BENCH))
        .filter(|p| executable(p))
        .or_else(|| {
            std::env::split_paths(path?)
                .map(|d| d.join(BENCH))
                .find(|p| executable(p))
        })
        .ok_or_else(|| {
            anyhow!(
                "`{BENCH}` is neither next to this executable{} nor on PATH: the benchmarks are \
                 their own binary; build it with `cargo build --release -p {BENCH}`",
                dir.map_or(String::new(), |d| format!(" (in {})", d.display()))
            )
        })
}

/// Runs `pageone-bench ARGS...` in this process's place; returns only if it could not.
pub fn run(args: Vec<OsString>) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let bench = locate(exe.parent(), std::env::var_os("PATH").as_deref())?;
    let err = std::process::Command::new(&bench)
        .args(args)
        .env("PAGEONE_BIN", &exe)
        .exec();
    Err(err).with_context(|| format!("could not run {}", bench.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pageone-front-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn put(d: &Path, mode: u32) -> PathBuf {
        let p = d.join(BENCH);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn next_to_this_executable_first_then_path() {
        let (here, on_path, other) = (dir("here"), dir("path"), dir("other"));
        let beside = put(&here, 0o755);
        let found = put(&on_path, 0o755);
        let path = std::env::join_paths([&other, &on_path]).unwrap();
        assert_eq!(locate(Some(&here), Some(&path)).unwrap(), beside);
        assert_eq!(locate(Some(&other), Some(&path)).unwrap(), found);
        assert_eq!(locate(None, Some(&path)).unwrap(), found);
        // A file that cannot be run is not the benchmarks.
        std::fs::set_permissions(&found, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(locate(Some(&other), Some(&path)).is_err());
        for d in [here, on_path, other] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }

    #[test]
    fn absent_says_how_to_build_it() {
        let empty = dir("empty");
        let e = locate(Some(&empty), Some(empty.as_os_str()))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("(in {})", empty.display())), "{e}");
        assert!(
            e.ends_with("build it with `cargo build --release -p pageone-bench`"),
            "{e}"
        );
        assert!(locate(None, None).is_err());
        std::fs::remove_dir_all(empty).unwrap();
    }
}
