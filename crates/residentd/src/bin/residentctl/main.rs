//! `residentctl`: the operator's command line for a residentd node agent.
//! A subcommand per RPC, human tables by default, `--json` for scripts.
//!
//! Exit codes: 0 done, 1 error, 2 bad usage, 3 refused (the start or the
//! placement does not fit; the reasons are printed).
//!
//! A closed output pipe (`residentctl node | head -1`) ends the command
//! quietly with 0: the reader had what it wanted, and whether the pipe
//! closes before or after the last write is a race that must not change
//! the status a script sees (`set -o pipefail`). No output goes through
//! `println!`, which would panic; SIGPIPE stays ignored (Rust's default),
//! so a write to a closed socket is an error to report, not a silent death.

#![allow(clippy::disallowed_methods)]
// crates/residentd/clippy.toml is for agent/ only

// Every write goes through `writeln!` with its error handled (see above).
#![deny(clippy::print_stdout, clippy::print_stderr)]

mod reach;
mod render;

use std::error::Error as _;
use std::io::{self, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand, ValueEnum};
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use tokio_stream::StreamExt as _;
use tonic::transport::Channel;

const DEFAULT_SOCKET: &str = "/run/residentd/residentd.sock";
const EXIT_REFUSED: u8 = 3;

#[derive(Debug, Parser)]
#[command(
    name = "residentctl",
    version,
    about = "Talk to a residentd node agent",
    after_help = "Exit codes: 0 done, 1 error, 2 bad usage, 3 refused (the start or the \
                  placement does not fit). A closed output pipe (residentctl ls | head -1) \
                  ends residentctl quietly with 0; a refusal still exits 3."
)]
struct Cli {
    /// The agent's socket.
    #[arg(long, global = true, env = "RESIDENTD_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The agent elsewhere: `https://HOST:PORT` (mutual TLS: give --ca,
    /// --cert and --key), `http://HOST:PORT` (an agent with insecure =
    /// true) or `unix:///PATH`. Instead of --socket.
    #[arg(
        long,
        global = true,
        env = "RESIDENTD_ENDPOINT",
        conflicts_with = "socket"
    )]
    endpoint: Option<String>,
    /// The CA that signed the agent's certificate (PEM).
    #[arg(long, global = true, env = "RESIDENTD_CA")]
    ca: Option<PathBuf>,
    /// This client's certificate (PEM), for mutual TLS.
    #[arg(long, global = true, env = "RESIDENTD_CERT")]
    cert: Option<PathBuf>,
    /// This client's private key (PEM).
    #[arg(long, global = true, env = "RESIDENTD_KEY")]
    key: Option<PathBuf>,
    /// The name the agent's certificate is checked against (default: the
    /// endpoint's host).
    #[arg(long, global = true, env = "RESIDENTD_TLS_NAME")]
    tls_name: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
    /// Who named the socket, or the endpoint (for the words when it
    /// cannot be reached).
    #[arg(skip = reach::Given::Default)]
    socket_given: reach::Given,
    #[arg(skip = reach::Given::Default)]
    endpoint_given: reach::Given,
}

