//! The attacks a security review found (issue #43), each performed as an
//! attacker would (as another uid where it matters, `setpriv` for
//! capabilities) and shown to fail now, with the process or file it aimed
//! at unharmed. Each failed on the code before its fix.

use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};

use resident_api::pb;

use crate::support::*;

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A process the test started, killed when the test ends, passed or not.
struct Killed(Child);

impl Killed {
    fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `sleep 3600` running as `uid`, in a process group of its own: another
/// user's process, the target.
fn victim(uid: u32) -> Killed {
    let child = Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "sleep",
            "3600",
        ])
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("setpriv runs");
    Killed(child)
}

/// Whether `pid` still runs (not a zombie).
fn alive(pid: u32) -> bool {
    resident_supervisor::procfs::stat(pid as i32).is_some_and(|s| s.state != 'Z')
}

/// #43.1: an operator adopts another user's process with `--manage` and
/// stops it. Now adopting a process that is not the workload's program
/// running as the workload's user needs the admin role: refused, naming
/// what did not match, and the process lives on. An operator still adopts
/// the workload's own program running as its user. Before: adopted and
/// killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_cannot_adopt_and_kill_another_users_process() {
    if !nix::unistd::geteuid().is_root() {
        return skip("needs root: the operator and the victim are other users");
    }
    const OPERATORS: u32 = 4343;
    let config = format!(
        "socket_group = \"nogroup\"\n[node.access]\noperators = [\"gid:{OPERATORS}\"]\nadmins = [\"uid:0\"]\n\n{}{}",
        pool("ram", "10GB"),
        sleeper("nap", "ram", 1, "")
    );
    let mut d = Daemon::start(&config).await;
    std::fs::set_permissions(d.dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let target = victim(1234);
    let pid = target.id();
    let socket = d.socket.clone();
    let operator = |args: &[&str]| as_nobody_on(&socket, &[65534, OPERATORS], args);
    let pid_arg = pid.to_string();
    let o = tokio::task::block_in_place(|| {
        operator(&["adopt", &pid_arg, "nap", "--id", "stolen", "--manage"])
    });
    let said = text(&o);
    assert!(!o.status.success(), "adopted: {said}");
    assert!(
        said.contains("needs the admin role") && said.contains("uid 1234"),
        "says what did not match: {said}"
    );
    assert!(d.ids().await.is_empty(), "nothing adopted");
    assert!(alive(pid), "the victim lives");
    // The workload's own program, run as the workload's user (the agent's,
    // here root): an operator may adopt it, as it may start one.
    let own = Killed(
        Command::new("/bin/sleep")
            .arg("3600")
            .process_group(0)
            .spawn()
            .expect("sleep"),
    );
    let own_pid = own.id().to_string();
    let o = tokio::task::block_in_place(|| {
        operator(&["adopt", &own_pid, "nap", "--id", "mine", "--port", "1"])
    });
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(d.ids().await, ["mine"]);
    drop((target, own));
}

