//! `tokwatt`: the node agent's command line. This file only parses and dispatches; each
//! subcommand has a module of its own, and runs are assembled by the library
//! (`tokwatt_agent::assembly`), so every command and test builds them the same way.

mod ab;
mod ab_studies;
mod bench;
mod bench_serve;
mod check;
mod compare;
mod eval;
mod fence;
mod fleet;
mod fleet_ab;
mod gpus;
mod json_out;
mod node_rules;
mod plugin;
mod plugin_places;
mod policy;
mod progress;
mod replay;
mod report;
mod restore;
mod run;
mod run_progress;
mod serve;
mod shell;
mod sim_driver;
mod status;
mod target;
mod tune;

use std::io::IsTerminal;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tokwatt",
    version,
    about = "Tunes GPU power caps, SM clocks and batch sizes for tokens per joule, through sandboxed WebAssembly policies"
)]
pub(crate) struct Cli {
    /// Log filter (e.g. `info`, `tokwatt=debug,plugin=info`); else TOKWATT_LOG, else
    /// RUST_LOG, else `warn`.
    #[arg(long, global = true)]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a policy on the simulator or on real GPUs, writing summary.json and trace.csv.
    Run(Box<run::RunArgs>),
    /// Is policy B more efficient than policy A on this work? Interleaved epochs, a ratio
    /// with its interval and a sequential decision; writes ab.json and report.html.
    Ab(Box<ab::AbArgs>),
    /// The best parameters of a policy by rounds of A/B on the simulator; writes
    /// tune.json, report.html and the spec with the winning parameters.
    Tune(Box<tune::TuneArgs>),
    /// The node agent: every GPU of the node under one policy until stopped, with the
    /// control API, hot swap and /metrics.
    Serve(serve::ServeArgs),
    /// Load a policy spec and its plugin, and check it starts (no run).
    Check(check::CheckArgs),
    /// Judge policies against the oracle on the simulator (eval.json, report.html).
    Eval(Box<eval::EvalArgs>),
    /// Put back the GPU settings saved in the state file (after a crash or `kill -9`).
    Restore(restore::RestoreArgs),
    /// Hold a fleet node's GPUs within its reserve while the agent's heartbeat stalls, from
    /// a second process (a sidecar, a node unit); with --once, apply the reserve and exit.
    Fence(fence::FenceArgs),
    /// List the GPUs: constraints, supported clocks, current settings, whether tokwatt may change them.
    Gpus(gpus::GpusArgs),
    /// Benchmarks of the agent itself and of the workload.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCommand,
    },
    /// Feed a recorded run's observations to a policy and print its decisions beside the
    /// run's, with the guest's logs and standard error.
    Replay(replay::ReplayArgs),
    /// Render a run's report.html again from its summary.json and trace.csv; with several
    /// run folders, compare them side by side and against the run with the default settings.
    Report(report::ReportArgs),
    /// What a running agent (`tokwatt serve`) is doing: policy, settings in force, failures.
    Status(status::StatusArgs),
    /// Act on a running agent: swap, roll back, pause, resume, restore defaults.
    Policy {
        #[command(subcommand)]
        what: policy::PolicyCommand,
    },
    /// Tools for plugin authors: check a component against the contract, compile it ahead of time.
    Plugin {
        #[command(subcommand)]
        what: plugin::PluginCommand,
    },
    /// A simulated node's driver file, where its GPUs' settings outlive the agent: show
    /// it, reboot the node, enable its boot unit.
    SimDriver {
        #[command(subcommand)]
        what: sim_driver::SimDriverCommand,
    },
    /// Print a shell's completion script for tokwatt (bash, zsh, fish, elvish, powershell).
    Completions(shell::CompletionsArgs),
    /// Print tokwatt's man page (roff), or write a page per subcommand into a folder.
    Man(shell::ManArgs),
    /// Across nodes: a power budget on etcd (set a domain's budget, show its ledger, run a
    /// coordinator replica), and A/B experiments on serving nodes.
    Fleet {
        #[command(subcommand)]
        what: fleet::FleetCommand,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if cli.command.only_prints() {
        end_quietly_when_the_reader_goes();
    }
    if let Err(e) = init_logging(cli.log.as_deref()) {
        eprintln!("error: {e:#}");
        return std::process::ExitCode::from(2);
    }
    let result = match cli.command {
        Command::Run(args) => run::run(*args),
        Command::Ab(args) => ab::ab(*args),
        Command::Tune(args) => tune::tune(*args),
        Command::Serve(args) => serve::serve(&args),
        Command::Check(args) => check::check(&args),
        Command::Eval(args) => eval::eval(&args),
        Command::Restore(args) => restore::restore(&args),
        Command::Fence(args) => fence::fence(&args),
        Command::Gpus(args) => gpus::gpus(&args),
        Command::Bench { what } => bench::bench(what),
        Command::Replay(args) => replay::replay(&args),
        Command::Report(args) => report::report(&args),
        Command::Status(args) => status::status(&args),
        Command::Policy { what } => policy::policy(&what),
        Command::Plugin { what } => plugin::plugin(what),
        Command::Fleet { what } => fleet::fleet(&what),
        Command::SimDriver { what } => sim_driver::sim_driver(&what),
        Command::Completions(args) => shell::completions(&args),
        Command::Man(args) => shell::man(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

impl Command {
    /// Whether the command only reads and prints: it cannot leave a GPU setting changed.
    fn only_prints(&self) -> bool {
        match self {
            Command::Check(_)
            | Command::Gpus(_)
            | Command::Bench { .. }
            | Command::Replay(_)
            | Command::Report(_)
            | Command::Status(_)
            | Command::Plugin { .. }
            | Command::Completions(_)
            | Command::Man(_) => true,
            // Writes budgets and grants: it keeps Rust's default on a closed pipe.
            Command::Fleet { .. } => false,
            Command::SimDriver { what } => what.only_prints(),
            Command::Run(_)
            | Command::Ab(_)
            | Command::Tune(_)
            | Command::Serve(_)
            | Command::Eval(_)
            | Command::Restore(_)
            | Command::Fence(_)
            | Command::Policy { .. } => false,
        }
    }
}

/// A command that only prints ends quietly when its reader goes (`tokwatt bench decide |
/// head`), as Unix tools do, instead of panicking on the failed write. Only those: a
/// command that may change GPU settings keeps Rust's default, where the write fails and
/// the command unwinds through the code that restores the GPUs, which SIGPIPE's default
/// action would skip.
fn end_quietly_when_the_reader_goes() {
    // SAFETY: called on the main thread before any other thread exists; resetting a
    // signal's disposition to its default installs no handler code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// The error and its causes, leaving out a cause whose text the message before it
/// already carries (typed errors often quote their source in their own message).
fn error_chain(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause);
        }
    }
    text
}

/// Logs go to standard error, coloured only on a terminal (never into a redirected log),
/// and never with `NO_COLOR` set. A filter that does not parse is refused, naming where it
/// came from: falling back quietly would hide the very logs the operator asked for.
fn init_logging(flag: Option<&str>) -> anyhow::Result<()> {
    let (filter, source) = log_filter(flag, |name| std::env::var(name).ok());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).map_err(|e| {
        anyhow::anyhow!(
            "the log filter {filter:?} (from {source}) does not parse: {e}; \
             write a level (`info`) or targets with levels (`tokwatt=debug,plugin=info`)"
        )
    })?;
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .init();
    Ok(())
}

