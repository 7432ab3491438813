//! The package installed for real with apt-get as root: what the
//! maintainer scripts make, the packaged agent as the packaged user with
//! the installed config starting a model through the packaged residentctl,
//! and a purge that leaves nothing; purged after, failure or not.

use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use super::{CONFFILE, on_path, package, run};
use crate::support::*;

/// The state directory (the unit's StateDirectory, made by postinst too).
const STATE: &str = "/var/lib/residentd";
/// The unit's RuntimeDirectory, which holds the packaged config's socket
/// (and residentctl's default).
const RUNTIME: &str = "/run/residentd";
/// What an agent built without NVML says of an `nvml:` pool.
const NO_NVML: &str = "built without the nvml feature";

/// apt-get, told not to ask and to wait for a dpkg lock another apt holds.
fn apt_get(args: &[&str]) -> Output {
    Command::new("apt-get")
        .args(["-y", "-q", "-o", "DPkg::Lock::Timeout=120"])
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .expect("run apt-get")
}

/// The system user the package makes, if it exists.
fn packaged_user() -> Option<nix::unistd::User> {
    nix::unistd::User::from_name("residentd").ok().flatten()
}

/// The models' user the package makes, if it exists.
fn model_user() -> Option<nix::unistd::User> {
    nix::unistd::User::from_name("residentd-model")
        .ok()
        .flatten()
}

/// The package installed on this machine, purged when dropped (a failing
/// test included), with what the test made beside it: the agent it started,
/// the model's pid, the runtime directory, and the system user when the
/// package made it (Debian keeps system users at purge; a test leaves the
/// machine as it found it).
struct Installed {
    agent: Option<Child>,
    model: Option<i32>,
    made_user: bool,
    purged: bool,
}

