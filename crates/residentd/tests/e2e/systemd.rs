//! The packaged systemd unit passes `systemd-analyze verify` without a word
//! (its drop-in too, where systemd is new enough for it), and the
//! children of an agent that protects itself from the OOM killer do not
//! inherit that protection; the packaged config, run by an unprivileged
//! agent as the unit runs it, starts a model as that same user.

use std::os::unix::fs::PermissionsExt as _;
use std::process::Command;

use resident_api::pb;

use crate::support::*;

/// The drop-in with the restart keys that systemd before 254 does not know.
const BACKOFF: &str = "residentd.service.d/backoff.conf";

/// What `systemd-analyze verify` says about the unit in `dir` (and any
/// drop-in beside it); panics when verify fails.
fn verify(dir: &std::path::Path) -> String {
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(dir.join("residentd.service"))
        .output()
        .expect("run verify");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "systemd-analyze verify failed:\n{err}"
    );
    String::from_utf8_lossy(&out.stdout).into_owned() + &err
}

/// systemd's major version, from the first line of `--version`
/// ("systemd 252 (252.38-1~deb12u1)").
fn major(version: &str) -> u32 {
    version
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("a systemd version in {version:?}"))
}

#[test]
fn the_unit_verifies() {
    let Ok(version) = Command::new("systemd-analyze").arg("--version").output() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI installs systemd-analyze (.ci/run)"
        );
        return skip("no systemd-analyze on this machine (Debian package systemd)");
    };
    assert!(version.status.success());
    let systemd = major(&String::from_utf8_lossy(&version.stdout));
    let root = workspace().join("systemd");
    let text = std::fs::read_to_string(root.join("residentd.service")).expect("the unit");
    for key in [
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "RestartSec=1s",
        "RestartPreventExitStatus=78",
        "KillMode=process",
        "Delegate=yes",
        "OOMPolicy=continue",
        "OOMScoreAdjust=-900",
    ] {
        assert!(text.contains(key), "the unit sets {key}");
    }
    let backoff = std::fs::read_to_string(root.join(BACKOFF)).expect("the backoff drop-in");
    assert!(
        backoff.contains("systemd >= 254"),
        "the drop-in says what it needs"
    );
    for key in ["RestartSteps=", "RestartMaxDelaySec="] {
        assert!(backoff.contains(key), "the drop-in holds {key}");
        assert!(!text.contains(key), "the unit leaves {key} to the drop-in");
    }
    // verify checks that ExecStart exists: point it at the built binary.
    // Alone in its directory, the unit is checked without the drop-in.
    let dir = tempfile::tempdir().expect("tempdir");
    let unit = text.replace("/usr/bin/residentd", RESIDENTD);
    std::fs::write(dir.path().join("residentd.service"), unit).expect("write");
    let said = verify(dir.path());
    assert!(
        said.is_empty(),
        "systemd-analyze verify (systemd {systemd}) printed:\n{said}"
    );
    if systemd < 254 {
        return skip(&format!(
            "the drop-in half: the backoff drop-in needs systemd >= 254; this is systemd {systemd}"
        ));
    }
    let drop_in = dir.path().join(BACKOFF);
    std::fs::create_dir_all(drop_in.parent().expect("a directory")).expect("mkdir");
    std::fs::write(&drop_in, backoff).expect("write");
    let said = verify(dir.path());
    assert!(
        said.is_empty(),
        "systemd-analyze verify (systemd {systemd}) printed with the drop-in:\n{said}"
    );
}