/// The log filter and where it came from: `--log`, else `TOKWATT_LOG`, else `RUST_LOG`,
/// else `warn`. An empty variable counts as unset.
fn log_filter(flag: Option<&str>, env: impl Fn(&str) -> Option<String>) -> (String, &'static str) {
    if let Some(flag) = flag {
        return (flag.to_owned(), "--log");
    }
    for name in ["TOKWATT_LOG", "RUST_LOG"] {
        if let Some(value) = env(name).filter(|value| !value.trim().is_empty()) {
            return (value, name);
        }
    }
    ("warn".to_owned(), "the default")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn the_flag_wins_then_tokwatt_log_then_rust_log_then_warn() {
        let both = env_of(&[("TOKWATT_LOG", "debug"), ("RUST_LOG", "trace")]);
        assert_eq!(log_filter(Some("info"), &both), ("info".into(), "--log"));
        assert_eq!(log_filter(None, &both), ("debug".into(), "TOKWATT_LOG"));
        let rust_only = env_of(&[("TOKWATT_LOG", " "), ("RUST_LOG", "trace")]);
        assert_eq!(log_filter(None, &rust_only), ("trace".into(), "RUST_LOG"));
        assert_eq!(
            log_filter(None, env_of(&[])),
            ("warn".into(), "the default")
        );
    }
}
