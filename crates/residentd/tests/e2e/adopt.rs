//! Adopt through the agent: servers started by the test (as an operator
//! would, by hand) entered into the books without a restart. Counted,
//! probed, shown as adopted, never signalled unless managed, released when
//! they exit, re-adopted by the next agent, and reported (not stopped)
//! when they listen beyond loopback.

use std::process::{Child, Command, Stdio};

use crate::support::*;
use resident_api::pb;
use tonic::Code;

const CTL: &str = env!("CARGO_BIN_EXE_residentctl");

/// An HTTP server answering 200 on GET /health and on POST /sleep and
/// /wake (the calls of workload `sleepy`), bound to `host` on a port the
/// kernel picks (it prints it: no other test can take it in between),
/// started by the test in a process group of its own, killed when the
/// test ends; returns it and its port.
fn server(host: &str) -> (Killed, u16) {
    use std::io::BufRead as _;
    use std::os::unix::process::CommandExt as _;
    let script = format!(
        "import http.server\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         \x20   def do_GET(self):\n\
         \x20       self.send_response(200 if self.path == '/health' else 404)\n\
         \x20       self.end_headers()\n\
         \x20   def do_POST(self):\n\
         \x20       self.send_response(200 if self.path in ('/sleep', '/wake') else 404)\n\
         \x20       self.end_headers()\n\
         \x20   def log_message(self, *a):\n\
         \x20       pass\n\
         s = http.server.HTTPServer(('{host}', 0), H)\n\
         print(s.server_address[1], flush=True)\n\
         s.serve_forever()\n"
    );
    let mut child = Killed(
        Command::new("python3")
            .args(["-c", &script])
            .process_group(0)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 runs"),
    );
    let out = child.stdout.take().expect("its stdout");
    let mut line = String::new();
    std::io::BufReader::new(out)
        .read_line(&mut line)
        .expect("the server's port");
    let port = line.trim().parse().expect("a port number");
    (child, port)
}

