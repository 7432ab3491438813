//! The agent's own end and its next start: what SIGTERM and kill -9 of
//! the agent leave behind, what the journal brings back, and the laptop
//! example the agent starts with when given no config.

use std::time::Duration;

use resident_api::pb;
use tokio_stream::StreamExt as _;

use crate::support::*;

fn ram() -> String {
    pool("ram", "10GB")
}

#[tokio::test]
async fn sigterm_stops_every_child_and_exits_zero() {
    let mut config = ram();
    config += &sleeper("a", "ram", 1, "");
    config += &shell(
        "stubborn",
        "trap '' TERM; while true; do sleep 0.05; done",
        "policy = \"never\"",
    );
    let mut d = Daemon::start(&config).await;
    let a = d.started("a", "a").await;
    let s = d.started("stubborn", "s").await;
    let pids = [a.pid as i32, s.pid as i32];
    let status = d.terminate().await;
    assert!(status.success(), "residentd exited with {status:?}");
    for pid in pids {
        assert!(!alive(pid), "child {pid} outlived the agent");
        assert!(
            resident_supervisor::procfs::group_members(pid).is_empty(),
            "group {pid} left members"
        );
    }
    assert!(!d.socket.exists(), "the socket is removed");
    // What ran at shutdown comes back with the next start.
    let mut d = d.restart().await;
    let ids = d.ids().await;
    assert_eq!(ids, ["a", "s"]);
}