#[tokio::test]
async fn children_do_not_inherit_the_agents_oom_protection() {
    let config = pool("ram", "1GB") + &sleeper("a", "ram", 1, "");
    let dir = tempfile::tempdir().expect("tempdir");
    write_config(dir.path(), &config);
    // Start the agent with a score of its own. systemd's OOMScoreAdjust=-900
    // needs CAP_SYS_RESOURCE, which the test machines lack; any non-zero
    // score shows the same thing: the child does not keep the agent's.
    let mut d = Daemon::start_in_with(dir, |cmd| {
        use std::os::unix::process::CommandExt as _;
        // SAFETY: only writes a /proc file between fork and exec.
        unsafe {
            cmd.pre_exec(|| std::fs::write("/proc/self/oom_score_adj", "500"));
        }
    })
    .await;
    let agent_adj =
        std::fs::read_to_string(format!("/proc/{}/oom_score_adj", d.pid())).expect("agent");
    assert_eq!(agent_adj.trim(), "500");
    let a = d
        .client
        .start(start_req("a", "a"))
        .await
        .expect("starts")
        .into_inner();
    let pid = a.instance.expect("instance").pid;
    let child_adj = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj")).expect("child");
    assert_eq!(
        child_adj.trim(),
        "0",
        "the model starts from the default score, not the agent's"
    );
}

/// The packaged config for an agent in `dir`: its paths moved into `dir`,
/// its socket group `agent`'s and its models' user `model` (the packaged
/// `residentd` and `residentd-model` exist only where the package is
/// installed), and `workload` added (as shipped it has none, so that it
/// loads on any machine).
fn packaged_config_in(
    dir: &std::path::Path,
    agent: &nix::unistd::User,
    model: &nix::unistd::User,
    workload: &str,
) -> String {
    let text = std::fs::read_to_string(workspace().join("systemd/residentd.toml"))
        .expect("the packaged config");
    for key in [
        "run_as = \"residentd-model\"",
        "socket_group = \"residentd\"",
        "listen = \"unix:///run/residentd/residentd.sock\"",
        "state_dir = \"/var/lib/residentd\"",
    ] {
        assert!(text.contains(key), "the packaged config sets {key}");
    }
    let group = nix::unistd::Group::from_gid(agent.gid)
        .ok()
        .flatten()
        .expect("the agent user's group")
        .name;
    assert!(
        !text.lines().any(|l| l.starts_with("[[workload]]")),
        "the packaged config declares no workload, only a commented example"
    );
    text.replace("\"residentd-model\"", &format!("\"{}\"", model.name))
        .replace(
            "socket_group = \"residentd\"",
            &format!("socket_group = \"{group}\""),
        )
        .replace(
            "\"unix:///run/residentd/residentd.sock\"",
            &format!("\"unix://{}/agent.sock\"", dir.display()),
        )
        .replace(
            "\"/var/lib/residentd\"",
            &format!("\"{}/state\"", dir.display()),
        )
        + workload
}

/// The uid a live process runs as (the real one, from `/proc/PID/status`).
fn uid_of(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .expect("a Uid line");
    line.split_whitespace()
        .next()
        .and_then(|u| u.parse().ok())
        .expect("a uid")
}

