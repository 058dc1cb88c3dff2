//! The configuration file, `/etc/pageone/pageone.toml` (or `--config FILE`, or
//! `$PAGEONE_CONFIG`): the daemon's socket, scope policy, caps, metrics address and mapping
//! limit, and the settings `pageone run` gives its command. Every key is also a flag, and flags
//! win. Unknown keys and bad values are errors naming the file, the key and its line.
//!
//! ```toml
//! socket = "/run/pageone/pageone.sock"   # the daemon's; clients' default too
//!
//! [daemon]
//! scope-by = "uid"                        # or "cgroup"
//! metrics = "127.0.0.1:9464"              # off when absent
//! max-map-count = 1048576                 # raise vm.max_map_count to this (root)
//! priority = "auto"                       # its threads: auto, idle or normal
//!
//! [daemon.limits]                         # caps, as --limit NAME=VALUE
//! pages-per-uid = 2097152
//!
//! [run]
//! scope = "vms"
//! period-ms = 200
//! priority = "auto"                       # the engines' threads: auto, idle or normal
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use pageone_daemon::ScopeBy;
use pageone_engine::{proto, Priority};
use serde::Deserialize;

/// Where the configuration is read from when neither `--config` nor `$PAGEONE_CONFIG` names a
/// file (a missing default file is an empty configuration).
pub const DEFAULT_PATH: &str = "/etc/pageone/pageone.toml";

/// The file's contents.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct File {
    /// The daemon's socket, and the one clients (`run`, `status`, `top`) use by default.
    pub socket: Option<PathBuf>,
    #[serde(default)]
    pub daemon: DaemonSection,
    #[serde(default)]
    pub run: RunSection,
}

/// `[daemon]`: what `pageone daemon` takes as flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DaemonSection {
    pub scope_by: Option<ScopeByValue>,
    pub metrics: Option<SocketAddr>,
    pub max_map_count: Option<u64>,
    pub priority: Option<PriorityValue>,
    /// `[daemon.limits]`: NAME = VALUE, as `--limit NAME=VALUE`.
    #[serde(default)]
    pub limits: BTreeMap<String, u64>,
}

/// `[run]`: what `pageone run` gives the command's engines.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RunSection {
    pub scope: Option<String>,
    pub period_ms: Option<PeriodMs>,
    pub priority: Option<PriorityValue>,
}

/// `auto`, `idle` or `normal`: how background threads are scheduled (see
/// [`pageone_engine::Priority`]).
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(try_from = "String")]
pub struct PriorityValue(pub Priority);

impl TryFrom<String> for PriorityValue {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse().map(PriorityValue)
    }
}

/// `uid` or `cgroup`.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(try_from = "String")]
pub struct ScopeByValue(pub ScopeBy);

impl TryFrom<String> for ScopeByValue {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse().map(ScopeByValue)
    }
}

/// A merge period in milliseconds, at least 1.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(try_from = "u64")]
pub struct PeriodMs(pub u64);

impl TryFrom<u64> for PeriodMs {
    type Error = String;
    fn try_from(ms: u64) -> Result<Self, String> {
        if ms == 0 {
            return Err("a merge period is at least 1 ms".into());
        }
        Ok(PeriodMs(ms))
    }
}

/// The configuration in force, and where it came from (`None`: no file).
#[derive(Debug, Default)]
pub struct Loaded {
    pub path: Option<PathBuf>,
    pub file: File,
}

impl Loaded {
    /// `FILE: ` for messages about the file's contents.
    pub fn origin(&self) -> String {
        self.path
            .as_ref()
            .map_or_else(|| "defaults".into(), |p| p.display().to_string())
    }
}

/// Reads the configuration: `explicit` (`--config`), else `$PAGEONE_CONFIG`, else
/// [`DEFAULT_PATH`] if it exists. A file named explicitly must exist.
pub fn load(explicit: Option<&Path>) -> Result<Loaded> {
    let named = explicit
        .map(Path::to_path_buf)
        .or_else(|| proto::setting("PAGEONE_CONFIG").map(PathBuf::from));
    let path = match named {
        Some(p) => p,
        None if Path::new(DEFAULT_PATH).exists() => PathBuf::from(DEFAULT_PATH),
        None => return Ok(Loaded::default()),
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("could not read the configuration {}", path.display()))?;
    let file = parse(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok(Loaded {
        path: Some(path),
        file,
    })
}

/// Parses a configuration's text; the error names the key, its line and what was wrong.
pub fn parse(text: &str) -> Result<File, String> {
    toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_read() {
        let f = parse(
            r#"
            socket = "/run/x/pageone.sock"
            [daemon]
            scope-by = "cgroup"
            metrics = "127.0.0.1:9464"
            max-map-count = 1048576
            [daemon.limits]
            pages-per-uid = 1000
            [run]
            scope = "vms"
            period-ms = 50
            "#,
        )
        .unwrap();
        assert_eq!(f.socket.unwrap(), Path::new("/run/x/pageone.sock"));
        assert_eq!(f.daemon.scope_by.unwrap().0, ScopeBy::Cgroup);
        assert_eq!(f.daemon.metrics.unwrap().port(), 9464);
        assert_eq!(f.daemon.max_map_count, Some(1048576));
        assert_eq!(f.daemon.limits["pages-per-uid"], 1000);
        assert_eq!(f.run.scope.as_deref(), Some("vms"));
        assert_eq!(f.run.period_ms.unwrap().0, 50);
        assert!(parse("").is_ok(), "an empty file is the defaults");
    }

    /// Unknown keys, in any table, and bad values are errors that name the key and its line.
    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let cases = [
            ("sockett = \"/x\"", "sockett", "line 1"),
            ("[daemon]\nscope-bye = \"uid\"", "scope-bye", "line 2"),
            ("[run]\n\nperiod = 5", "period", "line 3"),
            ("[daemon]\nscope-by = \"user\"", "uid or cgroup", "scope-by"),
            (
                "[daemon]\nmetrics = \"localhost\"",
                "socket address",
                "metrics",
            ),
            ("[run]\nperiod-ms = 0", "at least 1 ms", "period-ms"),
            ("[run]\nperiod-ms = \"fast\"", "period-ms", "line 2"),
            (
                "[daemon.limits]\npages-per-uid = -1",
                "pages-per-uid",
                "line 2",
            ),
            ("[daemon]\nmax-map-count = 1.5", "max-map-count", "line 2"),
            ("[nonsense]", "nonsense", "line 1"),
        ];
        for (text, key, also) in cases {
            let e = parse(text).unwrap_err();
            assert!(e.contains(key), "{text:?}: {e}");
            assert!(e.contains(also), "{text:?}: {e}");
        }
    }
}