impl Drop for Installed {
    fn drop(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            let _ = agent.kill();
            let _ = agent.wait();
        }
        if let Some(pid) = self.model.take() {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        if !self.purged {
            let out = apt_get(&["purge", "residentd"]);
            if !out.status.success() {
                eprintln!(
                    "apt-get purge residentd: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        let _ = std::fs::remove_dir_all(RUNTIME);
        if self.made_user {
            for name in ["residentd", "residentd-model"] {
                let _ = Command::new("userdel").arg(name).status();
                let _ = Command::new("groupdel")
                    .arg(name)
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

/// The packaged residentctl, as an operator runs it: no socket named, so
/// its default, which the packaged config listens on.
fn residentctl(args: &[&str]) -> Output {
    Command::new("/usr/bin/residentctl")
        .env_remove("RESIDENTD_SOCKET")
        .args(args)
        .output()
        .expect("run the packaged residentctl")
}

/// The uid a live process runs as (the real one, from `/proc/PID/status`).
fn uid_of(pid: i64) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .expect("a uid")
}

/// Checks what the maintainer scripts made: the system user and group,
/// the state directory, the conffile; and that running postinst again
/// changes nothing.
fn check_installed(made_user: bool) -> nix::unistd::User {
    let status =
        run(Command::new("dpkg-query").args(["-W", "-f=${Status} ${Conffiles}", "residentd"]));
    assert!(
        status.starts_with("install ok installed") && status.contains(CONFFILE),
        "{status}"
    );
    let user = packaged_user().expect("postinst made the user residentd");
    if made_user {
        assert!(user.uid.as_raw() < 1000, "a system user: {user:?}");
    }
    assert_eq!(user.shell, Path::new("/usr/sbin/nologin"));
    assert_eq!(user.dir, Path::new(STATE));
    let group = nix::unistd::Group::from_gid(user.gid)
        .ok()
        .flatten()
        .expect("its group");
    assert_eq!(group.name, "residentd");
    let state = std::fs::metadata(STATE).expect("postinst made the state directory");
    assert!(
        state.is_dir() && state.uid() == user.uid.as_raw(),
        "{state:?}"
    );
    assert_eq!(state.mode() & 0o777, 0o700, "the agent's alone");
    // The models' own user: a system user of its own group, not in the
    // agent's (which owns the socket).
    let model = model_user().expect("postinst made the user residentd-model");
    assert_ne!(model.uid, user.uid);
    assert_eq!(model.shell, Path::new("/usr/sbin/nologin"));
    let members = nix::unistd::Group::from_gid(user.gid)
        .ok()
        .flatten()
        .map(|g| g.mem)
        .unwrap_or_default();
    assert!(
        model.gid != user.gid && !members.contains(&model.name),
        "residentd-model reaches the agent's socket: {members:?}"
    );
    let version = run(Command::new("dpkg-query").args(["-W", "-f=${Version}", "residentd"]));
    run(Command::new("/var/lib/dpkg/info/residentd.postinst").args(["configure", &version]));
    let again = packaged_user().expect("still there");
    assert_eq!(
        (again.uid, again.gid),
        (user.uid, user.gid),
        "postinst twice"
    );
    user
}

/// A config with a GPU pool read through NVML, which an agent built
/// without the feature warns about.
const GPU_CONFIG: &str = r#"[node]
name = "n"
listen = "unix:///nonexistent/agent.sock"
state_dir = "/nonexistent"
[[pool]]
name = "gpu0"
budget = "24GB"
device = "nvml:0"
"#;

/// The operator's edit of the conffile: a model any machine can run.
const DEMO: &str = r#"
[[workload]]
name = "demo"
command = ["/bin/sleep", "3600"]
stop_grace = "2s"
[workload.memory.ram]
weights = "64MB"
"#;

/// Why the install test cannot run here, if it cannot: it needs root, apt,
/// and a machine where residentd is not installed already.
fn cannot_install() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("installing a package needs root".into());
    }
    if !on_path("apt-get") {
        return Some("no apt-get: not a Debian machine".into());
    }
    let queried = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", "residentd"])
        .output();
    let known = queried.is_ok_and(|o| o.status.success() && !o.stdout.starts_with(b"unknown"));
    let there = ["/usr/bin/residentd", "/etc/residentd", STATE, RUNTIME]
        .into_iter()
        .find(|p| Path::new(p).exists());
    (known || there.is_some()).then(|| {
        format!(
            "residentd is installed here already ({}): the test would replace it",
            there.unwrap_or("dpkg knows the package")
        )
    })
}

/// The installed agent run as the unit runs it: as `user`, with only its
/// primary group, and the unit's ambient capabilities (CAP_SETUID,
/// CAP_SETGID, CAP_KILL: to run and signal models as residentd-model).
fn as_unit(user: &nix::unistd::User) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={}", user.uid))
        .arg(format!("--regid={}", user.gid))
        .args([
            "--clear-groups",
            "--inh-caps",
            "+setuid,+setgid,+kill",
            "--ambient-caps",
            "+setuid,+setgid,+kill",
            "/usr/bin/residentd",
        ]);
    cmd
}

/// The installed config loads as shipped (so `systemctl enable --now`
/// starts the agent), and the installed agent is the NVML build.
fn check_shipped_agent(user: &nix::unistd::User, dir: &Path) {
    run(as_unit(user).arg("--check-config").arg(CONFFILE));
    let gpu = dir.join("gpu.toml");
    std::fs::write(&gpu, GPU_CONFIG).expect("write");
    let out = Command::new("/usr/bin/residentd")
        .arg("--check-config")
        .arg(&gpu)
        .output()
        .expect("run");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !said.contains(NO_NVML), "{said}");
}

/// The packaged agent, started as the unit starts it: as `user`, with the
/// installed config, in the runtime directory systemd would make; its
/// output in `log`. Returns once it serves on residentctl's default socket.
async fn start_agent(installed: &mut Installed, user: &nix::unistd::User, log: &Path) {
    run(Command::new("install")
        .args(["-d", "-m", "0750", "-o", "residentd", "-g", "residentd"])
        .arg(RUNTIME));
    let file = std::fs::File::create(log).expect("log");
    let mut cmd = as_unit(user);
    cmd.args(["--config", CONFFILE])
        .env_remove("RESIDENTD_SOCKET")
        .stdout(file.try_clone().expect("dup"))
        .stderr(file);
    let agent = cmd.spawn().expect("start the packaged agent");
    let pid = agent.id();
    installed.agent = Some(agent);
    assert!(
        eventually(async || residentctl(&["node"]).status.success()).await,
        "the agent never served on its default socket:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    assert_eq!(
        uid_of(pid.into()),
        user.uid.as_raw(),
        "the agent is unprivileged"
    );
}

/// Starts `demo` through the packaged residentctl, sees it READY as the
/// models' user, and stops it.
async fn start_and_stop_a_model(installed: &mut Installed, log: &Path) {
    let out = residentctl(&["start", "demo", "--id", "d", "--wait"]);
    assert!(
        out.status.success(),
        "residentctl start: {out:?}\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    let ls = residentctl(&["--json", "ls"]);
    let list: serde_json::Value = serde_json::from_slice(&ls.stdout).expect("ls --json");
    let d = list
        .as_array()
        .and_then(|l| l.iter().find(|i| i["instance_id"] == "d"))
        .unwrap_or_else(|| panic!("d listed: {list}"));
    assert_eq!(d["state"], "READY", "{list}");
    let pid = d["pid"]
        .as_i64()
        .and_then(|p| i32::try_from(p).ok())
        .expect("a pid");
    installed.model = Some(pid);
    let model = model_user().expect("residentd-model");
    assert_eq!(
        uid_of(pid.into()),
        model.uid.as_raw(),
        "the model runs as the models' own user"
    );
    let out = residentctl(&["stop", "d"]);
    assert!(out.status.success(), "residentctl stop: {out:?}");
    assert!(eventually(async || !alive(pid)).await, "the model stopped");
    installed.model = None;
}

/// SIGTERM to the agent: it drains and exits 0.
async fn stop_agent(installed: &mut Installed, log: &Path) {
    let mut agent = installed.agent.take().expect("the agent");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(agent.id()).expect("a pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let exited = until(async || agent.try_wait().expect("wait")).await;
    assert!(
        exited.is_some_and(|s| s.success()),
        "the agent drains and exits 0: {exited:?}\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

#[tokio::test]
async fn the_installed_package_starts_a_model_as_its_user_and_purges_clean() {
    if let Some(why) = cannot_install() {
        // CI runs as root on a fresh Debian machine: there only a residentd
        // installed already may skip this.
        let root = nix::unistd::geteuid().is_root();
        assert!(std::env::var_os("CI").is_none() || root, "{why}");
        return skip(&why);
    }
    let Some(deb) = package() else { return };
    let mut installed = Installed {
        agent: None,
        model: None,
        made_user: packaged_user().is_none(),
        purged: false,
    };
    let out = apt_get(&["install", "--no-install-recommends", &deb.to_string_lossy()]);
    assert!(
        out.status.success(),
        "apt-get install: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let user = check_installed(installed.made_user);
    let dir = tempfile::tempdir().expect("tempdir");
    check_shipped_agent(&user, dir.path());

    let shipped = std::fs::read_to_string(CONFFILE).expect("the conffile");
    std::fs::write(CONFFILE, shipped + DEMO).expect("edit the conffile");
    let log = dir.path().join("agent.log");
    start_agent(&mut installed, &user, &log).await;
    start_and_stop_a_model(&mut installed, &log).await;
    stop_agent(&mut installed, &log).await;

    let out = apt_get(&["purge", "residentd"]);
    assert!(
        out.status.success(),
        "apt-get purge: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    installed.purged = true;
    let left = [
        "/usr/bin/residentd",
        "/etc/residentd",
        STATE,
        "/lib/systemd/system/residentd.service",
    ];
    for path in left {
        assert!(!Path::new(path).exists(), "{path} is left after the purge");
    }
}