/// The packaged node (issue #43.5): the agent runs as the unit's user with
/// the unit's ambient capabilities (CAP_SETUID, CAP_SETGID, CAP_KILL), and
/// its models as a user of their own, which reaches neither the agent's
/// socket (the agent's own uid is always an admin: a model running as the
/// agent could Reload, Upgrade, Stop and Adopt) nor its state directory
/// (the journal, the FIFOs), and holds no capability. Before, the shipped
/// config ran models as the agent's own user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_packaged_node_starts_a_model_as_its_own_unprivileged_user() {
    let unit =
        std::fs::read_to_string(workspace().join("systemd/residentd.service")).expect("the unit");
    assert!(unit.contains("User=residentd") && unit.contains("Group=residentd"));
    for line in [
        "AmbientCapabilities=CAP_SETUID CAP_SETGID CAP_KILL",
        "CapabilityBoundingSet=CAP_SETUID CAP_SETGID CAP_KILL",
        "StateDirectoryMode=0700",
        "RuntimeDirectoryMode=0750",
    ] {
        assert!(unit.contains(line), "the unit says {line}");
    }
    let postinst =
        std::fs::read_to_string(workspace().join("packaging/deb/postinst")).expect("the postinst");
    assert!(
        postinst.contains("useradd --system --gid residentd-model"),
        "the package makes the models' user"
    );
    if !nix::unistd::geteuid().is_root() {
        return skip("starting the agent as another user needs root");
    }
    // Stand-ins: `nobody` for the unit's user (an unprivileged account
    // with a group of its own), `daemon` for the models' user.
    let agent = nix::unistd::User::from_name("nobody")
        .ok()
        .flatten()
        .expect("user nobody");
    let model = nix::unistd::User::from_name("daemon")
        .ok()
        .flatten()
        .expect("user daemon");
    let dir = tempfile::tempdir().expect("tempdir");
    nix::unistd::chown(dir.path(), Some(agent.uid), Some(agent.gid)).expect("chown");
    // The model tries the attack's ways in, and says what it got.
    let probe = format!(
        "import os, socket\ntry:\n    s = socket.socket(socket.AF_UNIX)\n    s.connect({sock:?})\n    print('SOCKET reached', flush=True)\nexcept OSError as e:\n    print('SOCKET refused', e.errno, flush=True)\ntry:\n    open({state:?} + '/planted', 'w').write('x')\n    print('STATE wrote', flush=True)\nexcept OSError as e:\n    print('STATE refused', e.errno, flush=True)\nimport time\ntime.sleep(3600)\n",
        sock = dir.path().join("agent.sock").display().to_string(),
        state = dir.path().join("state").display().to_string(),
    );
    let workload = format!(
        "\n[[workload]]\nname = \"coder\"\ncommand = [\"/usr/bin/python3\", \"-c\", {probe:?}]\n[workload.memory.ram]\nweights = \"1GB\"\n"
    );
    let text = packaged_config_in(dir.path(), &agent, &model, &workload);
    std::fs::write(dir.path().join("residentd.toml"), &text).expect("write");
    nix::unistd::chown(&dir.path().join("residentd.toml"), Some(agent.uid), None).expect("chown");
    // The agent as the unit starts it: its user, its capabilities.
    let bin = tempfile::tempdir().expect("tempdir");
    let program = bin.path().join("residentd-as-unit");
    let wrapper = format!(
        "#!/bin/sh\nexec setpriv --reuid={uid} --regid={gid} --clear-groups --inh-caps +setuid,+setgid,+kill --ambient-caps +setuid,+setgid,+kill {real} \"$@\"\n",
        uid = agent.uid,
        gid = agent.gid,
        real = RESIDENTD
    );
    std::fs::write(&program, wrapper).expect("write");
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // Valid, without a warning, as the agent's user checks it.
    let check = Command::new(&program)
        .arg("--check-config")
        .arg(dir.path().join("residentd.toml"))
        .output()
        .expect("run --check-config");
    let said = String::from_utf8_lossy(&check.stderr);
    assert!(
        check.status.success(),
        "the packaged config is valid: {said}"
    );
    assert!(!said.contains("warning"), "{said}");

    let mut d = Daemon::start_program(&program, dir, |_| {}).await;
    assert_eq!(
        uid_of(d.pid() as u32),
        agent.uid.as_raw(),
        "the agent is unprivileged"
    );
    d.started("coder", "c").await;
    let c = d.wait_state("c", pb::State::Ready).await;
    assert_eq!(
        uid_of(c.pid),
        model.uid.as_raw(),
        "the model runs as its own user"
    );
    let said = until(async || {
        let req = pb::LogsRequest {
            instance_id: "c".into(),
            tail: 10,
            follow: false,
        };
        let mut stream = d.client.logs(req).await.ok()?.into_inner();
        let mut lines = Vec::new();
        while let Ok(Some(l)) = stream.message().await {
            lines.push(l.line);
        }
        (lines.iter().any(|l| l.starts_with("STATE"))).then_some(lines)
    })
    .await
    .expect("the model said what it reached");
    assert!(
        said.iter().any(|l| l.starts_with("SOCKET refused")),
        "the model reached the agent's socket: {said:?}"
    );
    assert!(
        said.iter().any(|l| l.starts_with("STATE refused")),
        "the model wrote into the state directory: {said:?}"
    );
    let caps = std::fs::read_to_string(format!("/proc/{}/status", c.pid)).expect("status");
    assert!(
        caps.lines()
            .filter(|l| l.starts_with("CapEff:") || l.starts_with("CapAmb:"))
            .all(|l| l.ends_with("0000000000000000")),
        "{caps}"
    );
    d.stopped("c").await;
}
