//! The packaged systemd unit passes `systemd-analyze verify`, and the
//! children of an agent that protects itself from the OOM killer do not
//! inherit that protection.

mod support;

use std::path::PathBuf;
use std::process::Command;

use support::*;

/// Keys this unit uses that systemd before 254 does not know; it ignores
/// them with a warning, and newer systemd honours them.
const NEWER_KEYS: [&str; 2] = ["RestartSteps", "RestartMaxDelaySec"];

#[test]
fn the_unit_verifies() {
    let Ok(version) = Command::new("systemd-analyze").arg("--version").output() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI installs systemd-analyze (.ci/run)"
        );
        eprintln!("SKIPPED: no systemd-analyze on this machine (Debian package systemd)");
        return;
    };
    assert!(version.status.success());
    let unit = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../systemd/residentd.service");
    let text = std::fs::read_to_string(&unit).expect("the unit");
    for key in [
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "RestartPreventExitStatus=78",
        "KillMode=mixed",
        "Delegate=yes",
        "OOMPolicy=continue",
        "OOMScoreAdjust=-900",
    ] {
        assert!(text.contains(key), "the unit sets {key}");
    }
    // verify checks that ExecStart exists: point it at the built binary.
    let dir = tempfile::tempdir().expect("tempdir");
    let copy = dir.path().join("residentd.service");
    std::fs::write(&copy, text.replace("/usr/bin/residentd", RESIDENTD)).expect("write");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .expect("run verify");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed:\n{err}"
    );
    let unexpected: Vec<&str> = err
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| {
            !NEWER_KEYS.iter().any(|k| {
                l.contains(&format!("Unknown key '{k}'"))
                    || l.contains(&format!("Unknown key name '{k}'"))
            })
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "systemd-analyze verify warned:\n{}",
        unexpected.join("\n")
    );
}

#[tokio::test]
async fn children_do_not_inherit_the_agents_oom_protection() {
    let config = String::from("[[pool]]\nname = \"ram\"\nbudget = \"1GB\"\n\n")
        + &sleeper("a", "ram", 1, "");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("residentd.toml"),
        config_text(dir.path(), &config),
    )
    .expect("config");
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
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../systemd/residentd.toml");
    let text = std::fs::read_to_string(&path).expect("the packaged config");
    let unit = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../systemd/residentd.service");
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
        resident_config::Listen::Unix("/run/residentd/residentd.sock".into())
    );
}
