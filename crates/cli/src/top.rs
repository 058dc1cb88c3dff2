//! `pageone top`: a live view of the daemon per scope and client (memory saved, pages sharing,
//! merges per second, CPU, the mapping budget), refreshed every interval. On a terminal it
//! draws full screen and quits on `q` (or Esc, Ctrl-C); otherwise it prints the table as plain
//! lines at each refresh. A daemon that is away (restarting) is shown as such and asked again.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use crossterm::{cursor, execute, queue, terminal};
use serde_json::Value;

use crate::config::Loaded;
use crate::scope::socket_or_default;
use crate::status::fetch;

/// Options of `pageone top`.
#[derive(clap::Args)]
pub struct TopOptions {
    /// The daemon's socket [default: $PAGEONE_SOCKET, else the configuration's, else the
    /// default one].
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0, value_parser = positive_secs)]
    pub interval: f64,
    /// Stop after this many refreshes [default: until `q` on a terminal, else forever].
    #[arg(long, value_name = "N")]
    pub iterations: Option<u64>,
}

fn positive_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v >= 0.05 && v.is_finite() => Ok(v),
        _ => Err(format!(
            "an interval is a number of seconds of at least 0.05, not {s:?}"
        )),
    }
}

/// One line of the table: a scope (its totals) or one of its clients.
#[derive(Debug, PartialEq)]
struct Row {
    /// The scope's name, or `  client N` under it.
    name: String,
    pid: Option<u64>,
    saved_bytes: u64,
    shared: u64,
    sharing: u64,
    merges_per_sec: f64,
    /// Share of one CPU since the last refresh (none on the first).
    cpu: Option<f64>,
    /// Mappings used / the limit, and merges held back by it (clients only).
    vmas: Option<(u64, u64, u64)>,
}

/// The daemon's status at one time.
struct Snapshot {
    at: Instant,
    status: Value,
}

fn num(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// CPU nanoseconds per key (scope name, or scope name and client id), to difference between
/// refreshes.
fn cpu_by_key(status: &Value) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for s in status["scopes"].as_array().into_iter().flatten() {
        let scope = s["scope"].as_str().unwrap_or("?");
        out.insert(scope.to_string(), num(&s["worker_cpu_ns"]));
        for c in s["clients"].as_array().into_iter().flatten() {
            let key = format!("{scope}/{}", c["client"]);
            out.insert(key, num(&c["stats"]["worker_cpu_ns"]));
        }
    }
    out
}

/// The rows of `now`, with CPU shares since `before`.
fn rows(before: Option<&Snapshot>, now: &Snapshot) -> Vec<Row> {
    let prev = before.map(|b| (cpu_by_key(&b.status), now.at - b.at));
    let cpu = |key: &str, ns: u64| -> Option<f64> {
        let (map, dt) = prev.as_ref()?;
        let old = *map.get(key)?;
        Some(ns.saturating_sub(old) as f64 / dt.as_nanos().max(1) as f64)
    };
    let mut out = Vec::new();
    for s in now.status["scopes"].as_array().into_iter().flatten() {
        let scope = s["scope"].as_str().unwrap_or("?");
        out.push(Row {
            name: scope.to_string(),
            pid: None,
            saved_bytes: num(&s["saved_bytes"]),
            shared: num(&s["pages_shared"]),
            sharing: num(&s["pages_sharing"]),
            merges_per_sec: s["merges_per_sec"].as_f64().unwrap_or(0.0),
            cpu: cpu(scope, num(&s["worker_cpu_ns"])),
            vmas: None,
        });
        for c in s["clients"].as_array().into_iter().flatten() {
            let st = &c["stats"];
            let sharing = num(&st["pages_sharing"]);
            out.push(Row {
                name: format!("  client {}", c["client"]),
                pid: c["pid"].as_u64(),
                saved_bytes: (sharing + num(&st["zero_pages"])) * 4096,
                shared: num(&st["pages_shared"]),
                sharing,
                merges_per_sec: c["merges_per_sec"].as_f64().unwrap_or(0.0),
                cpu: cpu(
                    &format!("{scope}/{}", c["client"]),
                    num(&st["worker_cpu_ns"]),
                ),
                vmas: st.get("vmas_used").map(|_| {
                    (
                        num(&st["vmas_used"]),
                        num(&st["vma_limit"]),
                        num(&st["vma_limited_merges"]),
                    )
                }),
            });
        }
    }
    out
}

/// The screen's lines: a heading, the columns' names, the rows.
fn lines(socket: &Path, now: &Result<Snapshot>, rows: &[Row]) -> Vec<String> {
    let mut out = Vec::new();
    match now {
        Ok(s) => {
            let v = &s.status;
            let saved: u64 = v["scopes"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| num(&s["saved_bytes"]))
                .sum();
            out.push(format!(
                "pageone daemon pid {} on {} (up {} s): {} scopes, {:.1} MiB saved",
                v["pid"],
                socket.display(),
                v["uptime_secs"],
                v["scopes"].as_array().map_or(0, |a| a.len()),
                saved as f64 / 1048576.0
            ));
        }
        Err(e) => out.push(format!("{e:#} (asking again)")),
    }
    out.push(format!(
        "{:<28} {:>8} {:>10} {:>9} {:>9} {:>9} {:>6} {:>17}",
        "SCOPE / CLIENT",
        "PID",
        "SAVED MiB",
        "SHARED",
        "SHARING",
        "MERGES/s",
        "CPU%",
        "MAPPINGS (HELD)"
    ));
    for r in rows {
        let vmas = r.vmas.map_or(String::new(), |(used, limit, held)| {
            format!("{used}/{limit} ({held})")
        });
        out.push(format!(
            "{:<28} {:>8} {:>10.1} {:>9} {:>9} {:>9.0} {:>6} {:>17}",
            r.name,
            r.pid.map_or(String::new(), |p| p.to_string()),
            r.saved_bytes as f64 / 1048576.0,
            r.shared,
            r.sharing,
            r.merges_per_sec,
            r.cpu
                .map_or("-".to_string(), |c| format!("{:.1}", c * 100.0)),
            vmas
        ));
    }
    out
}

