//! Access control and hostile input against the real agent: the uid/gid
//! allowlist for mutating calls, peer credentials in the log, the socket's
//! group, programs checked when the config loads, and the limits on
//! message size and instance count.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::process::Command;

use crate::support::*;
use resident_api::pb;
use tonic::Code;

const POOL: &str = "[[pool]]\nname = \"ram\"\nbudget = \"100GB\"\n";

/// What a command wrote, stdout then stderr.
fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn roster() -> String {
    format!("{POOL}{}", sleeper("nap", "ram", 1, ""))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_outside_the_allowlist_change_nothing_and_root_is_never_locked_out() {
    if !nix::unistd::geteuid().is_root() {
        return skip("needs root: a caller of another user is made with setuid");
    }
    let stranger = 4242;
    let allow = |extra: &str| {
        format!(
            "socket_group = \"nogroup\"\nallow_uids = [{stranger}]\n{extra}{}",
            roster()
        )
    };
    let mut d = Daemon::start(&allow("")).await;
    // The socket's directory must let other users reach the socket.
    std::fs::set_permissions(d.dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // uid 65534, outside the allowlist: a viewer. Every change is denied.
    let socket = d.socket.clone();
    let nobody =
        |args: &[&str]| tokio::task::block_in_place(|| as_nobody_on(&socket, &[65534], args));
    let pid = std::process::id().to_string();
    for args in [
        &["start", "nap", "--id", "n1"][..],
        &["stop", "n1"],
        &["touch", "n1", "--hold", "1s"],
        &["adopt", &pid, "nap", "--id", "n2"],
    ] {
        let o = nobody(args);
        assert!(!o.status.success(), "{args:?}: {}", text(&o));
        assert!(
            text(&o).contains("PERMISSION_DENIED"),
            "{args:?}: {}",
            text(&o)
        );
    }
    let o = nobody(&["start", "nap", "--id", "n1"]);
    assert!(
        text(&o).contains("Start needs the operator role; uid 65534 gid 65534")
            && text(&o).contains("has the viewer role"),
        "{}",
        text(&o)
    );
    // Reading is not restricted, and nothing changed.
    assert!(nobody(&["ls"]).status.success());
    assert!(nobody(&["place", "nap"]).status.success());
    assert!(d.ids().await.is_empty());
    assert_eq!(d.node().await.pools[0].used_bytes, 0);
    let log = d.log();
    let denied = log.lines().find(|l| {
        l.contains(" audit: ") && l.contains("rpc=\"Start\"") && l.contains("outcome=\"denied\"")
    });
    let denied = denied.unwrap_or_else(|| panic!("no audit line of the denied Start: {log}"));
    assert!(denied.contains("uid=65534"), "{denied}");
    // Root (this test) is not in the allowlist either, and stays admin:
    // an allowlist written for others never locks it out.
    d.started("nap", "root").await;
    d.stopped("root").await;

    // The same caller, listed by group, may start.
    let text_config = config_text(d.dir.path(), &allow("allow_gids = [65534]\n"));
    std::fs::write(d.dir.path().join("residentd.toml"), text_config).expect("rewrite the config");
    d.signal(nix::sys::signal::Signal::SIGHUP);
    // Denied until the reload takes; any other error is a failure.
    let started = until(async || {
        let o = nobody(&["start", "nap", "--id", "n1"]);
        (!text(&o).contains("PERMISSION_DENIED")).then_some(o)
    });
    let started = started.await.expect("reload never took");
    assert!(started.status.success(), "{}", text(&started));
    assert_eq!(d.ids().await, ["n1", "root"]);
}

#[tokio::test]
async fn mutating_calls_log_the_callers_credentials() {
    let mut d = Daemon::start(&roster()).await;
    d.started("nap", "n1").await;
    d.stopped("n1").await;
    let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
    let want = format!("uid={uid} gid={gid} pid={}", std::process::id());
    let log = d.log();
    let callers: Vec<&str> = log.lines().filter(|l| l.contains(&want)).collect();
    assert!(callers.iter().any(|l| l.contains("rpc=\"Start\"")), "{log}");
    assert!(callers.iter().any(|l| l.contains("rpc=\"Stop\"")), "{log}");
}

#[tokio::test]
async fn the_socket_belongs_to_the_configured_group_with_mode_0660() {
    // Any group of this machine other than our own primary one shows the
    // chown happened.
    let mine = nix::unistd::getgid();
    let Some(group) = ["daemon", "nogroup", "adm", "users"]
        .iter()
        .filter_map(|n| nix::unistd::Group::from_name(n).ok().flatten())
        .find(|g| g.gid != mine)
    else {
        panic!("no spare group on this machine to give the socket to");
    };
    let d = Daemon::start(&format!("socket_group = \"{}\"\n{}", group.name, roster())).await;
    let meta = std::fs::metadata(&d.socket).expect("the socket");
    assert_eq!(meta.gid(), group.gid.as_raw());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
}

fn check_config(dir: &std::path::Path, rest: &str) -> std::process::Output {
    let path = dir.join("check.toml");
    std::fs::write(&path, config_text(dir, rest)).expect("write");
    Command::new(RESIDENTD)
        .arg("--check-config")
        .arg(&path)
        .output()
        .expect("run residentd --check-config")
}

#[test]
fn programs_are_checked_when_the_config_loads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let workload = |program: &str| {
        format!(
            "{POOL}[[workload]]\nname = \"w\"\ncommand = [\"{program}\", \"x\"]\n[workload.memory.ram]\nweights = \"1GB\"\n"
        )
    };
    let writable = dir.path().join("anyone-can-write");
    std::fs::copy("/bin/true", &writable).expect("copy a program");
    std::fs::set_permissions(&writable, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let not_exec = dir.path().join("not-executable");
    std::fs::write(&not_exec, "#!/bin/sh\n").expect("write");
    std::fs::set_permissions(&not_exec, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    // The command line is on line 10 of the file config_text writes.
    for (program, want) in [
        ("/no/such/server", "No such file"),
        ("no-such-server-on-path", "is not on PATH"),
        (writable.to_str().expect("utf-8"), "writable by every user"),
        (not_exec.to_str().expect("utf-8"), "is not executable"),
    ] {
        let out = check_config(dir.path(), &workload(program));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{program}: {err}");
        assert!(err.contains("check.toml:"), "{err}");
        assert!(err.contains("workload[w].command"), "{err}");
        assert!(err.contains(want), "{program}: {err}");
        // A file for another machine is checked without looking here.
        let elsewhere = Command::new(RESIDENTD)
            .arg("--check-config")
            .arg(dir.path().join("check.toml"))
            .arg("--for-another-host")
            .output()
            .expect("run residentd --check-config --for-another-host");
        let said = String::from_utf8_lossy(&elsewhere.stderr);
        assert_eq!(elsewhere.status.code(), Some(0), "{program}: {said}");
    }
    // A name is looked up on the PATH the child gets: its own, if it sets one.
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("mkdir");
    std::fs::copy("/bin/true", bin.join("own-server")).expect("copy a program");
    let own_path = workload("own-server").replace(
        "name = \"w\"\n",
        &format!("name = \"w\"\nenv = {{ PATH = \"{}\" }}\n", bin.display()),
    );
    let out = check_config(dir.path(), &own_path);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let out = check_config(dir.path(), &workload("/bin/true"));
    assert_eq!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    // Warned exactly when the agent runs as root, as the child would.
    assert_eq!(
        err.contains("warning: workload[w] would run as root"),
        nix::unistd::geteuid().is_root(),
        "{err}"
    );
    let Some(user) = nix::unistd::User::from_uid(1.into()).ok().flatten() else {
        return skip("the run_as half: no user with uid 1 on this machine");
    };
    let with_user = workload("/bin/true").replace(
        "name = \"w\"\n",
        &format!("name = \"w\"\nrun_as = \"{}\"\n", user.name),
    );
    let out = check_config(dir.path(), &with_user);
    assert_eq!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("would run as root"), "{err}");
}

#[tokio::test]
async fn the_instance_count_is_capped() {
    let mut d = Daemon::start(&format!("max_instances = 2\n{}", roster())).await;
    d.started("nap", "a").await;
    d.started("nap", "b").await;
    let err = d
        .client
        .start(start_req("nap", "c"))
        .await
        .expect_err("over max_instances");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("max_instances = 2"), "{err:?}");
    // An idempotent start of a resident id is not a new instance.
    let again = d
        .client
        .start(start_req("nap", "a"))
        .await
        .expect("same id");
    assert!(!again.into_inner().created);
    assert_eq!(d.ids().await, ["a", "b"]);
    d.stopped("b").await;
    d.started("nap", "c").await;
}

#[tokio::test]
async fn an_oversized_message_is_refused_and_the_agent_goes_on() {
    let mut d = Daemon::start(&roster()).await;
    let huge = "x".repeat(5 << 20);
    let err = d
        .client
        .start(start_req(&huge, "big"))
        .await
        .expect_err("over 4 MiB");
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    d.started("nap", "after").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_does_not_read_is_cut_off_and_resumes_without_a_gap() {
    use tokio_stream::StreamExt as _;
    // Every start of "whale" is refused, and every refusal is an event.
    let text = format!("{POOL}{}", sleeper("whale", "ram", 200, ""));
    let mut d = Daemon::start(&text).await;
    // A connection of its own with a small stream window, so the server's
    // buffers, not the client's, fill up.
    let endpoint = tonic::transport::Endpoint::from_static("http://localhost")
        .initial_stream_window_size(Some(65_535));
    let channel = resident_api::endpoint_unix(endpoint, d.socket.clone())
        .await
        .expect("connect");
    let mut slow = pb::node_agent_client::NodeAgentClient::new(channel);
    let mut stuck = slow
        .watch(pb::WatchRequest { since_revision: 0 })
        .await
        .expect("watch")
        .into_inner();
    // Far more events than the agent buffers for one watcher; every call
    // is answered while nobody reads the watch.
    let events = 3000u64;
    let refusals: Vec<_> = (0..4)
        .map(|_| {
            let mut c = d.client.clone();
            tokio::spawn(async move {
                for _ in 0..events / 4 {
                    let err = c.start(start_req("whale", "")).await.expect_err("refused");
                    assert_eq!(err.code(), Code::ResourceExhausted);
                }
            })
        })
        .collect();
    for r in refusals {
        r.await.expect("the refusing client");
    }
    // Now read: what was buffered, then the cut-off with its resume point.
    let mut last = 0;
    let cut = loop {
        match tokio::time::timeout(PATIENCE, stuck.next()).await {
            Ok(Some(Ok(e))) => {
                assert_eq!(e.revision, last + 1, "in order, no gap");
                last = e.revision;
            }
            Ok(Some(Err(status))) => break status,
            Ok(None) => panic!("the stream ended without a status after {last}"),
            Err(_) => panic!("the stream neither went on nor ended after {last}"),
        }
    };
    assert_eq!(cut.code(), Code::ResourceExhausted, "{cut:?}");
    assert!(last < events, "the slow watcher was cut off before the end");
    assert!(
        cut.message()
            .contains(&format!("resume with since_revision = {last}")),
        "{cut:?}"
    );
    let mut resumed = d
        .client
        .watch(pb::WatchRequest {
            since_revision: last,
        })
        .await
        .expect("resume")
        .into_inner();
    while last < events {
        let e = tokio::time::timeout(PATIENCE, resumed.next())
            .await
            .expect("in time")
            .expect("open")
            .expect("ok");
        assert_eq!(e.revision, last + 1, "the resumed watch continues exactly");
        last = e.revision;
    }
}

#[tokio::test]
async fn ended_instances_beyond_the_cap_are_forgotten_oldest_first() {
    use tokio_stream::StreamExt as _;
    let mut d = Daemon::start(&format!("max_instances = 2\n{}", roster())).await;
    let mut watch = d.watch(0).await;
    // Five ids, each started and stopped: a table that only grew would
    // hold all five.
    for n in 1..=5 {
        let id = format!("e{n}");
        d.started("nap", &id).await;
        d.stopped(&id).await;
    }
    d.started("nap", "live").await;
    // Two ended ones are kept (the newest), plus the live one.
    assert_eq!(d.ids().await, ["e4", "e5", "live"]);
    let gone = d
        .client
        .get(pb::GetRequest {
            instance_id: "e1".into(),
        })
        .await
        .expect_err("forgotten");
    assert_eq!(gone.code(), Code::NotFound);
    let mut forgotten = Vec::new();
    while forgotten.len() < 3 {
        let e = tokio::time::timeout(PATIENCE, watch.next())
            .await
            .expect("in time")
            .expect("open")
            .expect("ok");
        if e.kind == pb::EventKind::Forgotten as i32 {
            let i = e.instance.expect("the instance");
            assert_eq!(i.state, pb::State::Exited as i32, "its last state");
            forgotten.push(i.instance_id);
        }
    }
    assert_eq!(forgotten, ["e1", "e2", "e3"]);
}

/// A demo server bound to `bind`, under `expose`.
fn http_server(name: &str, bind: &str, expose: &str) -> String {
    format!(
        "[[workload]]\nname = \"{name}\"\ncommand = [\"python3\", \"-m\", \"http.server\", \"${{PORT}}\", \"--bind\", \"{bind}\"]\nexpose = \"{expose}\"\nstop_grace = \"2s\"\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.readiness]\ntcp = true\n[workload.restart]\npolicy = \"never\"\n"
    )
}

#[tokio::test]
async fn a_server_listening_beyond_loopback_is_stopped_as_exposed() {
    let config = pool("ram", "10GB")
        + &http_server("inside", "127.0.0.1", "loopback")
        + &http_server("outside", "0.0.0.0", "loopback")
        + &http_server("allowed", "0.0.0.0", "any");
    let mut d = Daemon::start(&config).await;
    for (workload, id) in [("inside", "in"), ("allowed", "ok")] {
        let mut req = start_req(workload, id);
        req.wait_ready = true;
        d.client.start(req).await.expect("starts");
    }
    let mut req = start_req("outside", "out");
    req.wait_ready = true;
    d.client.start(req).await.expect("starts");
    let out = d.wait_state("out", pb::State::Exited).await;
    assert!(
        out.message.starts_with("EXPOSED: listening on 0.0.0.0:"),
        "{}",
        out.message
    );
    assert_eq!(out.cause, pb::Cause::Exposed as i32);
    assert_eq!(
        d.node().await.pools[0].used_bytes,
        2_000_000_000,
        "released"
    );
    // The guard looked at every READY instance in the tick that stopped
    // `out` (they were READY before it): loopback and `any` run on.
    for id in ["in", "ok"] {
        assert_eq!(d.get(id).await.state, pb::State::Ready as i32, "{id}");
    }
}

/// residentctl with `args`, run as uid and gid 65534 (nobody, nogroup)
/// with `groups` as its supplementary groups: another user, as an operator
/// would see them.
fn as_nobody(d: &Daemon, groups: &[u32], args: &[&str]) -> std::process::Output {
    as_nobody_on(&d.socket, groups, args)
}

#[tokio::test]
async fn unix_callers_get_the_roles_their_uid_and_groups_are_granted() {
    if !nix::unistd::geteuid().is_root() {
        return skip("needs root: callers of other users are made with setuid");
    }
    const OPERATORS: u32 = 4242;
    let access = format!(
        "socket_group = \"nogroup\"\n[node.access]\nviewers = [\"group:nogroup\"]\noperators = [\"gid:{OPERATORS}\"]\nadmins = [\"uid:0\"]\n\n"
    );
    let mut d = Daemon::start(&format!("{access}{}", roster())).await;
    // The socket's directory must let other users reach the socket.
    std::fs::set_permissions(d.dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // In nogroup only: a viewer. It reads; it cannot start.
    let o = as_nobody(&d, &[65534], &["ls"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = as_nobody(&d, &[65534], &["start", "nap", "--id", "v"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("Start needs the operator role; uid 65534 gid 65534 groups 65534"),
        "{}",
        text(&o)
    );
    assert!(d.ids().await.is_empty(), "nothing changed");
    // With the operators' group among its supplementary groups: an
    // operator. It starts; it cannot reload.
    let o = as_nobody(&d, &[65534, OPERATORS], &["start", "nap", "--id", "o"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(d.ids().await, ["o"]);
    let o = as_nobody(&d, &[65534, OPERATORS], &["reload"]);
    assert!(
        text(&o).contains("Reload needs the admin role"),
        "{}",
        text(&o)
    );
    // Root is the admin here.
    let r = d
        .client
        .reload(pb::ReloadRequest {})
        .await
        .expect("root reloads");
    assert!(
        r.into_inner()
            .warnings
            .iter()
            .all(|w| !w.contains("changed"))
    );
    // The audit trail says who did what, allowed or not.
    let log = d.log();
    let audit: Vec<&str> = log.lines().filter(|l| l.contains(" audit: ")).collect();
    let line = |rpc: &str, outcome: &str| {
        audit
            .iter()
            .find(|l| {
                l.contains(&format!("rpc=\"{rpc}\""))
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .copied()
    };
    let denied = line("Start", "denied").expect("the viewer's Start is audited");
    assert!(denied.contains("uid=65534 gid=65534"), "{denied}");
    assert!(
        denied.contains("instance_id=\"\""),
        "refused before it was read: {denied}"
    );
    let ok = line("Start", "ok").expect("the operator's Start is audited");
    assert!(ok.contains(&format!("groups {OPERATORS},65534")), "{ok}");
    assert!(ok.contains("instance_id=\"o\""), "{ok}");
    assert!(
        line("Reload", "denied").is_some() && line("Reload", "ok").is_some(),
        "{audit:#?}"
    );
    d.stopped("o").await;
}