/// #43.2: an agent run without root but with CAP_SETUID and CAP_SETGID
/// ambient (the docs' non-root mode, so it can run models as another
/// user) hands no capability to its model: the model's sets are empty
/// and it cannot become root. Before: the model's CapAmb and CapEff were
/// `c0` (setuid, setgid), and it could setuid(0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_inherits_no_capability_from_an_unprivileged_agent() {
    if !nix::unistd::geteuid().is_root() {
        return skip("needs root: the agent is started as another user with setpriv");
    }
    const AGENT: u32 = 4545;
    // The agent's files belong to its own user.
    let dir = tempfile::tempdir().expect("tempdir");
    let probe = "import os\nprint(open('/proc/self/status').read(), flush=True)\ntry:\n    os.setuid(0)\n    print('BECAME ROOT', flush=True)\nexcept PermissionError:\n    print('setuid(0) refused', flush=True)\nimport time\ntime.sleep(3600)\n";
    let workload = format!(
        "[[workload]]\nname = \"model\"\ncommand = [\"python3\", \"-c\", {probe:?}]\nrun_as = \"nobody\"\n[workload.memory.ram]\nweights = \"1GB\"\n"
    );
    write_config(dir.path(), &(pool("ram", "10GB") + &workload));
    nix::unistd::chown(dir.path(), Some(AGENT.into()), Some(AGENT.into())).expect("chown");
    nix::unistd::chown(&dir.path().join("residentd.toml"), Some(AGENT.into()), None)
        .expect("chown");
    let bin = tempfile::tempdir().expect("tempdir");
    let program = bin.path().join("residentd-as-user");
    let wrapper = format!(
        "#!/bin/sh\nexec setpriv --reuid={AGENT} --regid={AGENT} --clear-groups --inh-caps +setuid,+setgid --ambient-caps +setuid,+setgid {} \"$@\"\n",
        RESIDENTD
    );
    std::fs::write(&program, wrapper).expect("write");
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut d = Daemon::start_program(&program, dir, |_| {}).await;
    let agent = agent_pid(&d.socket).await;
    let caps = status_field(agent as u32, "CapAmb");
    assert_ne!(
        caps, "0000000000000000",
        "the agent itself holds its ambient capabilities"
    );
    d.started("model", "m").await;
    let m = d.wait_state("m", pb::State::Ready).await;
    let said = until(async || {
        let req = pb::LogsRequest {
            instance_id: "m".into(),
            tail: 200,
            follow: false,
        };
        let mut stream = d.client.logs(req).await.ok()?.into_inner();
        let mut lines = Vec::new();
        while let Ok(Some(l)) = stream.message().await {
            lines.push(l.line);
        }
        lines
            .iter()
            .any(|l| l.contains("setuid(0)") || l.contains("BECAME ROOT"))
            .then_some(lines)
    })
    .await
    .expect("the model said what it holds");
    assert!(
        !said.iter().any(|l| l.contains("BECAME ROOT")),
        "the model became root: {said:?}"
    );
    for key in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
        assert_eq!(
            status_field(m.pid, key),
            "0000000000000000",
            "{key}: {said:?}"
        );
    }
    assert_eq!(status_field(m.pid, "NoNewPrivs"), "1");
}

/// A field of `/proc/PID/status`, its value trimmed.
fn status_field(pid: u32, key: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| panic!("no {key} in the status of {pid}"))
}

/// #43.3: a state directory another user can write (or owns): the attack
/// plants a journal there naming a victim's process group (with its true
/// start time, which anyone can read from /proc), so that the next agent
/// kills it as a leftover of its own. The agent now refuses the directory
/// with a config error naming it, and the victim lives; `--check-config`
/// says the same with the file, line and key. Before: the agent started
/// and SIGKILLed the victim's group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_planted_in_a_state_directory_others_can_write_kills_nothing() {
    if !nix::unistd::geteuid().is_root() {
        return skip("needs root: the victim is another user's process");
    }
    for (what, mode, owner) in [
        ("world-writable", 0o777, 0),
        ("another user's", 0o755, 1234),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        std::fs::create_dir(&state).expect("mkdir");
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(mode)).expect("chmod");
        nix::unistd::chown(&state, Some(owner.into()), None).expect("chown");
        let target = victim(1234);
        let pid = target.id();
        let ticks =
            until(async || resident_supervisor::procfs::stat(pid as i32).map(|s| s.start_ticks))
                .await
                .expect("the victim runs");
        std::fs::write(
            state.join("instances.journal"),
            format!("# residentd journal 7\nx\tnap\t{pid}\t{ticks}\t0\n"),
        )
        .expect("plant");
        let config_text = format!(
            "[node]\nname = \"n\"\nlisten = \"unix://{}/agent.sock\"\nstate_dir = \"{}\"\n\n{}{}",
            dir.path().display(),
            state.display(),
            pool("ram", "10GB"),
            sleeper("nap", "ram", 1, "")
        );
        let config = dir.path().join("residentd.toml");
        std::fs::write(&config, config_text).expect("config");
        let checked = Command::new(RESIDENTD)
            .arg("--check-config")
            .arg(&config)
            .output()
            .expect("residentd runs");
        let said = text(&checked);
        assert!(!checked.status.success(), "{what}: accepted: {said}");
        assert!(
            said.contains("node.state_dir") && said.contains(&state.display().to_string()),
            "{what}: names the key and the path: {said}"
        );
        let mut agent = Command::new(RESIDENTD)
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("residentd runs");
        let ended = until(async || agent.try_wait().expect("wait")).await;
        if ended.is_none() {
            // It serves (the attack's way in): it goes, whatever follows.
            let _ = agent.kill();
        }
        let out = agent.wait_with_output().expect("output");
        assert!(
            ended.is_some_and(|s| !s.success()),
            "{what}: the agent served on it: {}",
            text(&out)
        );
        assert!(
            text(&out).contains(&state.display().to_string()),
            "{what}: names the directory: {}",
            text(&out)
        );
        assert!(alive(pid), "{what}: the victim lives");
        drop(target);
    }
}

