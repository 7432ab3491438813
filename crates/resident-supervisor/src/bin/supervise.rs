//! Runs one command under the supervisor until SIGTERM or SIGINT, then
//! stops it gracefully. Prints `pid=N` once the child is spawned.
//!
//! Usage: `resident-supervise [--ready-http PATH] -- PROGRAM [ARGS...]`
//! (`RESIDENT_CGROUPS=off` contains it by process group only).
//!
//! Handy to try the supervisor by hand, and the tests use it as an agent
//! they can kill -9.

use std::time::Duration;

use resident_supervisor::{LaunchSpec, Readiness, Supervisor, SupervisorConfig};

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(split) = args.iter().position(|a| a == "--") else {
        eprintln!("usage: resident-supervise [--ready-http PATH] -- PROGRAM [ARGS...]");
        std::process::exit(2);
    };
    let (opts, argv) = (&args[..split], args[split + 1..].to_vec());
    if argv.is_empty() {
        eprintln!("resident-supervise: no program after --");
        std::process::exit(2);
    }
    let mut spec = LaunchSpec::new("supervised", argv);
    if let [flag, path] = opts
        && flag == "--ready-http"
    {
        spec.readiness = Readiness::Http { path: path.clone() };
    }
    spec.stop_grace = Duration::from_secs(5);
    let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let config = SupervisorConfig {
        cgroups: match std::env::var("RESIDENT_CGROUPS").as_deref() {
            Ok("off") => resident_supervisor::CgroupMode::Off,
            _ => resident_supervisor::CgroupMode::Auto,
        },
        ..SupervisorConfig::default()
    };
    let sup = Supervisor::new(config, events);
    tokio::spawn(async move {
        while let Some(s) = rx.recv().await {
            eprintln!("{} {} {}", s.instance, s.state, s.reason);
        }
    });
    match sup.start(spec).await {
        Ok(status) => println!("pid={}", status.pid.unwrap_or_default()),
        Err(e) => {
            eprintln!("resident-supervise: {e}");
            std::process::exit(1);
        }
    }
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("resident-supervise: cannot watch SIGTERM: {e}");
            std::process::exit(1);
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    sup.shutdown().await;
}