#[tokio::test]
async fn after_kill_9_the_next_start_clears_leftovers_and_restores_the_journal() {
    // Instances that die with the agent (takeover.rs has those that
    // outlive it).
    let mut config = "instances_outlive_agent = false\n".to_string() + &ram();
    // The shell forks a helper into its group; only the shell gets the
    // parent-death signal, so the helper is a leftover to clear.
    config += &shell(
        "forker",
        "sleep 3600 & echo helper=$!; wait",
        "policy = \"never\"",
    );
    config += &sleeper("a", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    d.started("a", "first").await;
    let f = d.started("forker", "second").await;
    let pgid = f.pid as i32;
    let logs = pb::LogsRequest {
        instance_id: "second".into(),
        tail: 1,
        follow: true,
    };
    let line = d
        .client
        .logs(logs)
        .await
        .expect("logs")
        .into_inner()
        .next()
        .await
        .expect("a line")
        .expect("ok");
    let helper: i32 = line
        .line
        .strip_prefix("helper=")
        .and_then(|p| p.parse().ok())
        .expect(&line.line);
    // Let the journal catch up with the spawn (it is written in the
    // background), then crash the agent.
    let journaled = eventually(async || {
        d.journaled()
            .iter()
            .any(|e| e.instance == "second" && e.pgid == pgid)
    })
    .await;
    assert!(journaled, "the journal records the running group");
    d.kill();
    assert!(
        alive(helper),
        "the helper survives its agent (this is what restore must clean)"
    );
    let mut d = d.restart().await;
    assert!(
        !alive(helper),
        "the leftover of the previous run was killed"
    );
    let ids = d.ids().await;
    assert_eq!(
        ids,
        ["first", "second"],
        "both journaled instances are back"
    );
    // Reserved at once (PENDING), running soon after.
    assert_eq!(d.used().await, 5_000_000_000, "each reserved once");
    for id in ["first", "second"] {
        let i = d.wait_state(id, pb::State::Ready).await;
        assert!(i.pid != 0 && i.pid as i32 != pgid, "{i:?}");
    }
    assert_eq!(d.used().await, 5_000_000_000, "each reserved once");
}

#[tokio::test]
async fn kill_9_of_the_agent_leaves_no_child_behind() {
    // Unless they are to outlive it (takeover.rs).
    let mut config = "instances_outlive_agent = false\n".to_string() + &ram();
    config += &sleeper("a", "ram", 1, "");
    config += &sleeper("b", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    let a = d.started("a", "a").await;
    let b = d.started("b", "b").await;
    let pids = [a.pid as i32, b.pid as i32];
    d.kill();
    let killed = tokio::time::Instant::now();
    let gone = eventually(async || pids.iter().all(|p| !alive(*p))).await;
    assert!(
        gone && killed.elapsed() < Duration::from_secs(1),
        "children outlived a kill -9 of the agent by more than a second"
    );
}

#[tokio::test]
async fn the_laptop_example_runs_as_shipped_and_embedded() {
    let example = workspace().join("examples/laptop.toml");
    let out = std::process::Command::new(RESIDENTD)
        .arg("--check-config")
        .arg(&example)
        .output()
        .expect("run residentd --check-config");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("valid (1 pools, 3 workloads)"), "{said}");
    // With no --config the same file runs, its socket under the runtime
    // directory.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut d = embedded(dir).await;
    let node = d.node().await;
    assert_eq!(node.node, "laptop");
    let pools: Vec<&str> = node.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(pools, ["ram"]);
    assert!(d.dir.path().join("residentd/state").is_dir(), "{}", d.log());
    // What its demo servers write reaches `logs` (Python's output is not
    // held back in a buffer).
    d.started("demo-a", "a").await;
    let said = until(async || {
        let req = pb::LogsRequest {
            instance_id: "a".into(),
            tail: 100,
            follow: false,
        };
        let mut lines = d.client.logs(req).await.ok()?.into_inner();
        let mut all = Vec::new();
        while let Ok(Some(l)) = lines.message().await {
            all.push(l.line);
        }
        all.iter()
            .any(|l| l.starts_with("Serving HTTP on 127.0.0.1"))
            .then_some(all)
    })
    .await;
    assert!(said.is_some(), "demo-a's first line reaches its log");
    assert!(d.terminate().await.success(), "{}", d.log());

    // A second run starts afresh: the README's tour starts demo-a as `a`
    // again, which a restored `a` would refuse (it did, before).
    let mut d = again(d).await;
    assert_eq!(d.ids().await, Vec::<String>::new(), "{}", d.log());
    let a = d.ready("demo-a", "a").await;
    assert_eq!(a.state, pb::State::Ready as i32, "{a:?}");
    // After a kill -9 its server runs on (instances outlive the agent);
    // the next run stops it and starts afresh all the same.
    d.kill();
    assert!(alive(a.pid as i32), "it outlives the agent");
    let mut d = again(d).await;
    assert_eq!(d.ids().await, Vec::<String>::new(), "{}", d.log());
    assert!(
        eventually(async || !alive(a.pid as i32)).await,
        "the last run's server is stopped"
    );
    assert!(
        d.log().contains("the embedded example starts afresh"),
        "{}",
        d.log()
    );
    d.ready("demo-a", "a").await;
    assert!(d.terminate().await.success(), "{}", d.log());
}

/// The agent on its embedded example (no `--config`), with `dir` as its
/// `XDG_RUNTIME_DIR`, its log in `dir/residentd.log`.
pub(crate) async fn embedded(dir: tempfile::TempDir) -> Daemon {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.path().join("residentd.log"))
        .expect("log");
    let child = std::process::Command::new(RESIDENTD)
        .env("XDG_RUNTIME_DIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start residentd");
    let socket = dir.path().join("residentd/residentd.sock");
    let client = connect(&socket).await;
    Daemon {
        dir,
        socket,
        child: Some(child),
        client,
    }
}

/// The embedded example run again on `d`'s runtime directory, once `d`
/// has ended (killed if it still runs).
async fn again(mut d: Daemon) -> Daemon {
    if let Some(mut child) = d.child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let dir = std::mem::replace(&mut d.dir, tempfile::tempdir().expect("tempdir"));
    drop(d);
    embedded(dir).await
}

