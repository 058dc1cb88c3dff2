//! The `pageone` command: a thin binary over the engine and daemon libraries. `pageone bench` runs
//! the separate `pageone-bench` command.

mod bench;
mod config;
mod daemon;
mod demo;
mod probe;
mod run;
mod scope;
mod status;
mod top;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};

const AFTER_HELP: &str = "\
Files:
  /etc/pageone/pageone.toml   the configuration (`pageone daemon --check-config` checks it);
                              every key is also a flag, and flags win

Environment:
  PAGEONE_SOCKET              the daemon's socket (engines join it; the commands' default)
  PAGEONE_SCOPE               the scope an engine joins (default: \"default\")
  PAGEONE_CONFIG              the configuration file instead of /etc/pageone/pageone.toml
  PAGEONE_MERGE_PERIOD_MS     the merge period of engines the shim starts
  PAGEONE_WORKERS             their worker threads
  PAGEONE_STORE_PAGES         the most copies a store of their own holds (default: a page
                              per page of RAM)
  PAGEONE_POPULATE_MERGED=1   their merged pages are mapped as they merge where the kernel
                              cannot report minor faults (elsewhere they always are)
  PAGEONE_RESTORE_HUGE_PAGES=0  huge pages split by the watch stay split (by default,
                              quiet unique memory is collapsed back into huge pages)
  PAGEONE_KSM_WHEN_LIMITED=0  regions whose merges cost a mapping per page, beyond the mapping
                              limit, stay pageone's (by default they go to the kernel's KSM
                              where it runs)
  PAGEONE_PRIORITY            how their threads (and a daemon's) are scheduled: auto (idle
                              priority, but normal for a while when busy threads starve
                              them while memory is short; the default), idle (spare CPU
                              only) or normal
  PAGEONE_PRELOAD             the shim `pageone run` preloads
  PAGEONE_LOG                 log filter (e.g. info, pageone_engine=debug)";

#[derive(Parser)]
#[command(
    name = "pageone",
    version,
    about = "Userspace memory deduplication (PageONE)",
    after_long_help = AFTER_HELP
)]
struct Cli {
    /// The configuration file [default: $PAGEONE_CONFIG, else /etc/pageone/pageone.toml if it
    /// exists].
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fill memory with duplicate data, merge it in this process, and print what was saved.
    Demo {
        /// Total memory to fill, in MiB, split over the copies.
        #[arg(long, default_value_t = 512)]
        mib: usize,
        /// Identical regions (copies of the same data).
        #[arg(long, default_value_t = 4)]
        copies: usize,
        /// Worker threads.
        #[arg(long, default_value_t = 2)]
        workers: usize,
        /// Use the seed's "hard" data (values at random offsets) instead of "easy".
        #[arg(long)]
        hard: bool,
    },
    /// Share stable copies between the processes of each scope (foreground).
    Daemon(daemon::DaemonOptions),
    /// Run a command with pageone answering its madvise(MADV_MERGEABLE) / PR_SET_MEMORY_MERGE.
    ///
    /// With a daemon to join it execs the command; else it starts a private daemon for the
    /// command's process tree, passes SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 on,
    /// exits with the command's status (128 + the signal if it was killed), restarts the
    /// daemon if it dies, and leaves nothing behind, even when killed with SIGKILL.
    Run(run::RunOptions),
    /// Per scope and client: pages shared, memory saved, merges per second, worker CPU.
    Status(status::StatusOptions),
    /// A live view of the daemon per scope and client (q quits; plain lines when not on a
    /// terminal).
    Top(top::TopOptions),
    /// Print a shell's completions for pageone (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// (Packaging) write the man pages, one per command, into DIR.
    #[command(hide = true)]
    Manpages { dir: PathBuf },
    /// (Tests and benchmarks) one process of seed data under an engine that joins the daemon.
    #[command(hide = true)]
    ScopeClient(scope::ClientOptions),
    /// (Tests) what a client of another user, or a hostile one, can do to a daemon.
    #[command(hide = true)]
    ScopeProbe(probe::ProbeOptions),
    /// Benchmarks, each next to its baseline in the same run: runs `pageone-bench ARGS...`
    /// (built with `cargo build --release -p pageone-bench`).
    #[command(disable_help_flag = true)]
    Bench {
        /// `sdtree`, `ksm`, `ppr` or `plot`, and their flags (`pageone bench --help`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

fn manpages(dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("could not make the directory {}", dir.display()))?;
    clap_mangen::generate_to(Cli::command(), dir)
        .with_context(|| format!("could not write the man pages into {}", dir.display()))
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PAGEONE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Status(_) | Command::Top(_) | Command::Completions { .. } | Command::Demo { .. }
    ) {
        // Commands that print for a reader: a reader that left (`| head`) ends them quietly,
        // as it ends a C program. (Not the daemon: it writes to clients' sockets.)
        pageone_sys::default_sigpipe()?;
    }
    let loaded = || config::load(cli.config.as_deref());
    match cli.command {
        Command::Demo {
            mib,
            copies,
            workers,
            hard,
        } => demo::run(mib, copies, workers, hard),
        Command::Daemon(options) => daemon::run(options, &loaded()?),
        Command::Status(options) => status::run(options, &loaded()?),
        Command::Top(options) => top::run(options, &loaded()?),
        Command::Run(options) => {
            let code = run::run(options, &loaded()?)?;
            std::process::exit(code);
        }
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "pageone",
                &mut std::io::stdout(),
            );
            Ok(())
        }
        Command::Manpages { dir } => manpages(&dir),
        Command::ScopeClient(options) => scope::client(options),
        Command::ScopeProbe(options) => probe::run(options),
        Command::Bench { args } => bench::run(args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    /// One page per visible command, each a roff document naming its command.
    #[test]
    fn man_pages_are_written_for_every_visible_command() {
        let dir = std::env::temp_dir().join(format!("pageone-man-{}", std::process::id()));
        manpages(&dir).unwrap();
        for name in [
            "pageone",
            "pageone-daemon",
            "pageone-run",
            "pageone-top",
            "pageone-status",
        ] {
            let page = std::fs::read_to_string(dir.join(format!("{name}.1"))).unwrap();
            assert!(page.starts_with(".ie"), "{name}: {}", &page[..40]);
            assert!(page.contains(".TH"), "{name}");
        }
        assert!(!dir.join("pageone-scope-client.1").exists());
        let daemon = std::fs::read_to_string(dir.join("pageone-daemon.1")).unwrap();
        assert!(daemon.contains("check\\-config"), "{daemon}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
