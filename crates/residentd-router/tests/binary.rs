//! The `residentd-router` binary as its unit runs it: the unit's ExecStart
//! flags are accepted, it serves before the agent is up (answering that
//! the agent did not answer), SIGTERM ends it with 0, and the unit passes
//! `systemd-analyze verify` beside the agent's unit.

use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../../resident-supervisor/tests/supervisor/skip.rs"]
mod skip;

const ROUTER: &str = env!("CARGO_BIN_EXE_residentd-router");

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn unit() -> String {
    std::fs::read_to_string(workspace().join("systemd/residentd-router.service"))
        .expect("the router's unit")
}

/// The unit's ExecStart, split into words.
fn exec_start() -> Vec<String> {
    let text = unit();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("an ExecStart line");
    line.split_whitespace().map(str::to_string).collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// GET `path`; the status and the body.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

#[test]
fn the_units_command_line_serves_and_sigterm_ends_it_cleanly() {
    let mut args = exec_start();
    assert_eq!(args.remove(0), "/usr/bin/residentd-router");
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    // The unit's flags, with the socket and address of this test.
    for a in args.iter_mut() {
        if a == "/run/residentd/residentd.sock" {
            *a = dir.path().join("absent.sock").display().to_string();
        } else if a == "127.0.0.1:8080" {
            *a = format!("127.0.0.1:{port}");
        }
    }
    let mut child = Command::new(ROUTER)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the router");
    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        if let Some(a) = get(port, "/health") {
            break a;
        }
        assert!(Instant::now() < deadline, "the router never served");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(answer.0, 503, "{answer:?}");
    assert!(answer.1.contains("agent_unavailable"), "{answer:?}");
    let (status, body) = get(port, "/metrics").expect("metrics");
    assert_eq!(status, 200);
    assert!(body.contains("residentd_router_starts_waiting 0"), "{body}");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let status = child.wait().expect("wait");
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read");
    assert!(status.success(), "{status}: {err}");
    assert!(err.contains("answers in flight finish first"), "{err}");
    // Its log goes to a pipe here, as to journald or a file: no colour.
    assert!(
        !err.contains('\x1b'),
        "escape codes in a log that is no terminal: {err:?}"
    );
}

#[test]
fn bad_flags_are_named() {
    let out = Command::new(ROUTER)
        .args(["--queue-timeout", "soon"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--queue-timeout") && err.contains("'soon'"),
        "{err}"
    );
    // Values that parse but cannot work: 78 before serving, naming them.
    let rows: [(&[&str], &str); 4] = [
        (
            &["--allow-host", "http://node-7"],
            "--allow-host 'http://node-7'",
        ),
        (&["--upstream-allow", "sleep"], "--upstream-allow 'sleep'"),
        (&["--upstream-allow", "/v1/../sleep"], "no . or .. segments"),
        (&["--max-connections", "0"], "--max-connections 0"),
    ];
    for (args, said) in rows {
        let out = Command::new(ROUTER)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{args:?}: {err}");
        assert!(err.contains(said), "{args:?}: {err}");
    }
}

#[test]
fn the_unit_verifies_beside_the_agents() {
    let Ok(out) = Command::new("systemd-analyze").arg("--version").output() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI installs systemd-analyze (.ci/run)"
        );
        return skip::skip("no systemd-analyze on this machine (Debian package systemd)");
    };
    assert!(out.status.success());
    let text = unit();
    for key in [
        "BindsTo=residentd.service",
        "After=residentd.service",
        "KillMode=mixed",
    ] {
        assert!(text.contains(key), "the unit sets {key}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = std::fs::read_to_string(workspace().join("systemd/residentd.service"))
        .expect("the agent's unit");
    // verify checks that ExecStart exists: point both at built binaries.
    std::fs::write(
        dir.path().join("residentd.service"),
        agent.replace("/usr/bin/residentd", ROUTER),
    )
    .expect("write");
    std::fs::write(
        dir.path().join("residentd-router.service"),
        text.replace("/usr/bin/residentd-router", ROUTER),
    )
    .expect("write");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(dir.path().join("residentd.service"))
        .arg(dir.path().join("residentd-router.service"))
        .output()
        .expect("run verify");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && said.is_empty(),
        "systemd-analyze verify printed:\n{said}"
    );
}

#[test]
fn tls_flags_that_cannot_work_are_said_before_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not PEM").expect("write");
    let junk = junk.to_str().expect("a UTF-8 path");
    let https = "https://localhost:7443";
    let files = ["--ca", junk, "--cert", junk, "--key", junk];
    let with_files = |agent: &'static str| {
        let mut args = vec!["--agent", agent];
        args.extend(files);
        args
    };
    let rows: Vec<(Vec<&str>, i32, &str)> = vec![
        (vec!["--cert", junk], 2, "--ca <CA>"),
        (vec!["--ca", junk, "--key", junk], 2, "--cert <CERT>"),
        (vec!["--agent", https], 78, "needs --ca, --cert and --key"),
        (
            vec![
                "--agent",
                https,
                "--ca",
                "/nonexistent/ca.pem",
                "--cert",
                junk,
                "--key",
                junk,
            ],
            78,
            "--ca /nonexistent/ca.pem: No such file",
        ),
        (
            with_files("/run/residentd/residentd.sock"),
            78,
            "are for an https://HOST:PORT agent",
        ),
        (
            with_files("http://127.0.0.1:7443"),
            78,
            "are for an https://HOST:PORT agent",
        ),
        (with_files(https), 78, "--ca: no CA certificate in it"),
    ];
    for (args, code, said) in rows {
        let out = Command::new(ROUTER)
            .args(&args)
            .args(["--listen", "127.0.0.1:0"])
            .env_remove("RESIDENTD_SOCKET")
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(said), "{args:?}: {err}");
    }
    // The TLS flags as environment variables, like residentctl's.
    let out = Command::new(ROUTER)
        .args(["--agent", https, "--listen", "127.0.0.1:0"])
        .env("RESIDENTD_CA", junk)
        .env("RESIDENTD_CERT", junk)
        .env("RESIDENTD_KEY", junk)
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{err}");
    assert!(err.contains("--ca: no CA certificate in it"), "{err}");
}