#[tokio::test]
async fn an_answered_start_or_stop_survives_kill_9_of_the_agent_right_after() {
    let mut config = ram();
    config += &sleeper("sleeper", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    for round in 0..50 {
        let id = format!("r{round}");
        d.started("sleeper", &id).await;
        // kill -9 as soon as the answer is in (restart drops the old
        // agent with SIGKILL), then a new agent on the same state.
        d = d.restart().await;
        // Back in the books as soon as the agent answers (PENDING while
        // its process is spawned again), then running.
        let restored = d.get(&id).await;
        let live = [
            pb::State::Pending as i32,
            pb::State::Starting as i32,
            pb::State::Ready as i32,
        ];
        assert!(
            live.contains(&restored.state),
            "round {round}: the answered start is back: {restored:?}"
        );
        d.wait_state(&id, pb::State::Ready).await;
        d.stopped(&id).await;
        d = d.restart().await;
        assert!(
            !d.ids().await.contains(&id),
            "round {round}: the answered stop stays done"
        );
    }
}

#[tokio::test]
async fn a_damaged_journal_restores_what_it_can_and_is_kept_aside() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_config(dir.path(), &(ram() + &sleeper("nap", "ram", 1, "")));
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).expect("state dir");
    // A readable line between a header of a newer format, binary garbage,
    // a line cut short, and one of a workload the roster no longer has.
    let mut damaged = b"# residentd journal 99\n".to_vec();
    damaged.extend_from_slice(b"keep\tnap\t0\t0\t0\n\x00\x9f\xff\xfe\n");
    damaged.extend_from_slice(b"cut\tna");
    damaged.extend_from_slice(b"\ngone\tretired\t0\t0\t0\n");
    std::fs::write(state.join("instances.journal"), &damaged).expect("journal");
    let mut d = Daemon::start_in(dir).await;
    let kept = d.wait_state("keep", pb::State::Ready).await;
    assert_eq!(kept.workload, "nap");
    assert_eq!(
        d.ids().await,
        ["keep"],
        "only what could be read and placed"
    );
    let log = d.log();
    assert!(
        log.contains("the journal was damaged: restoring what could be read"),
        "{log}"
    );
    assert!(log.contains("newer residentd (format 99"), "{log}");
    assert!(
        log.contains("line=3") && log.contains("line=4"),
        "each skipped line: {log}"
    );
    let aside: Vec<_> = std::fs::read_dir(&state)
        .expect("state")
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("instances.journal.damaged-")
        })
        .collect();
    assert_eq!(aside.len(), 1, "kept aside once");
    assert_eq!(
        std::fs::read(aside[0].path()).expect("read"),
        damaged,
        "as found"
    );
    // The journal is whole again (written in the background).
    let journal = || {
        let bytes = std::fs::read(state.join("instances.journal")).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let whole =
        eventually(async || journal().starts_with("# residentd journal 7\nkeep\tnap\t")).await;
    assert!(whole, "{}", journal());
}

