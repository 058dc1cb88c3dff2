//! The `pageone` command: a thin binary over the engine and daemon libraries. `pageone bench` runs
//! the separate `pageone-bench` command.

mod bench;
mod demo;
mod probe;
mod run;
mod scope;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "pageone",
    version,
    about = "Userspace memory deduplication (PageONE)"
)]
struct Cli {
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
    Daemon(scope::DaemonOptions),
    /// Run a command with pageone answering its madvise(MADV_MERGEABLE) / PR_SET_MEMORY_MERGE.
    Run {
        /// Scope (tenant) for the command's processes [default: $PAGEONE_SCOPE or "default"].
        #[arg(long)]
        scope: Option<String>,
        /// Daemon socket to join [default: the default socket if a daemon serves it, else a
        /// private daemon for this process tree].
        #[arg(long)]
        daemon: Option<std::path::PathBuf>,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        cmd: Vec<std::ffi::OsString>,
    },
    /// Per scope and client: pages shared, memory saved, merges per second, worker CPU.
    Status {
        #[arg(long)]
        socket: Option<std::path::PathBuf>,
        /// Print the daemon's JSON instead of a summary.
        #[arg(long)]
        json: bool,
    },
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

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PAGEONE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Demo {
            mib,
            copies,
            workers,
            hard,
        } => demo::run(mib, copies, workers, hard),
        Command::Daemon(options) => scope::daemon(options),
        Command::Status { socket, json } => scope::status(socket, json),
        Command::Run { scope, daemon, cmd } => {
            let code = run::run(scope, daemon, cmd)?;
            std::process::exit(code);
        }
        Command::ScopeClient(options) => scope::client(options),
        Command::ScopeProbe(options) => probe::run(options),
        Command::Bench { args } => bench::run(args),
    }
}
