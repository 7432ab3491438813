//! The packaged systemd unit passes `systemd-analyze verify` without a word
//! (its drop-in too, where systemd is new enough for it), and the
//! children of an agent that protects itself from the OOM killer do not
//! inherit that protection; the packaged config, run by an unprivileged
//! agent as the unit runs it, starts a model as that same user.

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
/// its user and socket group `user`'s (the packaged `residentd` exists
/// only where the package is installed), a workload that runs here added
/// (as shipped it has none, so that it loads on any machine).
fn packaged_config_in(dir: &std::path::Path, user: &nix::unistd::User) -> String {
    let text = std::fs::read_to_string(workspace().join("systemd/residentd.toml"))
        .expect("the packaged config");
    for key in [
        "run_as = \"residentd\"",
        "socket_group = \"residentd\"",
        "listen = \"unix:///run/residentd/residentd.sock\"",
        "state_dir = \"/var/lib/residentd\"",
    ] {
        assert!(text.contains(key), "the packaged config sets {key}");
    }
    let group = nix::unistd::Group::from_gid(user.gid)
        .ok()
        .flatten()
        .expect("the user's group")
        .name;
    assert!(
        !text.lines().any(|l| l.starts_with("[[workload]]")),
        "the packaged config declares no workload, only a commented example"
    );
    text.replace("\"residentd\"", &format!("\"{}\"", user.name))
        .replace(
            "\"unix:///run/residentd/residentd.sock\"",
            &format!("\"unix://{}/agent.sock\"", dir.display()),
        )
        .replace(
            "\"/var/lib/residentd\"",
            &format!("\"{}/state\"", dir.display()),
        )
        .replace(
            &format!("socket_group = \"{}\"", user.name),
            &format!("socket_group = \"{group}\""),
        )
        + &sleeper("coder", "ram", 1, "")
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

#[tokio::test]
async fn the_packaged_node_starts_a_model_as_its_own_unprivileged_user() {
    let unit =
        std::fs::read_to_string(workspace().join("systemd/residentd.service")).expect("the unit");
    assert!(unit.contains("User=residentd") && unit.contains("Group=residentd"));
    if !nix::unistd::geteuid().is_root() {
        return skip("starting the agent as another user needs root");
    }
    // The unit's user stands in as `nobody`: an unprivileged account with a
    // group of its own, as the package's system user is.
    let user = nix::unistd::User::from_name("nobody")
        .ok()
        .flatten()
        .expect("user nobody");
    let dir = tempfile::tempdir().expect("tempdir");
    nix::unistd::chown(dir.path(), Some(user.uid), Some(user.gid)).expect("chown");
    let text = packaged_config_in(dir.path(), &user);
    std::fs::write(dir.path().join("residentd.toml"), &text).expect("write");
    let as_user = |cmd: &mut Command| {
        use std::os::unix::process::CommandExt as _;
        // std drops root's supplementary groups when it changes the uid.
        cmd.uid(user.uid.as_raw()).gid(user.gid.as_raw());
    };
    // Valid, without a warning, as the agent's user checks it (its state
    // directory is that user's: root would not trust it).
    let mut check = Command::new(RESIDENTD);
    check
        .arg("--check-config")
        .arg(dir.path().join("residentd.toml"));
    as_user(&mut check);
    let out = check.output().expect("run --check-config");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the packaged config is valid: {said}");
    assert!(!said.contains("warning"), "{said}");

    // Told to run its children as someone else, the unprivileged agent
    // says at load that it cannot, naming the key.
    let other = text.replace(&format!("run_as = \"{}\"", user.name), "run_as = \"root\"");
    std::fs::write(dir.path().join("other.toml"), &other).expect("write");
    let mut check = Command::new(RESIDENTD);
    check
        .arg("--check-config")
        .arg(dir.path().join("other.toml"));
    as_user(&mut check);
    let out = check.output().expect("run --check-config");
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{said}");
    assert!(
        said.contains("node.run_as") && said.contains("cannot run children as \"root\""),
        "{said}"
    );

    // As its own user, it starts a model through residentctl.
    let d = Daemon::start_in_with(dir, as_user).await;
    assert_eq!(
        uid_of(d.pid() as u32),
        user.uid.as_raw(),
        "the agent is unprivileged"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_residentctl"))
        .arg("--socket")
        .arg(&d.socket)
        .args(["start", "coder", "--id", "c", "--wait"])
        .output()
        .expect("run residentctl");
    assert!(
        out.status.success(),
        "residentctl start: {}{}\nagent log:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
    let mut d = d;
    let c = d.get("c").await;
    assert_eq!(c.state(), pb::State::Ready, "{c:?}");
    assert_eq!(
        uid_of(c.pid),
        user.uid.as_raw(),
        "the model runs as the unit's user"
    );
    d.stopped("c").await;
}