/// #43.6: a local user binds the port the agent gave a model while the
/// model loads, and answers its readiness probe (and would get the
/// router's prompts). Readiness now counts only a listener of the
/// instance's own processes: the instance is never READY on the
/// squatter's port. Before: READY within a probe of the squatter
/// listening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_squatted_while_a_model_loads_never_makes_it_ready() {
    if !nix::unistd::geteuid().is_root() {
        return skip("needs root: the squatter is another user");
    }
    let script = workspace().join("tests/sleep/standin.py");
    let workload = format!(
        "[[workload]]\nname = \"slow\"\ncommand = [\"python3\", \"-u\", \"{}\", \"${{PORT}}\", \"10\", \"--slow-load\"]\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.readiness]\nhttp = \"/health\"\ntimeout = \"20s\"\n",
        script.display()
    );
    let mut d = Daemon::start(&(pool("ram", "10GB") + &workload)).await;
    d.started("slow", "s").await;
    let port = until(async || {
        let i = d.get("s").await;
        (i.port != 0).then_some(i.port)
    })
    .await
    .expect("a port");
    let squat = "import http.server, sys\nclass H(http.server.BaseHTTPRequestHandler):\n    def do_GET(self):\n        self.send_response(200)\n        self.end_headers()\n    def log_message(self, *a):\n        pass\nhttp.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n";
    let squatter = Killed(
        Command::new("setpriv")
            .args(["--reuid=1234", "--regid=1234", "--clear-groups"])
            .args(["/usr/bin/python3", "-c", squat, &port.to_string()])
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("setpriv runs"),
    );
    let listening =
        eventually(async || std::net::TcpStream::connect(("127.0.0.1", port as u16)).is_ok());
    assert!(listening.await, "the squatter listens on {port}");
    // The model, loading 3 s, then finds its port taken and exits; it is
    // never READY meanwhile.
    let settled = until(async || {
        let i = d.get("s").await;
        let done = [
            pb::State::Ready,
            pb::State::Failed,
            pb::State::Backoff,
            pb::State::Exited,
        ]
        .iter()
        .any(|s| i.state == *s as i32);
        done.then_some(i)
    })
    .await
    .expect("the instance settled");
    assert_ne!(
        settled.state,
        pb::State::Ready as i32,
        "READY on a squatter's port: {settled:?}"
    );
    drop(squatter);
}

