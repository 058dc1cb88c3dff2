//! The processes of the merging benchmark: workload children (`pageone-bench workload`, see
//! [`crate::workload`]) talked to through their standard input and output, and the `pageone
//! daemon` they share through when each region is a process of its own.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use pageone_engine::proto::{self, ProtoError, Reply, Request};

/// Why a run across processes failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {err}")]
    Io { what: String, err: io::Error },
    #[error("the daemon's protocol failed: {0}")]
    Proto(#[from] ProtoError),
    #[error("{0}")]
    Run(String),
}

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let what = what.into();
    move |err| Error::Io { what, err }
}

/// An executable of the build: `$env` if set, else `name` next to this executable, else on
/// `PATH`; `hint` says how to build it when it is nowhere.
pub fn find_beside(env: &str, name: &str, hint: &str) -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os(env) {
        return Ok(p.into());
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join(name)));
    beside
        .filter(|p| p.is_file())
        .or_else(|| {
            let path = std::env::var_os("PATH")?;
            std::env::split_paths(&path)
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        })
        .ok_or_else(|| {
            Error::Run(format!(
                "`{name}` is neither next to this executable nor on PATH (nor set in ${env}): \
                 {hint}"
            ))
        })
}

/// The `pageone` executable to run the daemon with: `$PAGEONE_BIN` (set by the `pageone bench`
/// front to itself), else `pageone` next to this executable, else on `PATH`.
pub fn find_pageone() -> Result<PathBuf, Error> {
    find_beside(
        "PAGEONE_BIN",
        "pageone",
        "build it with `cargo build --release -p pageone`",
    )
}

/// A daemon started for one run: stopped, and its socket file removed (a killed daemon cannot),
/// however the run ends.
pub struct BenchDaemon {
    child: Child,
    socket: PathBuf,
}

impl BenchDaemon {
    /// Starts `pageone daemon` on `socket` and waits until it listens.
    pub fn start(pageone: &Path, socket: &Path) -> Result<Self, Error> {
        let child = Command::new(pageone)
            .args(["daemon", "--socket"])
            .arg(socket)
            .stderr(Stdio::null())
            .spawn()
            .map_err(io_err(format!(
                "could not start {} daemon",
                pageone.display()
            )))?;
        let d = Self {
            child,
            socket: socket.to_owned(),
        };
        let t0 = Instant::now();
        while UnixStream::connect(socket).is_err() {
            if t0.elapsed() > Duration::from_secs(10) {
                return Err(Error::Run(format!(
                    "the daemon did not listen on {}",
                    socket.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The copies the daemon's store holds for `scope`.
    pub fn copies(&self, sock: &UnixStream, scope: &str) -> Result<u64, Error> {
        let (Reply::Text(t), _) = proto::call(sock, &Request::Status, None)? else {
            return Err(Error::Run("the daemon answered out of protocol".into()));
        };
        let v: serde_json::Value = serde_json::from_str(&t)
            .map_err(|e| Error::Run(format!("the daemon's status was not JSON: {e}")))?;
        Ok(v["scopes"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["scope"] == scope))
            .map_or(0, |s| s["pages_shared"].as_u64().unwrap_or(0)))
    }
}

impl Drop for BenchDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// A child process spoken to by lines on its standard input and output; killed if it is still
/// running when dropped.
pub struct Client {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Client {
    /// Starts `cmd` with piped input and output and waits for its first line, which must start
    /// with `READY`.
    pub fn start(mut cmd: Command) -> Result<Self, Error> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(io_err("could not start a workload process"))?;
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        let mut c = Self {
            child,
            stdin,
            out: BufReader::new(stdout.expect("the child's output is piped")),
        };
        let line = c.read_line()?;
        if !line.starts_with("READY") {
            return Err(Error::Run(format!(
                "a workload process failed to start: {line:?}"
            )));
        }
        Ok(c)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn send(&mut self, cmd: &str) -> Result<(), Error> {
        let i = self.stdin.as_mut().expect("the child's input is open");
        writeln!(i, "{cmd}")
            .and_then(|()| i.flush())
            .map_err(io_err("could not talk to a workload process"))
    }

    pub fn read_line(&mut self) -> Result<String, Error> {
        let mut line = String::new();
        let n = self
            .out
            .read_line(&mut line)
            .map_err(io_err("could not hear from a workload process"))?;
        if n == 0 {
            let status = self.child.wait().ok();
            return Err(Error::Run(format!(
                "a workload process ended ({}) without answering",
                status.map_or("unknown status".into(), |s| s.to_string())
            )));
        }
        Ok(line.trim().to_string())
    }

    /// Ends the child's input (it finishes its work and exits) and waits for it.
    pub fn finish(mut self) -> Result<(), Error> {
        drop(self.stdin.take());
        let status = self
            .child
            .wait()
            .map_err(io_err("waiting for a workload process"))?;
        if !status.success() {
            return Err(Error::Run(format!(
                "a workload process ended with {status}"
            )));
        }
        Ok(())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sends a command to every client, then reads their answers: they carry it out at once, in
/// parallel.
pub fn ask_all(clients: &mut [Client], cmd: &str) -> Result<Vec<String>, Error> {
    for c in clients.iter_mut() {
        c.send(cmd)?;
    }
    clients.iter_mut().map(Client::read_line).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_executable_is_a_clear_error() {
        let e = BenchDaemon::start(Path::new("/nonexistent/pageone"), Path::new("/tmp/x.sock"))
            .err()
            .unwrap();
        assert!(
            e.to_string()
                .starts_with("could not start /nonexistent/pageone daemon"),
            "{e}"
        );
        let e = find_beside(
            "PAGEONE_NO_SUCH_VARIABLE",
            "no-such-program-here",
            "build it",
        )
        .unwrap_err();
        assert!(e.to_string().contains("no-such-program-here"), "{e}");
    }

    #[test]
    fn a_child_that_never_says_ready_is_an_error() {
        let mut c = Command::new("sh");
        c.args(["-c", "echo hello"]);
        let e = Client::start(c).err().unwrap();
        assert!(e.to_string().contains("failed to start"), "{e}");
        let mut c = Command::new("sh");
        c.args(["-c", "echo READY; read x; echo got $x"]);
        let mut c = Client::start(c).unwrap();
        assert_eq!(
            ask_all(std::slice::from_mut(&mut c), "hi").unwrap(),
            ["got hi"]
        );
        c.finish().unwrap();
    }
}