#[tokio::test]
async fn a_journal_that_cannot_be_written_refuses_starts_until_it_can() {
    let port = free_port();
    let config = format!(
        "metrics_listen = \"127.0.0.1:{port}\"\n{}{}",
        ram(),
        sleeper("nap", "ram", 1, "")
    );
    let mut d = Daemon::start(&config).await;
    let a = d.started("nap", "a").await;
    let writable = || {
        crate::metrics::scrape(port).lines().find_map(|l| {
            l.strip_prefix("residentd_journal_writable ")
                .map(str::to_string)
        })
    };
    assert_eq!(writable().as_deref(), Some("1"), "the metric before");
    // The journal's next write fails, as on a full or read-only state_dir:
    // the journal is taken away (so the next write must be whole) and a
    // directory stands where that write's file must go, which fails even
    // for root.
    let state = d.dir.path().join("state");
    let blocker = state.join("instances.journal.tmp");
    // (A write in flight has its file there for a moment.)
    let blocked = until(async || std::fs::create_dir(&blocker).ok()).await;
    assert!(blocked.is_some(), "block the journal");
    std::fs::remove_file(state.join("instances.journal")).expect("take the journal away");
    for id in ["b", "c"] {
        let e = d
            .client
            .start(start_req("nap", id))
            .await
            .expect_err("the journal cannot be written");
        assert_eq!(e.code(), tonic::Code::Unavailable, "{id}: {e:?}");
        assert!(e.message().contains("journal"), "{}", e.message());
    }
    // Nothing ran for them, and what ran goes on.
    let list = d.list().await;
    let running: Vec<&str> = list
        .iter()
        .filter(|i| i.state == pb::State::Ready as i32)
        .map(|i| i.instance_id.as_str())
        .collect();
    assert_eq!(running, ["a"]);
    assert!(
        list.iter().all(|i| i.instance_id == "a" || i.pid == 0),
        "{list:?}"
    );
    assert!(alive(a.pid as i32));
    assert_eq!(
        d.log().matches("cannot write the journal").count(),
        1,
        "said once"
    );
    // Said to monitoring too (prometheus/residentd-rules.yml alerts on it).
    assert_eq!(writable().as_deref(), Some("0"), "the metric while failing");
    // Space is back: starts resume by themselves.
    std::fs::remove_dir(&blocker).expect("unblock");
    let started = until(async || d.client.start(start_req("nap", "d")).await.ok()).await;
    assert!(
        started.is_some(),
        "starts resume once the journal can be written"
    );
    assert!(d.log().contains("the journal is written again"));
    assert_eq!(writable().as_deref(), Some("1"), "the metric after");
    let ids: Vec<String> = d.journaled().into_iter().map(|e| e.instance).collect();
    assert_eq!(ids, ["a", "d"]);
}

/// A tmpfs of `size` mounted at `dir` for the life of the guard; `None`
/// (said by the caller) where this machine does not let the test mount.
struct Mounted(std::path::PathBuf);

impl Mounted {
    fn tmpfs(dir: &std::path::Path, size: &str) -> Option<Self> {
        std::fs::create_dir_all(dir).ok()?;
        let ok = std::process::Command::new("mount")
            // Mode 0700: a state directory others can write is refused.
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self(dir.to_path_buf()))
    }

    fn remount(&self, options: &str) {
        let status = std::process::Command::new("mount")
            .args(["-o", &format!("remount,{options}")])
            .arg(&self.0)
            .status()
            .expect("mount");
        assert!(status.success(), "remount {options}");
    }
}

