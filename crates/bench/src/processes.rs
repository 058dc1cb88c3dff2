//! The pageone side of the engine-vs-KSM benchmark across processes: a `pageone daemon` and one
//! `pageone scope-client` per region, each filling its region with the same seed data (identical
//! across processes, unique within) and sharing through the daemon in one scope.
//!
//! Timed from the clients' registration (all asked at once) to 99% of the possible saving: the
//! sum of the clients' live counters (pages mapping a copy) against the daemon's count of copies.
//! CPU is the clients' engine threads plus the daemon process. The `pageone` executable runs the
//! daemon and the clients; this crate only drives them.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use pageone_engine::proto::{self, ProtoError, Reply, Request};

use crate::dedup::{self, Data, HostMemory, Params, Sample};
use crate::ksm;

const PAGE: usize = 4096;

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

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let what = what.into();
    move |err| Error::Io { what, err }
}

/// The `pageone` executable to run the daemon and clients with: `$PAGEONE_BIN` (set by the
/// `pageone bench` front to itself), else `pageone` next to this executable, else on `PATH`.
pub fn find_pageone() -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os("PAGEONE_BIN") {
        return Ok(p.into());
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("pageone")));
    beside
        .filter(|p| p.is_file())
        .or_else(|| {
            let path = std::env::var_os("PATH")?;
            std::env::split_paths(&path)
                .map(|d| d.join("pageone"))
                .find(|p| p.is_file())
        })
        .ok_or_else(|| {
            Error::Run(
                "the `pageone` executable (daemon and clients) is neither next to this one nor \
                 on PATH: build it with `cargo build --release -p pageone`"
                    .into(),
            )
        })
}

/// A daemon started for one run: stopped, and its socket file removed (a killed daemon cannot),
/// however the run ends.
struct BenchDaemon {
    child: Child,
    socket: PathBuf,
}

impl BenchDaemon {
    /// Starts `pageone daemon` on `socket` and waits until it listens.
    fn start(pageone: &Path, socket: &Path) -> Result<Self, Error> {
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

    fn cpu_seconds(&self) -> f64 {
        ksm::process_cpu_ns(self.child.id()) as f64 / 1e9
    }
}

impl Drop for BenchDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// One `pageone scope-client`, talked to through its standard input and output; killed if it is
/// still running when dropped.
struct Client {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
}

impl Client {
    fn start(pageone: &Path, socket: &Path, p: &Params, data: Data) -> Result<Self, Error> {
        let mut child = Command::new(pageone)
            .args(["scope-client", "--defer", "--mib"])
            .arg(p.region_mib.to_string())
            .args(["--period-ms", &p.merge_period.as_millis().to_string()])
            .args(["--workers", &p.workers.to_string()])
            .args(if data == Data::Hard {
                &["--hard"][..]
            } else {
                &[]
            })
            .env("PAGEONE_SOCKET", socket)
            .env("PAGEONE_SCOPE", "bench")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(io_err("could not start a client"))?;
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        let mut c = Self {
            child,
            stdin,
            out: BufReader::new(stdout.expect("the client's output is piped")),
        };
        let line = c.read_line()?;
        if !line.starts_with("READY") {
            return Err(Error::Run(format!("a client failed to start: {line:?}")));
        }
        Ok(c)
    }

    fn send(&mut self, cmd: &str) -> Result<(), Error> {
        let i = self.stdin.as_mut().expect("the client's input is open");
        writeln!(i, "{cmd}")
            .and_then(|()| i.flush())
            .map_err(io_err("could not talk to a client"))
    }

    fn read_line(&mut self) -> Result<String, Error> {
        let mut line = String::new();
        self.out
            .read_line(&mut line)
            .map_err(io_err("could not hear from a client"))?;
        Ok(line.trim().to_string())
    }

