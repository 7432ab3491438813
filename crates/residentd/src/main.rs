//! `residentd`: the node agent's binary. Thin: arguments, logging, config,
//! then the server until a shutdown signal.

#![allow(clippy::disallowed_methods)] // crates/residentd/clippy.toml is for agent/ only

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use residentd::agent::Agent;

/// Exit status for a configuration error (sysexits' EX_CONFIG), so systemd
/// does not restart into the same error.
const EX_CONFIG: u8 = 78;

#[derive(Debug, Parser)]
#[command(
    name = "residentd",
    version,
    about = "Keeps inference servers resident within the node's memory"
)]
struct Args {
    /// The configuration file. Without it, the embedded laptop example runs
    /// (socket under $XDG_RUNTIME_DIR or /tmp), afresh each time.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Validate a configuration file and exit (0: valid, 78: not).
    #[arg(long, value_name = "FILE")]
    check_config: Option<PathBuf>,
    /// With --check-config: the file is for another machine, so nothing is
    /// looked up on this one (users, groups, programs, TLS and GGUF files).
    #[arg(long, requires = "check_config")]
    for_another_host: bool,
    /// Log as JSON lines instead of human-readable text.
    #[arg(long)]
    log_json: bool,
}

/// `argv` as a shell would need it typed: words with spaces or quotes in
/// single quotes.
fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            let plain = !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:=${}@%+,".contains(c));
            if plain {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.log_json);
    if let Some(path) = &args.check_config {
        let host = if args.for_another_host {
            resident_config::Host::Elsewhere
        } else {
            resident_config::Host::Local
        };
        return match resident_config::load_with(path, host) {
            Ok(c) => {
                for w in c.warnings.iter().chain(&build_warnings(&c)) {
                    eprintln!("residentd: warning: {w}");
                }
                println!(
                    "{}: valid ({} pools, {} workloads)",
                    path.display(),
                    c.pools.len(),
                    c.workloads.len()
                );
                // What each workload will run, flavors resolved.
                for (name, w) in &c.workloads {
                    println!("  {name}: {}", shell_words(&w.argv));
                    for note in &w.reservation {
                        println!("    memory {note}");
                    }
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                config_errors(&e);
                ExitCode::from(EX_CONFIG)
            }
        };
    }
    let config = match &args.config {
        Some(path) => resident_config::load(path),
        None => default_config(),
    };
    let config = match config {
        Ok(c) => {
            for w in c.warnings.iter().chain(&build_warnings(&c)) {
                tracing::warn!("{w}");
            }
            c
        }
        Err(e) => {
            config_errors(&e);
            return ExitCode::from(EX_CONFIG);
        }
    };
    // The embedded example starts afresh, unless this agent takes over
    // from one it replaces (an upgrade, or a failed one's way back).
    let afresh =
        args.config.is_none() && std::env::var_os(residentd::upgrade::INHERIT_ENV).is_none();
    residentd::upgrade::remember_invocation(args.config.as_deref());
    raise_open_file_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("residentd: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let host = Arc::new(resident_probe::HostMemory::new());
        let state_dir = config.node.state_dir.clone();
        // The sockets first: an agent already serving here stops this one
        // before it touches that one's instances or journal.
        let listeners = residentd::server::bind(&config).await?;
        if afresh {
            let forgotten = residentd::journal::start_afresh(&state_dir)
                .map_err(|e| anyhow::anyhow!("state_dir {}: {e}", state_dir.display()))?;
            if forgotten > 0 {
                eprintln!(
                    "residentd: the embedded example starts afresh: the {forgotten} instances of its last run are forgotten (--config examples/laptop.toml keeps them, as a node does)"
                );
            }
        }
        let tls = match &config.node.tls {
            Some(files) => Some(Arc::new(
                residentd::tls::TlsServer::new(files).map_err(|e| anyhow::anyhow!("node.tls: {e}"))?,
            )),
            None => None,
        };
        let agent = Agent::new(config, host)
            .map_err(|e| anyhow::anyhow!("state_dir {}: {e}", state_dir.display()))?;
        agent.restore().await;
        residentd::server::serve(agent, listeners, tls).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("residentd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Every error of a config that does not validate, one per line, and how
/// many when there are several.
fn config_errors(e: &resident_config::ConfigError) {
    for line in e.to_string().lines() {
        eprintln!("residentd: {line}");
    }
    if !e.also.is_empty() {
        eprintln!(
            "residentd: {} errors in {}",
            1 + e.also.len(),
            e.file.display()
        );
    }
}

/// What this build cannot do of what `config` asks (GPU pools without
/// NVML).
fn build_warnings(config: &resident_config::Config) -> Vec<String> {
    resident_probe::build_warnings(
        config
            .pools
            .iter()
            .filter_map(|p| Some((p.pool.name.to_string(), p.device.clone()?))),
    )
}

/// Raises the soft limit on open files to the hard one. The agent keeps a
/// few descriptors per instance (its pidfd, output pipes, sampled and
/// counter files), and the soft limit of 1024 common outside systemd would
/// cap a node near 140 instances; under the unit, `LimitNOFILE` sets both.
/// Children inherit the raised limit, as they do under the unit.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!(soft, hard, error = %e, "cannot raise the limit on open files");
    }
}

/// The embedded laptop example (the file as shipped), with its socket and
/// state moved under a per-user runtime directory. Each run starts
/// afresh (`journal::start_afresh`, once its socket is bound): a
/// newcomer's second `cargo run` finds none of the first run's instances.
fn default_config() -> Result<resident_config::Config, resident_config::ConfigError> {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("residentd-{}", nix::unistd::getuid()))
        })
        .join("residentd");
    let mut config = resident_config::parse_checked(
        std::path::Path::new("<embedded examples/laptop.toml>"),
        residentd::DEFAULT_CONFIG,
    )?;
    let socket = dir.join("residentd.sock");
    config.node.listen = vec![resident_config::Listen::Unix(socket.clone())];
    config.node.state_dir = dir.join("state");
    eprintln!(
        "residentd: running the embedded laptop example; socket {}",
        socket.display()
    );
    Ok(config)
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Escape codes only for a person at a terminal, not for journald
        // or a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