impl Drop for Mounted {
    /// Unmounts, then removes the mount point and its directory where
    /// they are left empty: a test's TempDir dropped while the tmpfs was
    /// still mounted could not remove them.
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
        if std::fs::remove_dir(&self.0).is_ok()
            && let Some(parent) = self.0.parent()
        {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

#[tokio::test]
async fn a_full_or_read_only_state_dir_refuses_starts_and_running_ones_go_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(state) = Mounted::tmpfs(&dir.path().join("state"), "256k") else {
        return skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)");
    };
    write_config(dir.path(), &(ram() + &sleeper("nap", "ram", 1, "")));
    let mut d = Daemon::start_in(dir).await;
    let a = d.started("nap", "a").await;
    // The journal's second write for a (its process group) comes after the
    // answer; wait for it, so the disk fills before the next write of b.
    let written = eventually(async || {
        journaled_in(&state.0)
            .iter()
            .any(|e| e.instance == "a" && e.pgid == a.pid as i32)
    });
    assert!(written.await, "a's process group is journaled");
    // Full: ENOSPC on the next write that needs space. An append that
    // fits in the journal's last page needs none; a journal written whole
    // (the first write after start, after a failure, or every thousand-odd
    // lines) does: the journal is taken away, so the next write is whole.
    std::fs::remove_file(state.0.join("instances.journal")).expect("take the journal away");
    let filler = state.0.join("filler");
    let _ = std::fs::write(&filler, vec![0u8; 512 * 1024]);
    let e = d
        .client
        .start(start_req("nap", "b"))
        .await
        .expect_err("no space for the journal");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert!(
        e.message().contains("No space left on device"),
        "{}",
        e.message()
    );
    assert!(alive(a.pid as i32), "what runs goes on");
    std::fs::remove_file(&filler).expect("space back");
    let started = until(async || d.client.start(start_req("nap", "c")).await.ok()).await;
    let c = started.and_then(|r| r.into_inner().instance);
    let c = c.expect("starts resume when space is back");
    // Once c's process group is journaled (a write after the answer, which
    // would keep the remount below from going through while under way).
    let written = eventually(async || {
        journaled_in(&state.0)
            .iter()
            .any(|e| e.instance == "c" && e.pgid == c.pid as i32)
    });
    assert!(written.await, "c's process group is journaled");
    // Read-only: the same.
    state.remount("ro");
    let refused = until(async || match d.client.start(start_req("nap", "e")).await {
        Err(e) if e.code() == tonic::Code::Unavailable => Some(e),
        _ => None,
    })
    .await
    .expect("refused on a read-only state_dir");
    assert!(
        refused.message().contains("Read-only file system"),
        "{}",
        refused.message()
    );
    state.remount("rw");
    let started = until(async || d.client.start(start_req("nap", "f")).await.ok()).await;
    assert!(started.is_some(), "starts resume when it is writable again");
    let ids: Vec<String> = d.ids().await;
    assert_eq!(
        ids,
        ["a", "b", "c", "e", "f"].map(String::from),
        "b and e never ran"
    );
    let list = d.list().await;
    for i in list
        .iter()
        .filter(|i| i.instance_id == "b" || i.instance_id == "e")
    {
        assert_eq!(i.state, pb::State::Exited as i32, "{i:?}");
        assert_eq!(i.pid, 0);
    }
    // Nothing acknowledged was lost: the journal lists a, c and f.
    let journaled: Vec<String> = journaled_in(&state.0)
        .into_iter()
        .map(|e| e.instance)
        .collect();
    assert_eq!(journaled, ["a", "c", "f"]);
    d.terminate().await;
    // Unmounted before the Daemon's TempDir is removed.
    drop(state);
}

#[tokio::test]
async fn a_config_file_gone_at_sighup_keeps_the_running_config() {
    let mut d = Daemon::start(&(ram() + &sleeper("nap", "ram", 1, ""))).await;
    d.started("nap", "a").await;
    std::fs::remove_file(d.dir.path().join("residentd.toml")).expect("remove the config");
    d.signal(nix::sys::signal::Signal::SIGHUP);
    let reported = eventually(async || d.log().contains("configuration reload refused")).await;
    assert!(reported, "the failed reload is reported");
    assert!(d.log().contains("cannot read"), "{}", d.log());
    // The running config stays: the roster still serves starts.
    d.started("nap", "b").await;
    assert_eq!(d.ids().await, ["a", "b"]);
}

#[tokio::test]
async fn a_second_agent_on_a_running_node_stops_before_touching_anything() {
    let mut d = Daemon::start(&(ram() + &sleeper("nap", "ram", 1, ""))).await;
    let a = d.started("nap", "a").await;
    let journal = d.dir.path().join("state/instances.journal");
    // Once the journal also records the process group (written after the
    // answer).
    let recorded = eventually(async || {
        d.journaled()
            .iter()
            .any(|e| e.instance == "a" && e.pgid == a.pid as i32)
    })
    .await;
    assert!(recorded);
    let before = std::fs::read(&journal).expect("journal");
    let out = std::process::Command::new(RESIDENTD)
        .arg("--config")
        .arg(d.dir.path().join("residentd.toml"))
        .output()
        .expect("run a second agent");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is in use by a running agent"), "{err}");
    // The running agent's instance and journal are as they were.
    assert!(alive(a.pid as i32), "the second agent killed nothing");
    assert_eq!(d.get("a").await.pid, a.pid);
    assert_eq!(std::fs::read(&journal).expect("journal"), before);
}