/// The terminal in raw mode on its alternate screen, restored when dropped.
struct Screen;

impl Screen {
    fn enter() -> Result<Self> {
        terminal::enable_raw_mode()?;
        let screen = Screen;
        execute!(
            std::io::stdout(),
            terminal::EnterAlternateScreen,
            cursor::Hide
        )?;
        Ok(screen)
    }

    fn draw(&self, lines: &[String]) -> Result<()> {
        // (A terminal that does not know its size says 0 x 0.)
        let (width, height) = match terminal::size() {
            Ok((w, h)) if w > 0 && h > 0 => (w, h),
            _ => (80, 24),
        };
        let mut out = std::io::stdout().lock();
        queue!(
            out,
            cursor::MoveTo(0, 0),
            terminal::Clear(terminal::ClearType::All)
        )?;
        for l in lines.iter().take(height.saturating_sub(1) as usize) {
            let cut: String = l.chars().take(width as usize).collect();
            write!(out, "{cut}\r\n")?;
        }
        write!(out, "q: quit")?;
        out.flush()?;
        Ok(())
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = execute!(
            std::io::stdout(),
            cursor::Show,
            terminal::LeaveAlternateScreen
        );
        let _ = terminal::disable_raw_mode();
    }
}

/// Waits up to `d` for a key; whether it was one that quits.
fn quit_key_within(d: Duration) -> Result<bool> {
    let until = Instant::now() + d;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || !event::poll(left)? {
            return Ok(false);
        }
        if let Event::Key(k) = event::read()? {
            let ctrl_c =
                k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
            if k.kind == KeyEventKind::Press
                && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
            {
                return Ok(true);
            }
        }
    }
}

pub fn run(o: TopOptions, loaded: &Loaded) -> Result<()> {
    let socket = socket_or_default(o.socket, loaded)?;
    let interval = Duration::from_secs_f64(o.interval);
    let screen = if std::io::stdout().is_terminal() {
        Some(Screen::enter()?)
    } else {
        None
    };
    let mut before: Option<Snapshot> = None;
    let mut shown = 0u64;
    loop {
        let now = fetch(&socket).map(|status| Snapshot {
            at: Instant::now(),
            status,
        });
        let table = now
            .as_ref()
            .map_or(Vec::new(), |n| rows(before.as_ref(), n));
        let text = lines(&socket, &now, &table);
        match &screen {
            Some(s) => s.draw(&text)?,
            None => {
                let mut out = std::io::stdout().lock();
                for l in &text {
                    writeln!(out, "{l}")?;
                }
                writeln!(out)?;
                out.flush()?;
            }
        }
        if let Ok(n) = now {
            before = Some(n);
        }
        shown += 1;
        if o.iterations.is_some_and(|n| shown >= n) {
            return Ok(());
        }
        if screen.is_some() {
            if quit_key_within(interval)? {
                return Ok(());
            }
        } else {
            std::thread::sleep(interval);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn snapshot(at: Instant, cpu_ns: u64) -> Snapshot {
        Snapshot {
            at,
            status: json!({
                "pid": 1, "uptime_secs": 5,
                "scopes": [{
                    "scope": "vms", "saved_bytes": 8192, "pages_shared": 1, "pages_sharing": 2,
                    "merges_per_sec": 10.0, "worker_cpu_ns": cpu_ns,
                    "clients": [{
                        "client": 3, "pid": 42, "merges_per_sec": 10.0,
                        "stats": {"pages_shared": 1, "pages_sharing": 2, "zero_pages": 0,
                                  "worker_cpu_ns": cpu_ns, "vmas_used": 100, "vma_limit": 65530,
                                  "vma_limited_merges": 4}
                    }]
                }]
            }),
        }
    }

    /// A scope and its client each get a row; CPU shares come from the previous refresh.
    #[test]
    fn rows_show_scopes_clients_and_cpu_since_the_last_refresh() {
        let t0 = Instant::now();
        let a = snapshot(t0, 0);
        let b = snapshot(t0 + Duration::from_secs(1), 250_000_000);
        let first = rows(None, &a);
        assert_eq!(first.len(), 2);
        assert_eq!(first[0].cpu, None);
        let r = rows(Some(&a), &b);
        assert_eq!(r[0].name, "vms");
        assert_eq!(r[0].saved_bytes, 8192);
        assert_eq!(r[1].pid, Some(42));
        assert_eq!(r[1].vmas, Some((100, 65530, 4)));
        assert!((r[1].cpu.unwrap() - 0.25).abs() < 1e-9, "{:?}", r[1].cpu);
        let text = lines(Path::new("/s"), &Ok(b), &r).join("\n");
        assert!(text.contains("100/65530 (4)"), "{text}");
        assert!(text.contains("25.0"), "{text}");
    }
}
