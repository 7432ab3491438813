//! Access control and hostile input against the real agent: the uid/gid
//! allowlist for mutating calls, peer credentials in the log, the socket's
//! group, programs checked when the config loads, and the limits on
//! message size and instance count.

mod support;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::process::Command;

use resident_api::pb;
use support::*;
use tonic::Code;

const POOL: &str = "[[pool]]\nname = \"ram\"\nbudget = \"100GB\"\n";

fn roster() -> String {
    format!("{POOL}{}", sleeper("nap", "ram", 1, ""))
}

#[tokio::test]
async fn callers_outside_the_allowlist_change_nothing() {
    let me = nix::unistd::getuid().as_raw();
    let stranger = me.wrapping_add(4242);
    let mut d = Daemon::start(&format!("allow_uids = [{stranger}]\n{}", roster())).await;
    let denied = d
        .client
        .start(start_req("nap", "n1"))
        .await
        .expect_err("not in the allowlist");
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    assert!(
        denied.message().contains(&format!("uid {me}")),
        "{denied:?}"
    );
    let stop = pb::StopRequest {
        instance_id: "n1".into(),
        grace_ms: 0,
    };
    let denied = d.client.stop(stop).await.expect_err("stop denied too");
    assert_eq!(denied.code(), Code::PermissionDenied);
    let touch = pb::TouchRequest {
        instance_id: "n1".into(),
        hold_ms: 1000,
    };
    let denied = d.client.touch(touch).await.expect_err("touch denied too");
    assert_eq!(denied.code(), Code::PermissionDenied);
    // Reading is not restricted, and nothing changed.
    assert!(d.ids().await.is_empty());
    let place = pb::PlaceRequest {
        workload: "nap".into(),
        on_full: 0,
    };
    let placement = d.client.place(place).await.expect("place is a read");
    assert!(placement.into_inner().admitted);
    let node = d.client.node(pb::NodeRequest {}).await.expect("node");
    assert_eq!(node.into_inner().pools[0].used_bytes, 0);
    assert!(
        d.log()
            .contains("refused: caller not in allow_uids / allow_gids")
    );

    // The same caller, listed by group, may start.
    let gid = nix::unistd::getgid().as_raw();
    let text = config_text(
        d.dir.path(),
        &format!(
            "allow_uids = [{stranger}]\nallow_gids = [{gid}]\n{}",
            roster()
        ),
    );
    std::fs::write(d.dir.path().join("residentd.toml"), text).expect("rewrite the config");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(d.pid()),
        nix::sys::signal::Signal::SIGHUP,
    )
    .expect("SIGHUP");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        match d.client.start(start_req("nap", "n1")).await {
            Ok(_) => break,
            Err(e) if e.code() == Code::PermissionDenied => {}
            Err(e) => panic!("unexpected {e:?}"),
        }
        assert!(tokio::time::Instant::now() < deadline, "reload never took");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(d.ids().await, ["n1"]);
}

#[tokio::test]
async fn mutating_calls_log_the_callers_credentials() {
    let mut d = Daemon::start(&roster()).await;
    d.started("nap", "n1").await;
    let stop = pb::StopRequest {
        instance_id: "n1".into(),
        grace_ms: 0,
    };
    d.client.stop(stop).await.expect("stops");
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
    }
    let out = check_config(dir.path(), &workload("/bin/true"));
    assert_eq!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    if nix::unistd::geteuid().is_root() {
        assert!(
            err.contains("warning: workload[w] would run as root"),
            "{err}"
        );
    }
    let user = nix::unistd::User::from_uid(1.into()).ok().flatten();
    if let Some(user) = user {
        let with_user = workload("/bin/true").replace(
            "name = \"w\"\n",
            &format!("name = \"w\"\nrun_as = \"{}\"\n", user.name),
        );
        let out = check_config(dir.path(), &with_user);
        assert_eq!(out.status.code(), Some(0));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("would run as root"), "{err}");
    }
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
    let stop = pb::StopRequest {
        instance_id: "b".into(),
        grace_ms: 0,
    };
    d.client.stop(stop).await.expect("stops");
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