    /// Ends the client's input (it verifies its data, unregisters and exits) and waits for it.
    fn finish(mut self) -> Result<(), Error> {
        drop(self.stdin.take());
        let status = self.child.wait().map_err(io_err("waiting for a client"))?;
        if !status.success() {
            return Err(Error::Run(format!("a client ended with {status}")));
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
fn ask_all(clients: &mut [Client], cmd: &str) -> Result<Vec<String>, Error> {
    for c in clients.iter_mut() {
        c.send(cmd)?;
    }
    clients.iter_mut().map(Client::read_line).collect()
}

fn stats(line: &str) -> Result<serde_json::Value, Error> {
    serde_json::from_str(line)
        .map_err(|e| Error::Run(format!("a client's STATS was not JSON ({e}): {line:?}")))
}

/// Live figures: pages saved (every client's pages mapping a copy, less the daemon's copies in
/// the store) and the clients' engine CPU-seconds so far.
fn measure(sock: &UnixStream, clients: &mut [Client]) -> Result<(u64, f64), Error> {
    let (Reply::Text(t), _) = proto::call(sock, &Request::Status, None)? else {
        return Err(Error::Run("the daemon answered out of protocol".into()));
    };
    let v: serde_json::Value = serde_json::from_str(&t)
        .map_err(|e| Error::Run(format!("the daemon's status was not JSON: {e}")))?;
    let copies = v["scopes"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["scope"] == "bench"))
        .map_or(0, |s| s["pages_shared"].as_u64().unwrap_or(0));
    let (mut mapped, mut cpu) = (0u64, 0.0);
    for line in ask_all(clients, "STATS")? {
        let st = stats(&line)?;
        mapped +=
            st["pages_shared"].as_u64().unwrap_or(0) + st["pages_sharing"].as_u64().unwrap_or(0);
        cpu += st["worker_cpu_ns"].as_f64().unwrap_or(0.0) / 1e9;
    }
    Ok((mapped.saturating_sub(copies), cpu))
}

/// Measures pageone with one process per region (`p.regions` clients of `p.region_mib` MiB)
/// sharing through a daemon, run from the `pageone` executable at `pageone`.
pub fn run_pageone(pageone: &Path, p: &Params, data: Data) -> Result<Sample, Error> {
    if p.regions < 2 {
        return Err(Error::Run("sharing needs at least 2 regions".into()));
    }
    let socket = std::env::temp_dir().join(format!("pageone-bench-{}.sock", std::process::id()));
    let daemon = BenchDaemon::start(pageone, &socket)?;
    let mut clients = (0..p.regions)
        .map(|_| Client::start(pageone, &socket, p, data))
        .collect::<Result<Vec<_>, _>>()?;
    let possible = ((p.regions - 1) * ((p.region_mib << 20) / PAGE)) as u64;
    let target = possible * 99 / 100;
    let mut clients_cpu0 = 0.0;
    for line in ask_all(&mut clients, "STATS")? {
        clients_cpu0 += stats(&line)?["worker_cpu_ns"].as_f64().unwrap_or(0.0) / 1e9;
    }
    let mem0 = HostMemory::now();
    let daemon_cpu0 = daemon.cpu_seconds();
    let t0 = Instant::now();
    // All clients register at once, as independent processes would (asked one after the other,
    // the last registered a few registrations late).
    for line in ask_all(&mut clients, "GO")? {
        if line != "GOING" {
            return Err(Error::Run(format!("a client failed to register: {line:?}")));
        }
    }
    let sock = UnixStream::connect(&socket).map_err(io_err("could not reach the daemon"))?;
    let mut reached = None;
    let mut last = (0, 0.0);
    while t0.elapsed() < p.timeout {
        last = measure(&sock, &mut clients)?;
        if last.0 >= target {
            reached = Some(t0.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let clients_cpu = last.1 - clients_cpu0;
    let daemon_cpu = daemon.cpu_seconds() - daemon_cpu0;
    eprintln!("    (clients' engines {clients_cpu:.2} CPU-s, daemon {daemon_cpu:.2} CPU-s)");
    let memory_saved_kib = dedup::settle_memory(
        mem0,
        || measure(&sock, &mut clients).map_or(0, |m| m.0),
        possible,
        dedup::SETTLE_GRACE,
        2 * p.merge_period,
    );
    for (k, v) in ask_all(&mut clients, "VERIFY")?.into_iter().enumerate() {
        if v != "OK" {
            return Err(Error::Run(format!(
                "client {k} lost data ({v}): this is a bug, please report it"
            )));
        }
    }
    for c in clients {
        c.finish()?;
    }
    drop(daemon);
    Ok(Sample {
        side: "pageone",
        data,
        seconds_to_99: reached,
        cpu_seconds: clients_cpu + daemon_cpu,
        pages_saved: last.0,
        possible,
        memory_saved_kib,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_pageone_executable_is_a_clear_error() {
        let p = Params {
            regions: 2,
            region_mib: 1,
            workers: 1,
            merge_period: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
        };
        let e = run_pageone(Path::new("/nonexistent/pageone"), &p, Data::Easy).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("could not start /nonexistent/pageone daemon"),
            "{e}"
        );
        let one = Params { regions: 1, ..p };
        let e = run_pageone(Path::new("/nonexistent/pageone"), &one, Data::Easy).unwrap_err();
        assert_eq!(e.to_string(), "sharing needs at least 2 regions");
    }
}
