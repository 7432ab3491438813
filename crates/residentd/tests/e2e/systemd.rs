//! The packaged systemd unit passes `systemd-analyze verify` without a word
//! (its drop-in too, where systemd is new enough for it), and the
//! children of an agent that protects itself from the OOM killer do not
//! inherit that protection.

use std::process::Command;

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
        "KillMode=mixed",
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

#[test]
fn the_packaged_config_runs_models_as_a_dedicated_user() {
    let path = workspace().join("systemd/residentd.toml");
    let text = std::fs::read_to_string(&path).expect("the packaged config");
    let unit = workspace().join("systemd/residentd.service");
    let unit = std::fs::read_to_string(&unit).expect("the unit");
    assert!(unit.contains("User=residentd"));
    assert!(text.contains("run_as = \"residentd\""));
    assert!(text.contains("socket_group = \"residentd\""));
    // The residentd user and group exist only where the agent is installed;
    // validate the rest with an account every machine has.
    let root = nix::unistd::Group::from_gid(0.into())
        .ok()
        .flatten()
        .expect("group 0")
        .name;
    let here = text
        .replace("run_as = \"residentd\"", "run_as = \"nobody\"")
        .replace(
            "socket_group = \"residentd\"",
            &format!("socket_group = \"{root}\""),
        );
    let c = resident_config::parse(&path, &here).expect("the packaged config is valid");
    assert_eq!(
        c.node.run_as.as_ref().map(|u| u.name.as_str()),
        Some("nobody")
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert_eq!(
        c.node.listen,
        [resident_config::Listen::Unix(
            "/run/residentd/residentd.sock".into()
        )]
    );
}
