//! `residentd-router`: serves the OpenAI HTTP API of every model the local
//! residentd agent runs, starting each on demand. See docs/router.md.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use residentd_router::{AgentTls, App, Options};
use tokio::signal::unix::{SignalKind, signal};

/// The agent's socket when the agent runs with the packaged config.
const DEFAULT_AGENT: &str = "/run/residentd/residentd.sock";

#[derive(Parser, Debug)]
#[command(version, about = "OpenAI-compatible front door of a residentd node")]
struct Cli {
    /// The agent: its Unix socket path, http://HOST:PORT (an agent with
    /// insecure = true) or https://HOST:PORT (mutual TLS: give --ca,
    /// --cert and --key).
    #[arg(long, env = "RESIDENTD_SOCKET", default_value = DEFAULT_AGENT)]
    agent: String,
    /// The CA that signed the agent's certificate (PEM).
    #[arg(long, env = "RESIDENTD_CA", requires_all = ["cert", "key"])]
    ca: Option<PathBuf>,
    /// The router's certificate (PEM), signed by the agent's client_ca.
    #[arg(long, env = "RESIDENTD_CERT", requires_all = ["ca", "key"])]
    cert: Option<PathBuf>,
    /// The router's private key (PEM).
    #[arg(long, env = "RESIDENTD_KEY", requires_all = ["ca", "cert"])]
    key: Option<PathBuf>,
    /// The name the agent's certificate is checked against (default: the
    /// host of --agent).
    #[arg(long, env = "RESIDENTD_TLS_NAME", requires = "ca")]
    tls_name: Option<String>,
    /// Where to serve HTTP.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The longest a request waits for memory that requests in flight
    /// hold before it is answered 503 queue_timeout (e.g. 90s, 2m).
    #[arg(long, default_value = "120s", value_parser = duration)]
    queue_timeout: Duration,
    /// The largest request body taken, in bytes (larger: 413).
    #[arg(long, default_value_t = 32 << 20)]
    max_body: usize,
    /// The longest a client may take to send its body (slower: 408).
    #[arg(long, default_value = "30s", value_parser = duration)]
    body_timeout: Duration,
    /// How long a request's hold on its model lasts, renewed every third
    /// of it while the request is answered.
    #[arg(long, default_value = "15s", value_parser = duration)]
    hold: Duration,
    /// Worker threads: 1 runs everything on one thread (each streamed
    /// event then crosses no thread, the least CPU per event); 0 is one
    /// per core.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Turns on the console's actions (start, stop, sleep and wake from
    /// /ui) for callers that send the token in this file as
    /// `Authorization: Bearer`. Without it, the systemd credential
    /// `console-token` when the unit hands one over (`LoadCredential=`);
    /// without either the console is read-only.
    #[arg(long, env = "RESIDENTD_CONSOLE_TOKEN_FILE")]
    console_token_file: Option<PathBuf>,
    /// A host this router answers to, as clients write it (node-7.example.org,
    /// node-7.example.org:8080), beside the listen address and localhost,
    /// 127.0.0.1 and [::1] (each with the port and without). Requests for
    /// any other Host, or from pages of another origin, are refused (403).
    #[arg(long = "allow-host", value_name = "HOST")]
    allow_hosts: Vec<String>,
    /// A path prefix /upstream/MODEL/ forwards to the model's server (/v1/,
    /// /slots, 'GET /props' for GET and HEAD only, / for every path);
    /// repeatable. Given, it replaces the default, inference and read paths
    /// only, which `default` stands for: --upstream-allow default
    /// --upstream-allow /slots adds /slots to it.
    #[arg(long = "upstream-allow", value_name = "PREFIX")]
    upstream_allow: Vec<String>,
    /// The longest a client may take to send a request's headers, and to
    /// begin its next request on a kept-alive connection (then closed).
    #[arg(long, default_value = "10s", value_parser = duration)]
    header_timeout: Duration,
    /// The most HTTP connections open at once; one more is answered 503
    /// and closed.
    #[arg(long, default_value_t = residentd_router::defaults::MAX_CONNECTIONS)]
    max_connections: usize,
    /// The most bytes of request bodies held at once (each body counts its
    /// declared length, else --max-body, from before it is read until it
    /// has been forwarded); a request waits for room up to --queue-timeout.
    #[arg(long, default_value_t = residentd_router::defaults::BODY_BUDGET)]
    body_budget: usize,
    /// The most console streams (/ui/events, /ui/logs) open at once.
    #[arg(long, default_value_t = residentd_router::defaults::MAX_STREAMS)]
    max_streams: usize,
    /// How long a start on demand that needs a loaded model's memory lets
    /// that model's new requests go first: within it they are served (a
    /// loaded model's requests before a swap), after it they queue behind
    /// the start (so no model starves).
    #[arg(long, default_value = "5s", value_parser = duration)]
    swap_after: Duration,
    /// The most inference requests forwarded at once, all models together
    /// (0: no limit). On a node whose servers compute on the same CPU
    /// cores, 1 keeps two servers from slowing each other down; the
    /// others wait their turn, in arrival order.
    #[arg(long, default_value_t = 0)]
    max_busy: usize,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

/// `90s`, `2m`, `500ms`, `1h`.
fn duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, ""), |i| s.split_at(i));
    let n: u64 = n
        .parse()
        .map_err(|_| format!("'{s}' is not a duration such as 90s, 2m or 500ms"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => return Err(format!("'{s}' is not a duration such as 90s, 2m or 500ms")),
    };
    if d.is_zero() {
        return Err(format!("'{s}' must be longer than zero"));
    }
    Ok(d)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Escape codes only for a person at a terminal, not for journald
        // or a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if cli.log_json {
        logs.json().init();
    } else {
        logs.init();
    }
    let built = if cli.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        if cli.threads > 1 {
            b.worker_threads(cli.threads);
        }
        b.enable_all().build()
    };
    let runtime = match built {
        Ok(r) => r,
        Err(e) => {
            eprintln!("residentd-router: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("residentd-router: {e:#}");
            if e.is::<Misconfigured>() {
                ExitCode::from(EX_CONFIG)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// The exit status of flags that parse but cannot work (the agent's
/// address, its TLS files): the unit does not restart on it, since the
/// same flags would fail again.
const EX_CONFIG: u8 = 78;

/// What `--agent` and the TLS flags say cannot work.
#[derive(Debug)]
struct Misconfigured(anyhow::Error);

impl std::fmt::Display for Misconfigured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.0)
    }
}

impl std::error::Error for Misconfigured {}

/// The TLS material the flags name, read (`None` without `--ca`).
fn tls(cli: &Cli) -> anyhow::Result<Option<AgentTls>> {
    let (Some(ca), Some(cert), Some(key)) = (&cli.ca, &cli.cert, &cli.key) else {
        return Ok(None);
    };
    let read = |flag: &str, path: &Path| {
        std::fs::read(path).with_context(|| format!("--{flag} {}", path.display()))
    };
    Ok(Some(AgentTls {
        ca: read("ca", ca)?,
        cert: read("cert", cert)?,
        key: read("key", key)?,
        name: cli.tls_name.clone(),
    }))
}

/// The name of the console's token among systemd's credentials
/// (`LoadCredential=console-token:/etc/residentd/console-token`).
const TOKEN_CREDENTIAL: &str = "console-token";

/// Where the console's token is: `--console-token-file` when given; else
/// the `console-token` credential systemd handed over (in
/// `$CREDENTIALS_DIRECTORY`, readable by the service's dynamic user
/// alone) when there is one; else nowhere (actions off).
fn token_file(flag: Option<PathBuf>, credentials: Option<std::ffi::OsString>) -> Option<PathBuf> {
    flag.or_else(|| {
        let path = Path::new(&credentials?).join(TOKEN_CREDENTIAL);
        path.exists().then_some(path)
    })
}

/// The console's token from `--console-token-file`: the file's first
/// line, which must not be empty.
fn console_token(path: Option<&Path>) -> anyhow::Result<Option<String>> {
    let Some(path) = path else { return Ok(None) };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--console-token-file {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim();
    if token.is_empty() {
        anyhow::bail!(
            "--console-token-file {}: the file is empty; write a token on its first line",
            path.display()
        );
    }
    use std::os::unix::fs::PermissionsExt as _;
    if std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o077 != 0) {
        tracing::warn!(file = %path.display(), "the console's token file can be read by others than its owner: chmod 600 it");
    }
    Ok(Some(token.to_string()))
}

/// Raises the soft limit of open files to the hard one where it is below
/// what `max_connections` may need (two descriptors a proxied request: the
/// client's and the model server's, and a few of the router's own); warns
/// when even the hard limit is short.
fn files_for(max_connections: usize) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let need = (max_connections as u64)
        .saturating_mul(2)
        .saturating_add(64);
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if soft >= need {
        return;
    }
    let raised = need.min(hard);
    if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, raised, hard) {
        tracing::warn!(error = %e, soft, "the limit of open files could not be raised");
    } else if raised < need {
        tracing::warn!(
            limit = raised,
            need,
            "--max-connections may need more open files than the hard limit allows (LimitNOFILE=)"
        );
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    for (flag, value) in [
        ("--max-connections", cli.max_connections),
        ("--body-budget", cli.body_budget),
        ("--max-streams", cli.max_streams),
    ] {
        if value == 0 {
            return Err(Misconfigured(anyhow::anyhow!("{flag} 0: must be at least 1")).into());
        }
    }
    let options = Options {
        console_token: console_token(
            token_file(
                cli.console_token_file.clone(),
                std::env::var_os("CREDENTIALS_DIRECTORY"),
            )
            .as_deref(),
        )
        .map_err(Misconfigured)?,
        tls: tls(&cli).map_err(Misconfigured)?,
        agent: cli.agent,
        listen: cli.listen,
        queue_timeout: cli.queue_timeout,
        max_body: cli.max_body,
        body_timeout: cli.body_timeout,
        hold: cli.hold,
        allow_hosts: cli.allow_hosts,
        upstream_allow: cli.upstream_allow,
        header_timeout: cli.header_timeout,
        max_connections: cli.max_connections,
        body_budget: cli.body_budget,
        max_streams: cli.max_streams,
        swap_after: cli.swap_after,
        max_busy: cli.max_busy,
    };
    files_for(options.max_connections);
    let (listen, agent) = (options.listen, options.agent.clone());
    let tls = options.tls.is_some();
    let console_actions = options.console_token.is_some();
    let app = App::new(options).map_err(Misconfigured)?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
    tracing::info!(%listen, %agent, tls, console_actions, "serving");
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        tracing::info!("stopping: answers in flight finish first");
    };
    app.serve(listener, shutdown).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_or_say_what_is_expected() {
        assert_eq!(duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(duration("0s").is_err());
        assert!(duration("ten").expect_err("words").contains("90s"));
        assert!(duration("5d").is_err());
    }
}