/// #43.9: an upgrade executes the binary at the agent's path with
/// everything the agent holds; one that another user can write (mode
/// 0777 here, or one owned by another user) is refused before it runs,
/// and the same agent serves on. Before: checked with `--version` and
/// run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_refuses_a_binary_another_user_can_write() {
    let bin = tempfile::tempdir().expect("tempdir");
    let program = bin.path().join("residentd");
    std::fs::copy(RESIDENTD, &program).expect("copy residentd");
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let dir = tempfile::tempdir().expect("tempdir");
    write_config(
        dir.path(),
        &(pool("ram", "10GB") + &sleeper("nap", "ram", 1, "")),
    );
    let d = Daemon::start_program(&program, dir, |_| {}).await;
    let pid = agent_pid(&d.socket).await;
    // Writable by anyone: whoever wrote it would run as the agent.
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let socket = d.socket.clone();
    let o = tokio::task::spawn_blocking(move || residentctl(&socket, &["upgrade"]))
        .await
        .expect("joined");
    let said = text(&o);
    // An agent the upgrade started (were it to) goes with the test.
    let now = agent_pid(&d.socket).await;
    let _next = (now != pid).then(|| Upgraded(now));
    assert!(!o.status.success(), "upgraded: {said}");
    assert!(
        said.contains("FAILED_PRECONDITION")
            && said.contains("can be written by its group or others"),
        "{said}"
    );
    assert_eq!(agent_pid(&d.socket).await, pid, "the same agent serves");
}

/// #43.8: a Logs client that never opens its HTTP/2 window (here a window
/// of 1 KiB it never reads from) no longer pins the stream's task and its
/// unsent tail: after `outbox::STALL` (30 s) the stream is cut, and the
/// client, reading at last, gets what was buffered and then
/// RESOURCE_EXHAUSTED saying why, not a clean end that would pass for the
/// whole tail. A client that reads (the control) gets all 2,000 lines; the
/// agent answers throughout. Before, the stalled stream's task waited for
/// as long as the client stayed connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_reader_that_never_reads_is_cut_off_and_told_why() {
    let script =
        "i=0; while [ $i -lt 2000 ]; do printf '%0400d\\\\n' $i; i=$((i+1)); done; exec sleep 3600";
    let config = pool("ram", "10GB") + &shell("chatty", script, "policy = \"never\"");
    let mut d = Daemon::start(&config).await;
    d.started("chatty", "c").await;
    let logs = |client: &mut Client| {
        let mut c = client.clone();
        async move {
            c.logs(pb::LogsRequest {
                instance_id: "c".into(),
                tail: 2000,
                follow: false,
            })
            .await
            .expect("Logs")
            .into_inner()
        }
    };
    // The control, once the agent holds every line: a reader gets them all.
    let all = until(async || {
        let mut s = logs(&mut d.client).await;
        let mut n = 0;
        while let Some(l) = s.message().await.expect("a clean stream") {
            assert!(!l.line.is_empty());
            n += 1;
        }
        (n == 2000).then_some(n)
    });
    assert_eq!(all.await, Some(2000), "the tail holds every line");
    // The stalled reader: a 1 KiB window, nothing read for the stall.
    let endpoint = tonic::transport::Endpoint::from_static("http://localhost")
        .initial_stream_window_size(1024)
        .initial_connection_window_size(1024);
    let channel = resident_api::endpoint_unix(endpoint, d.socket.clone())
        .await
        .expect("connect");
    let mut slow = resident_api::pb::node_agent_client::NodeAgentClient::new(channel);
    let mut stalled = logs(&mut slow).await;
    let waited = std::time::Instant::now();
    while waited.elapsed() < residentd::outbox::STALL + std::time::Duration::from_secs(3) {
        // The agent serves others meanwhile.
        d.node().await;
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    let mut got = 0;
    let end = loop {
        match stalled.message().await {
            Ok(Some(_)) => got += 1,
            Ok(None) => panic!("ended cleanly after {got} of 2000 lines: a cut must say so"),
            Err(s) => break s,
        }
    };
    assert!(got < 2000, "{got}");
    assert_eq!(end.code(), tonic::Code::ResourceExhausted, "{end:?}");
    assert!(end.message().contains("took nothing for 30 s"), "{end:?}");
    d.stopped("c").await;
}