impl Cli {
    fn parse_all() -> Self {
        let matches = Self::command().get_matches();
        let mut cli = Self::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        let given = |id: &str| match matches.value_source(id) {
            Some(ValueSource::CommandLine) => reach::Given::Flag,
            Some(ValueSource::EnvVariable) => reach::Given::Env,
            _ => reach::Given::Default,
        };
        cli.socket_given = given("socket");
        cli.endpoint_given = given("endpoint");
        cli
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum PolicyArg {
    Refuse,
    Evict,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start an instance of a workload.
    Start {
        workload: String,
        /// The instance id (generated when absent).
        #[arg(long)]
        id: Option<String>,
        /// What to do when it does not fit (the node's on_full otherwise).
        #[arg(long, value_enum)]
        policy: Option<PolicyArg>,
        /// Wait until the instance is READY.
        #[arg(long)]
        wait: bool,
        /// An owner's lease, e.g. "30s": the agent stops the instance
        /// unless a touch renews it within that time.
        #[arg(long)]
        lease: Option<String>,
    },
    /// Stop an instance (SIGTERM, grace, SIGKILL).
    Stop {
        id: String,
        /// Grace before SIGKILL, e.g. "10s" (the workload's otherwise).
        #[arg(long)]
        grace: Option<String>,
    },
    /// Put an instance to sleep (its workload has [workload.sleep]): its
    /// server keeps its process and port and gives memory back; `start`
    /// with its id wakes it.
    Sleep { id: String },
    /// One instance.
    Get { id: String },
    /// Every instance.
    Ls,
    /// What starting WORKLOAD would do (a dry run).
    Place {
        workload: String,
        #[arg(long, value_enum)]
        policy: Option<PolicyArg>,
    },
    /// Enter a server someone else started into the books, without
    /// restarting it: counted against WORKLOAD's pools, probed, released
    /// when it exits. The agent never signals it unless --manage.
    Adopt {
        /// The running process.
        pid: u32,
        /// The roster workload whose memory and readiness it has.
        workload: String,
        /// The instance id to give it.
        #[arg(long)]
        id: String,
        /// Let the agent stop it (Stop, eviction, idle TTL).
        #[arg(long)]
        manage: bool,
        /// The port its readiness probe reaches (default: the one TCP
        /// port it listens on).
        #[arg(long)]
        port: Option<u16>,
    },
    /// Re-read the agent's configuration file, as SIGHUP does (needs the
    /// admin role).
    Reload,
    /// Replace the agent with the binary now at its path, without
    /// stopping a model (needs the admin role): answers once the new
    /// agent serves.
    Upgrade,
    /// The roster: every workload with what it declares, what was learned
    /// of it (the high-water measured for its command and model files)
    /// and what its next start reserves.
    Workloads,
    /// Forget what was learned of WORKLOAD's footprint: its next start
    /// reserves the declared bytes again (needs the admin role).
    ForgetFootprint { workload: String },
    /// Mark a use of an instance; with --hold, protect it from eviction.
    Touch {
        id: String,
        #[arg(long, conflicts_with = "release_hold")]
        hold: Option<String>,
        /// End the instance's hold now (whoever set it).
        #[arg(long)]
        release_hold: bool,
    },
    /// The node: pools and instances.
    Node,
    /// An instance's output, stdout and stderr alike, on stdout.
    ///
    /// The lines of both streams are printed on stdout in the order they
    /// were captured; --stream keeps one, and --json gives each line's
    /// stream.
    Logs {
        id: String,
        /// Lines of history (of both streams, before --stream picks).
        #[arg(short = 'n', long, default_value_t = 100)]
        tail: u32,
        /// Only the lines the instance wrote to this stream.
        #[arg(long, value_enum)]
        stream: Option<StreamArg>,
        /// Keep following new lines until the instance's run has ended
        /// (EXITED or FAILED; a restart is part of the run), then say so on
        /// stderr.
        #[arg(short, long)]
        follow: bool,
    },
    /// A live view of the pools and instances, redrawn on every event.
    Top {
        /// Stop after this many redraws (for scripts and tests).
        #[arg(long)]
        frames: Option<u64>,
    },
    /// Every state change and refusal, as it happens.
    Watch {
        /// Resume after this revision (0: the current state first).
        #[arg(long, default_value_t = 0)]
        since: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StreamArg {
    Stdout,
    Stderr,
}

impl StreamArg {
    fn holds(self, line: &pb::LogLine) -> bool {
        let stream = match self {
            StreamArg::Stdout => pb::LogStream::Stdout,
            StreamArg::Stderr => pb::LogStream::Stderr,
        };
        line.stream == stream as i32
    }
}

fn policy(p: Option<PolicyArg>) -> i32 {
    match p {
        None => pb::Policy::Unspecified as i32,
        Some(PolicyArg::Refuse) => pb::Policy::Refuse as i32,
        Some(PolicyArg::Evict) => pb::Policy::Evict as i32,
    }
}

fn millis(text: Option<&str>, flag: &str) -> Result<u64, Failure> {
    match text {
        None => Ok(0),
        Some(t) => resident_config::parse_duration(t)
            .map(|d| d.as_millis() as u64)
            .map_err(|e| Failure::Usage(format!("--{flag}: {e}"))),
    }
}

/// How a command failed.
enum Failure {
    Usage(String),
    Refused(tonic::Status),
    /// A call that failed on the connection, not by the agent's answer
    /// (`run` says what is wrong with the endpoint).
    Unreached(tonic::Status),
    Error(String),
    /// Writing the output failed (most often: the reader closed the pipe).
    Output(io::Error),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::Output(e)
    }
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Self {
        match s.code() {
            tonic::Code::ResourceExhausted | tonic::Code::FailedPrecondition
                if s.message().starts_with("unplaceable:") =>
            {
                Failure::Refused(s)
            }
            // Made here from the connection's error (h2, TLS, the
            // system's): the agent did not answer this.
            _ if s.source().is_some() => Failure::Unreached(s),
            _ => Failure::Error(format!(
                "{}: {}",
                resident_api::code_name(s.code()),
                s.message()
            )),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse_all();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            complain(&e.to_string());
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&cli)) {
        Ok(code) => code,
        // The reader has what it wanted (see the module doc).
        Err(Failure::Output(e)) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(Failure::Output(e)) => {
            complain(&format!("cannot write the output: {e}"));
            ExitCode::FAILURE
        }
        Err(Failure::Usage(msg)) => {
            complain(&msg);
            ExitCode::from(2)
        }
        Err(Failure::Refused(status)) => {
            // Refused stays refused, whatever became of the reasons.
            let _ = render::refusal(&status, cli.json);
            ExitCode::from(EXIT_REFUSED)
        }
        Err(Failure::Error(msg)) => {
            complain(&msg);
            ExitCode::FAILURE
        }
        // `run` turns these into words; this is only the fallback.
        Err(Failure::Unreached(s)) => {
            complain(&format!(
                "{}: {}",
                resident_api::code_name(s.code()),
                s.message()
            ));
            ExitCode::FAILURE
        }
    }
}

/// Ok when `output` was written or its reader has gone; other write errors
/// are failures.
fn written(output: io::Result<()>) -> Result<(), Failure> {
    match output {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(Failure::Output(e)),
        _ => Ok(()),
    }
}

/// Says what went wrong on stderr; when stderr itself is closed there is
/// nobody to tell, and the exit status still says it.
fn complain(msg: &str) {
    let _ = writeln!(io::stderr(), "residentctl: {msg}");
}

/// Where the agent is, as the flags say: what to connect to, and what to
/// look at when that fails.
enum Target<'a> {
    Unix(reach::Socket<'a>),
    Tcp {
        endpoint: Box<tonic::transport::Endpoint>,
        reach: reach::Tcp<'a>,
    },
}

impl Target<'_> {
    /// The words for a call that failed on the connection itself (not an
    /// answer of the agent): what is wrong with the endpoint where a look
    /// at it says, else the status and its causes.
    async fn after_call(&self, status: &tonic::Status) -> String {
        let said = match (self, status.source()) {
            (Target::Unix(socket), _) => socket.check().err(),
            (Target::Tcp { reach, .. }, Some(cause)) => reach.diagnose(cause).await,
            (Target::Tcp { .. }, None) => None,
        };
        said.unwrap_or_else(|| {
            let code = resident_api::code_name(status.code());
            match status.source() {
                Some(cause) => format!("{code}: {}: {}", status.message(), reach::causes(cause)),
                None => format!("{code}: {}", status.message()),
            }
        })
    }
}

/// The agent `cli` names, not yet connected.
fn target(cli: &Cli) -> Result<Target<'_>, Failure> {
    let endpoint = match &cli.endpoint {
        None => {
            return Ok(Target::Unix(reach::Socket {
                path: &cli.socket,
                given: cli.socket_given,
                by_endpoint: false,
            }));
        }
        Some(e) => e,
    };
    if let Some(path) = endpoint.strip_prefix("unix://") {
        return Ok(Target::Unix(reach::Socket {
            path: std::path::Path::new(path),
            given: cli.endpoint_given,
            by_endpoint: true,
        }));
    }
    let uri: tonic::transport::Uri = endpoint
        .parse()
        .map_err(|e| Failure::Error(format!("--endpoint {endpoint:?}: {e}")))?;
    let mut channel = tonic::transport::Endpoint::from(uri.clone());
    let https = match uri.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        _ => {
            return Err(Failure::Error(format!(
                "--endpoint {endpoint:?}: expected https://HOST:PORT, http://HOST:PORT or unix:///PATH"
            )));
        }
    };
    let mut tls = None;
    if https {
        let read = |what: &str, path: &Option<PathBuf>| -> Result<Vec<u8>, Failure> {
            let path = path.as_ref().ok_or_else(|| {
                Failure::Error(format!(
                    "{endpoint} needs --{what} (or RESIDENTD_{})",
                    what.to_uppercase()
                ))
            })?;
            std::fs::read(path)
                .map_err(|e| Failure::Error(format!("--{what} {}: {e}", path.display())))
        };
        let name = cli.tls_name.clone().unwrap_or_else(|| host_name(&uri));
        let (ca_pem, cert_pem, key_pem) = (
            read("ca", &cli.ca)?,
            read("cert", &cli.cert)?,
            read("key", &cli.key)?,
        );
        let config = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&ca_pem))
            .identity(tonic::transport::Identity::from_pem(&cert_pem, &key_pem))
            .domain_name(name.clone());
        channel = channel
            .tls_config(config)
            .map_err(|e| Failure::Error(format!("--endpoint {endpoint}: {}", reach::causes(&e))))?;
        tls = Some(reach::Tls {
            name,
            name_given: cli.tls_name.is_some(),
            ca: cli.ca.clone(),
            cert: cli.cert.clone(),
            ca_pem,
            cert_pem,
            key_pem,
        });
    }
    Ok(Target::Tcp {
        endpoint: Box::new(channel),
        reach: reach::Tcp {
            endpoint,
            host: host_name(&uri),
            port: uri.port_u16().unwrap_or(if https { 443 } else { 80 }),
            tls,
        },
    })
}