/// Waits (bounded) until `port` accepts connections.
async fn listening(port: u16) {
    let up = eventually(async || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    assert!(up.await, "the server on {port} never listened");
}

fn adopt_req(pid: u32, workload: &str, id: &str, manage: bool) -> pb::AdoptRequest {
    pb::AdoptRequest {
        pid,
        workload: workload.into(),
        instance_id: id.into(),
        manage,
        port: 0,
    }
}

fn kill(c: &mut Child) {
    let _ = c.kill();
    let _ = c.wait();
}

/// `srv` (4 GB of the 10 GB pool `ram`, probed on /health), `big` (8 GB)
/// and `open` (like srv, but `expose = "loopback"`).
fn config() -> String {
    let workload = |name: &str, gb: u64, extra: &str| {
        format!(
            "[[workload]]\nname = \"{name}\"\ncommand = [\"/bin/sleep\", \"3600\"]\nstop_grace = \"2s\"\n{extra}\n[workload.readiness]\nhttp = \"/health\"\n[workload.memory.ram]\nweights = \"{gb}GB\"\n\n"
        )
    };
    pool("ram", "10GB")
        + &workload("srv", 4, "")
        + &workload("big", 8, "")
        + &workload("open", 1, "expose = \"loopback\"")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_server_is_counted_never_signalled_and_adopted_again() {
    let mut d = Daemon::start(&config()).await;
    let (mut srv, port) = server("127.0.0.1");
    listening(port).await;

    let i = d
        .client
        .adopt(adopt_req(srv.id(), "srv", "hand", false))
        .await
        .expect("adopted")
        .into_inner();
    assert!(i.adopted && !i.managed, "{i:?}");
    assert_eq!(i.pid, srv.id());
    assert_eq!(i.port, u32::from(port), "its port found from its sockets");
    let ready = d.wait_state("hand", pb::State::Ready).await;
    assert!(ready.message.contains("adopted"), "{}", ready.message);
    assert_eq!(d.used().await, 4_000_000_000, "counted against its pool");

    // It is in the way of a bigger start, and cannot be evicted for it.
    let mut big = start_req("big", "b");
    big.on_full = pb::Policy::Evict as i32;
    let e = d.client.start(big).await.expect_err("no room");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    // A Stop is refused: the agent never signals what it does not manage.
    let e = d
        .client
        .stop(pb::StopRequest {
            instance_id: "hand".into(),
            grace_ms: 0,
        })
        .await
        .expect_err("not managed");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("without manage"), "{}", e.message());
    // The same process cannot be adopted twice.
    let e = d
        .client
        .adopt(adopt_req(srv.id(), "srv", "again", false))
        .await
        .expect_err("twice");
    assert_eq!(e.code(), Code::AlreadyExists, "{}", e.message());
    // Nor a process that is not there, nor one of the agent's own.
    let e = d
        .client
        .adopt(adopt_req(999_999, "srv", "ghost", false))
        .await
        .expect_err("no such process");
    assert_eq!(e.code(), Code::NotFound);
    let sleeper = d.started("srv", "own").await;
    let e = d
        .client
        .adopt(adopt_req(sleeper.pid, "srv", "own2", false))
        .await
        .expect_err("the agent's own");
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    d.stopped("own").await;

    // An agent that dies (kill -9) and comes back adopts it again: the
    // same process, never restarted.
    let mut d = d.restart().await;
    let back = d.wait_state("hand", pb::State::Ready).await;
    assert!(back.adopted && back.pid == srv.id(), "{back:?}");
    assert!(
        alive(srv.id() as i32),
        "the agent's death took no adopted process"
    );
    // A graceful stop of the agent lets it go, and the next adopts it too.
    d.terminate().await;
    assert!(
        alive(srv.id() as i32),
        "shutdown signals no adopted process"
    );
    let dir = std::mem::replace(&mut d.dir, tempfile::tempdir().expect("tempdir"));
    drop(d);
    let mut d = Daemon::start_in(dir).await;
    let back = d.wait_state("hand", pb::State::Ready).await;
    assert_eq!(back.pid, srv.id());

    // It exits by the operator's hand: released.
    kill(&mut srv);
    let ended = d.wait_state("hand", pb::State::Exited).await;
    assert!(ended.message.contains("exited"), "{}", ended.message);
    assert_eq!(d.used().await, 0);
    // Once it is gone, it is not adopted by a later agent either.
    let mut d = d.restart().await;
    let node = d.node().await;
    assert!(
        node.instances.iter().all(|i| i.instance_id != "hand"),
        "{node:?}"
    );
    d.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adoption_without_manage_is_never_put_to_sleep() {
    // A workload that sleeps after a second unused, and by a call.
    let config = pool("ram", "10GB")
        + "[[workload]]\nname = \"sleepy\"\ncommand = [\"/bin/sleep\", \"3600\"]\n[workload.readiness]\nhttp = \"/health\"\n[workload.memory.ram]\nweights = \"4GB\"\n[workload.sleep]\nsleep = \"POST /sleep\"\nwake = \"POST /wake\"\nidle = \"1s\"\n";
    let mut d = Daemon::start(&config).await;
    let (mut srv, port) = server("127.0.0.1");
    listening(port).await;
    d.client
        .adopt(adopt_req(srv.id(), "sleepy", "hand", false))
        .await
        .expect("adopted");
    d.wait_state("hand", pb::State::Ready).await;
    // Asked: refused, and asked again, refused for the same reason (a
    // call that was made and failed would leave it half asleep: its
    // owner's process cannot be stopped).
    for _ in 0..2 {
        let e = d
            .client
            .sleep(pb::SleepRequest {
                instance_id: "hand".into(),
            })
            .await
            .expect_err("not managed");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("without manage"), "{}", e.message());
    }
    // The control: a managed adoption of the same workload, adopted after
    // `hand` (so last used after it), is put to sleep by the agent's idle
    // sweep (every second) once its idle second has run out. Watched
    // until then and once it is asleep, `hand` stays awake and READY: the
    // sweep that took the managed one passed over it.
    let (mut managed, port) = server("127.0.0.1");
    listening(port).await;
    d.client
        .adopt(adopt_req(managed.id(), "sleepy", "ctl", true))
        .await
        .expect("adopted, managed");
    let mut hand = d.get("hand").await;
    let ctl_asleep = until(async || {
        hand = d.get("hand").await;
        if hand.state != pb::State::Ready as i32 || hand.message.contains("sleep") {
            return Some(false);
        }
        let ctl = d.get("ctl").await;
        (ctl.state == pb::State::Sleeping as i32 && ctl.message.starts_with("SLEEPING: asleep"))
            .then_some(true)
    })
    .await;
    assert_eq!(
        ctl_asleep,
        Some(true),
        "the managed adoption falls asleep while the unmanaged one stays READY: hand is {hand:?}"
    );
    let i = d.get("hand").await;
    assert_eq!(i.state, pb::State::Ready as i32, "{i:?}");
    assert!(!i.message.contains("sleep"), "{}", i.message);
    kill(&mut managed);
    kill(&mut srv);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_managed_adoption_is_stopped_and_an_exposed_one_only_reported() {
    let mut d = Daemon::start(&config()).await;
    // Managed, through residentctl: a Stop ends it with SIGTERM.
    let (mut srv, port) = server("127.0.0.1");
    listening(port).await;
    let out = Command::new(CTL)
        .arg("--socket")
        .arg(&d.socket)
        .args([
            "adopt",
            &srv.id().to_string(),
            "srv",
            "--id",
            "m",
            "--manage",
        ])
        .output()
        .expect("residentctl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains(&format!("{} (adopted)", srv.id())),
        "{table}"
    );
    d.wait_state("m", pb::State::Ready).await;
    let stopped = d.stopped("m").await;
    assert!(stopped.message.contains("SIGTERM"), "{}", stopped.message);
    let status = srv.wait().expect("reaped");
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(
        status.signal(),
        Some(nix::sys::signal::Signal::SIGTERM as i32)
    );
    assert_eq!(d.used().await, 0);

    // Listening on every address under expose = "loopback": reported in
    // its message and the metric's count, and left running.
    let (mut open, port) = server("0.0.0.0");
    listening(port).await;
    d.client
        .adopt(adopt_req(open.id(), "open", "o", false))
        .await
        .expect("adopted");
    let reported = until(async || {
        let i = d.get("o").await;
        i.message.contains("EXPOSED").then_some(i)
    })
    .await
    .expect("the exposure is reported");
    assert_eq!(reported.cause, pb::Cause::Exposed as i32);
    assert!(
        reported.message.contains("reported and not stopped"),
        "{}",
        reported.message
    );
    assert_eq!(reported.state, pb::State::Ready as i32);
    assert!(alive(open.id() as i32));
    kill(&mut open);
    d.wait_state("o", pb::State::Exited).await;
}
