//! Adopted processes: started here by the test (so not the supervisor's
//! children), watched through a pidfd. Readiness, memory and exit are seen;
//! a process not managed is never signalled (a Stop and shutdown let it
//! go); a managed one is stopped with SIGTERM; a reused or gone pid is
//! refused.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::*;
use resident_supervisor::{Adoption, LaunchSpec, Readiness, State, SupervisorConfig, procfs};

/// The test child running `steps` in a process group of its own, started
/// by the test, with the environment it needs; killed when dropped.
fn outsider(steps: &[&str], port: u16) -> Killed {
    use std::os::unix::process::CommandExt as _;
    let child = Command::new(TESTCHILD)
        .args(steps)
        .env("PORT", port.to_string())
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the outsider");
    Killed(child)
}

fn adoption(c: &Child, port: u16, manage: bool) -> Adoption {
    let pid = c.id();
    let stat = procfs::stat(pid as i32).expect("the outsider runs");
    Adoption {
        pid,
        start_ticks: stat.start_ticks,
        port,
        manage,
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn spec(id: &str, readiness: Readiness) -> LaunchSpec {
    let mut s = LaunchSpec::new(id, vec!["(adopted)".into()]);
    s.readiness = readiness;
    s.readiness_timeout = Duration::from_secs(20);
    s.stop_grace = Duration::from_secs(5);
    s
}

/// Reaps the outsider once it has exited (bounded), so it is not left as
/// a zombie of the test.
fn reaped(mut c: Killed) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        if let Some(status) = c.try_wait().expect("try_wait") {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the outsider did not exit"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[tokio::test]
async fn an_adopted_server_is_probed_sampled_and_seen_to_exit() {
    let mut h = Harness::with(SupervisorConfig {
        sample_every: Duration::from_millis(50),
        ..SupervisorConfig::default()
    });
    let port = free_port();
    let c = outsider(&["alloc=64", "http=/health,300"], port);
    let a = adoption(&c, port, false);
    let status = h
        .sup
        .adopt(
            spec(
                "srv",
                Readiness::Http {
                    path: "/health".into(),
                },
            ),
            a,
        )
        .await
        .expect("adopted");
    assert_eq!(status.state, State::Starting);
    assert_eq!(status.pid, Some(c.id()));
    let ready = h.until("srv", State::Ready).await;
    assert!(ready.reason.contains("adopted"), "{}", ready.reason);
    // It leads its group, so it is sampled like a child's run.
    let sup = h.sup.clone();
    let sampled = eventually(PATIENCE, || {
        let sup = sup.clone();
        async move {
            sup.status("srv")
                .is_some_and(|s| s.measured_bytes >= 64 << 20)
        }
    });
    assert!(
        sampled.await,
        "its 64 MB are measured: {:?}",
        h.sup.status("srv")
    );
    // It exits by another hand: seen through the pidfd.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(c.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    let ended = h.until("srv", State::Exited).await;
    assert!(ended.reason.contains("exited"), "{}", ended.reason);
    assert_eq!(ended.pid, None);
    reaped(c);
}

#[tokio::test]
async fn an_unmanaged_adoption_is_never_signalled_a_managed_one_is_stopped() {
    let mut h = Harness::new();
    // Not managed: a Stop lets it go and it runs on.
    let free = outsider(&["forever"], 0);
    let a = adoption(&free, 0, false);
    h.sup
        .adopt(spec("free", Readiness::None), a)
        .await
        .expect("adopted");
    h.until("free", State::Ready).await;
    let let_go = h.sup.stop("free", None).await.expect("stop");
    assert_eq!(let_go.state, State::Exited);
    assert!(let_go.reason.starts_with("let go"), "{}", let_go.reason);
    assert!(
        alive(free.id() as i32),
        "an unmanaged adoption is never signalled"
    );

    // Managed: SIGTERM ends it.
    let managed = outsider(&["forever"], 0);
    let a = adoption(&managed, 0, true);
    h.sup
        .adopt(spec("managed", Readiness::None), a)
        .await
        .expect("adopted");
    h.until("managed", State::Ready).await;
    let stopped = h.sup.stop("managed", None).await.expect("stop");
    assert_eq!(stopped.state, State::Exited);
    assert!(stopped.reason.contains("SIGTERM"), "{}", stopped.reason);
    let status = reaped(managed);
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(status.signal(), Some(libc_sigterm()));

    // Shutdown lets a managed adoption go too: it is not the agent's child.
    let kept = outsider(&["forever"], 0);
    let a = adoption(&kept, 0, true);
    h.sup
        .adopt(spec("kept", Readiness::None), a)
        .await
        .expect("adopted");
    h.until("kept", State::Ready).await;
    h.sup.shutdown().await;
    assert!(
        alive(kept.id() as i32),
        "shutdown signals no adopted process"
    );
    for c in [free, kept] {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill");
        reaped(c);
    }
}

fn libc_sigterm() -> i32 {
    nix::sys::signal::Signal::SIGTERM as i32
}

#[tokio::test]
async fn a_gone_or_reused_pid_is_refused() {
    let h = Harness::new();
    let c = outsider(&["forever"], 0);
    let mut a = adoption(&c, 0, false);
    a.start_ticks += 1;
    let e = h
        .sup
        .adopt(spec("x", Readiness::None), a)
        .await
        .expect_err("another start time: not the same process");
    assert!(e.to_string().contains("no longer the process"), "{e}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(c.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill");
    let pid = c.id();
    reaped(c);
    let a = Adoption {
        pid,
        start_ticks: 0,
        port: 0,
        manage: false,
    };
    let e = h
        .sup
        .adopt(spec("y", Readiness::None), a)
        .await
        .expect_err("gone");
    assert!(
        e.to_string().contains(&format!("cannot adopt pid {pid}")),
        "{e}"
    );
    assert!(h.sup.status("x").is_none() && h.sup.status("y").is_none());
}