/// A client of the agent at `target`; the words of what is wrong when it
/// cannot be reached.
async fn connect(target: &Target<'_>) -> Result<NodeAgentClient<Channel>, Failure> {
    match target {
        Target::Unix(socket) => {
            socket.check().map_err(Failure::Error)?;
            match resident_api::connect_unix(socket.path).await {
                Ok(c) => Ok(c),
                Err(e) => Err(Failure::Error(socket.explain(&e))),
            }
        }
        Target::Tcp { endpoint, reach } => match endpoint.connect().await {
            Ok(channel) => Ok(NodeAgentClient::new(channel)),
            Err(e) => Err(Failure::Error(reach.explain(&e).await)),
        },
    }
}

async fn run(cli: &Cli) -> Result<ExitCode, Failure> {
    let target = target(cli)?;
    let c = connect(&target).await?;
    match command(cli, c).await {
        Err(Failure::Unreached(status)) => Err(Failure::Error(target.after_call(&status).await)),
        done => done,
    }
}

async fn command(cli: &Cli, mut c: NodeAgentClient<Channel>) -> Result<ExitCode, Failure> {
    let json = cli.json;
    match &cli.command {
        Command::Start {
            workload,
            id,
            policy: p,
            wait,
            lease,
        } => {
            let req = pb::StartRequest {
                workload: workload.clone(),
                instance_id: id.clone().unwrap_or_default(),
                on_full: policy(*p),
                wait_ready: *wait,
                lease_ms: millis(lease.as_deref(), "lease")?,
            };
            let spinner =
                (*wait && !json).then(|| render::Spinner::start(format!("starting {workload}")));
            let answer = c.start(req).await;
            drop(spinner);
            let r = answer?.into_inner();
            render::started(&r, json)?;
        }
        Command::Stop { id, grace } => {
            let grace_ms = millis(grace.as_deref(), "grace")?;
            let r = c
                .stop(pb::StopRequest {
                    instance_id: id.clone(),
                    grace_ms,
                })
                .await?
                .into_inner();
            render::instances(&r.instance.into_iter().collect::<Vec<_>>(), json)?;
        }
        Command::Sleep { id } => {
            let spinner = (!json).then(|| render::Spinner::start(format!("putting {id} to sleep")));
            let answer = c
                .sleep(pb::SleepRequest {
                    instance_id: id.clone(),
                })
                .await;
            drop(spinner);
            render::instance(&answer?.into_inner(), json)?;
        }
        Command::Get { id } => {
            let r = c
                .get(pb::GetRequest {
                    instance_id: id.clone(),
                })
                .await?
                .into_inner();
            render::instance(&r, json)?;
        }
        Command::Ls => {
            let r = c.list(pb::ListRequest {}).await?.into_inner();
            render::instances(&r.instances, json)?;
        }
        Command::Place {
            workload,
            policy: p,
        } => {
            let req = pb::PlaceRequest {
                workload: workload.clone(),
                on_full: policy(*p),
                ..Default::default()
            };
            let r = c.place(req).await?.into_inner();
            // The answer's exit status stands even when nobody reads it.
            written(render::placement(&r, json))?;
            if !r.admitted {
                return Ok(ExitCode::from(EXIT_REFUSED));
            }
        }
        Command::Touch {
            id,
            hold,
            release_hold,
        } => {
            let hold_ms = millis(hold.as_deref(), "hold")?;
            let r = c
                .touch(pb::TouchRequest {
                    instance_id: id.clone(),
                    hold_ms,
                    release_hold: *release_hold,
                })
                .await?
                .into_inner();
            render::instances(&[r], json)?;
        }
        Command::Adopt {
            pid,
            workload,
            id,
            manage,
            port,
        } => {
            let req = pb::AdoptRequest {
                pid: *pid,
                workload: workload.clone(),
                instance_id: id.clone(),
                manage: *manage,
                port: port.map_or(0, u32::from),
            };
            let r = c.adopt(req).await?.into_inner();
            render::instances(&[r], json)?;
        }
        Command::Reload => {
            let r = c.reload(pb::ReloadRequest {}).await?.into_inner();
            render::reloaded(&r, json)?;
        }
        Command::Upgrade => {
            let r = c.upgrade(pb::UpgradeRequest {}).await?.into_inner();
            render::upgraded(&r, json)?;
        }
        Command::Workloads => {
            let r = c.workloads(pb::WorkloadsRequest {}).await?.into_inner();
            render::workloads(&r.workloads, json)?;
        }
        Command::ForgetFootprint { workload } => {
            let req = pb::ForgetFootprintRequest {
                workload: workload.clone(),
            };
            let r = c.forget_footprint(req).await?.into_inner();
            render::workloads(&[r], json)?;
        }
        Command::Node => {
            let r = c.node(pb::NodeRequest {}).await?.into_inner();
            render::node(&r, json)?;
        }
        Command::Logs {
            id,
            tail,
            stream: only,
            follow,
        } => {
            let req = pb::LogsRequest {
                instance_id: id.clone(),
                tail: *tail,
                follow: *follow,
            };
            let mut stream = c.logs(req).await?.into_inner();
            while let Some(line) = stream.next().await {
                let line = line?;
                if only.is_none_or(|s| s.holds(&line)) {
                    render::log_line(&line, json)?;
                }
            }
            if *follow {
                // A followed log ends when the instance's run has ended.
                let ended = c
                    .get(pb::GetRequest {
                        instance_id: id.clone(),
                    })
                    .await;
                render::log_end(id, ended.ok().map(|r| r.into_inner()).as_ref())?;
            }
        }
        Command::Top { frames } => {
            let mut stream = c
                .watch(pb::WatchRequest { since_revision: 0 })
                .await?
                .into_inner();
            let mut drawn = 0u64;
            let snapshots = c
                .list(pb::ListRequest {})
                .await?
                .into_inner()
                .instances
                .len();
            let mut seen = 0usize;
            // Draw once the snapshot is in, then after every event.
            loop {
                if seen >= snapshots {
                    let node = c.node(pb::NodeRequest {}).await?.into_inner();
                    render::top(&node)?;
                    drawn += 1;
                    if frames.is_some_and(|f| drawn >= f) {
                        break;
                    }
                }
                match stream.next().await {
                    Some(event) => {
                        event?;
                        seen += 1;
                    }
                    None => break,
                }
            }
        }
        Command::Watch { since } => {
            let mut stream = c
                .watch(pb::WatchRequest {
                    since_revision: *since,
                })
                .await?
                .into_inner();
            while let Some(event) = stream.next().await {
                render::event(&event?, json)?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The name a server's certificate is checked against: the endpoint's
/// host, an IPv6 address without the brackets the URI writes it in.
fn host_name(uri: &tonic::transport::Uri) -> String {
    uri.host()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        .unwrap_or_default()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::host_name;

    #[test]
    fn a_certificate_is_checked_against_the_host_without_brackets() {
        for (endpoint, name) in [
            ("https://[::1]:7070", "::1"),
            ("https://127.0.0.1:7070", "127.0.0.1"),
            ("https://node-3.example:7070", "node-3.example"),
        ] {
            let uri: tonic::transport::Uri = endpoint.parse().expect("a URI");
            assert_eq!(host_name(&uri), name, "{endpoint}");
        }
    }
}
