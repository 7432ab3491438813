//! Saved conversations (`keep_kv`) with the real llama-server: slots saved
//! when the agent stops the server and restored at its next start, so a
//! returning conversation finds its prompt computed (`timings.prompt_n`
//! small, `cache_n` the prefix); a disk pool's budget evicts the oldest
//! state; a failed save or restore leaves the stop and the start working;
//! a state saved before the arguments changed is dropped.

use std::io::{Read as _, Write as _};
use std::path::Path;
use std::time::Duration;

use resident_api::pb;

use crate::llama::{llama_server_bin, make_model, python};
use crate::support::*;

/// A prompt of `words` words of the test model's vocabulary (about 2.3
/// tokens each).
fn prompt(words: usize, seed: usize) -> String {
    let vocab = "the a of and to in is it you that he was for on are with as his they be at one have this from";
    let list: Vec<&str> = vocab.split(' ').collect();
    (0..words)
        .map(|i| list[(i * 7 + seed * 3) % list.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// A completion of `prompt` on `port`: its `timings` (`prompt_n`, the
/// tokens computed; `cache_n`, taken from the cache).
fn completion(port: u32, prompt: &str) -> (u64, u64) {
    let body = format!(r#"{{"prompt": "{prompt}", "n_predict": 2, "cache_prompt": true}}"#);
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port as u16)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300)))
        .expect("timeout");
    write!(
        s,
        "POST /completion HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    let json = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {answer}"));
    let t = &v["timings"];
    (
        t["prompt_n"].as_u64().expect("prompt_n"),
        t["cache_n"].as_u64().unwrap_or(0),
    )
}

/// A llama-server workload `name` on `model`, keeping its conversations
/// in disk pool `kv` when `keep`.
fn workload(name: &str, server: &Path, model: &Path, keep: bool) -> String {
    let keep = if keep { "keep_kv = \"kv\"\n" } else { "" };
    format!(
        "[[workload]]\nname = \"{name}\"\nflavor = \"llama-server\"\nprogram = \"{}\"\nmodel = \"{}\"\nctx = 2048\nparallel = 1\n{keep}",
        server.display(),
        model.display()
    )
}

/// The agent's metrics on `port` and pools `ram` and the disk pool `kv`
/// (`budget`) under `dir`.
fn pools(dir: &Path, budget: &str, port: u16) -> String {
    format!(
        "metrics_listen = \"127.0.0.1:{port}\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"4GB\"\n\n[[pool]]\nname = \"kv\"\nbudget = \"{budget}\"\npath = \"{}\"\n\n",
        dir.join("kv").display()
    )
}

/// The agent's metrics page on `port`.
async fn metrics_page(port: u16) -> String {
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        write!(s, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").expect("send");
        let mut answer = String::new();
        s.read_to_string(&mut answer).expect("read");
        answer
    })
    .await
    .expect("joined")
}

/// The bytes of every file under `dir` (a disk pool: one directory per
/// workload).
fn bytes_under(dir: &Path) -> u64 {
    let files = std::fs::read_dir(dir).into_iter().flatten().flatten();
    files
        .flat_map(|w| std::fs::read_dir(w.path()).into_iter().flatten().flatten())
        .map(|f| f.metadata().map_or(0, |m| m.len()))
        .sum()
}

/// Starts (or wakes) `kept` and `plain` and sends each the conversation
/// `back` again: on `kept` (its one slot saved and restored) only the new
/// words are computed, on `plain` the whole prompt (its slot went `when`).
async fn comes_back(d: &mut Daemon, back: &str, mport: u16, when: &str) {
    let mut came_back = Vec::new();
    for id in ["kept", "plain"] {
        let i = d.ready(id, id).await;
        let back = back.to_string();
        let timings = tokio::task::spawn_blocking(move || completion(i.port, &back))
            .await
            .expect("joined");
        came_back.push(timings);
    }
    let (kept, plain) = (came_back[0], came_back[1]);
    assert!(
        kept.0 < 20 && kept.1 > 1000,
        "kept, {when}: only the new words computed (prompt_n {}, cache_n {})",
        kept.0,
        kept.1
    );
    assert!(
        plain.0 > 1000,
        "plain, {when}: the whole prompt again ({})",
        plain.0
    );
    let metrics = metrics_page(mport).await;
    assert!(
        metrics.contains("residentd_kv_states_total{event=\"saved\"} 1")
            && metrics.contains("residentd_kv_states_total{event=\"restored\"} 1"),
        "{metrics}"
    );
}

/// The llama-server binary, a directory for the agent and the test model
/// written in it; `None` (the helpers say why) without the venv's Python
/// or a built llama-server.
fn setup() -> Option<(std::path::PathBuf, tempfile::TempDir, std::path::PathBuf)> {
    let (python, bin) = (python()?, llama_server_bin()?);
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("small.gguf");
    make_model(&python, &model, 256, 4);
    Some((bin.join("llama-server"), dir, model))
}

/// The used bytes of pool `kv`.
async fn stored(d: &mut Daemon) -> u64 {
    let node = d.node().await;
    node.pools
        .iter()
        .find(|p| p.name == "kv")
        .map_or(0, |p| p.used_bytes)
}

async fn stop(d: &mut Daemon, id: &str) {
    d.client
        .stop(pb::StopRequest {
            instance_id: id.into(),
            grace_ms: 0,
        })
        .await
        .expect("stopped");
}

/// A conversation of about 1,150 tokens on `kept` (keep_kv) and on `plain`
/// (without): both stopped (one evicted by a Stop, as the router's
/// eviction is), both started again; the conversation comes back with a
/// few more words. On `kept` only the new words are computed; on `plain`
/// the whole prompt again. Then the arguments change (a reload): the state
/// saved under the old ones is dropped, never restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_comes_back_computed_after_its_server_was_stopped() {
    let Some((server, dir, model)) = setup() else {
        return;
    };
    let mport = free_port();
    let config = pools(dir.path(), "1GB", mport)
        + &workload("kept", &server, &model, true)
        + &workload("plain", &server, &model, false);
    write_config(dir.path(), &config);
    let kv = dir.path().join("kv");
    let mut d = Daemon::start_in(dir).await;
    let talk = prompt(500, 1);
    let back = format!("{talk} the a of");
    for id in ["kept", "plain"] {
        let i = d.ready(id, id).await;
        let (computed, _) = tokio::task::spawn_blocking({
            let talk = talk.clone();
            move || completion(i.port, &talk)
        })
        .await
        .expect("joined");
        assert!(
            computed > 1000,
            "{id}: the first turn computes its prompt: {computed}"
        );
        stop(&mut d, id).await;
    }
    assert!(
        stored(&mut d).await > 1_000_000,
        "the disk pool holds kept's state"
    );
    let files: Vec<_> = std::fs::read_dir(kv.join("kept"))
        .expect("kept's directory")
        .flatten()
        .collect();
    assert_eq!(files.len(), 1, "one slot saved");
    assert!(
        !kv.join("plain").exists()
            || std::fs::read_dir(kv.join("plain")).expect("dir").count() == 0,
        "nothing saved for plain"
    );
    comes_back(&mut d, &back, mport, "after its stop").await;

    // Other arguments (a context of its own): the state saved under the
    // old ones is dropped at the next start, never restored.
    stop(&mut d, "kept").await;
    let changed = config.replace(
        "name = \"kept\"\nflavor = \"llama-server\"",
        "name = \"kept\"\nargs = [\"--threads\", \"1\"]\nflavor = \"llama-server\"",
    );
    write_config(d.dir.path(), &changed);
    d.client
        .reload(pb::ReloadRequest {})
        .await
        .expect("reloaded");
    let i = d.ready("kept", "kept").await;
    let timings = tokio::task::spawn_blocking(move || completion(i.port, &back))
        .await
        .expect("joined");
    assert!(
        timings.0 > 1000,
        "a state of other arguments is not restored: {timings:?}"
    );
    let left: Vec<String> = std::fs::read_dir(kv.join("kept"))
        .expect("dir")
        .flatten()
        .map(|f| f.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "the stale state is dropped: {left:?}");
}

/// A llama-server that sleeps by itself (`[workload.sleep] idle`) loses
/// its slots as it sleeps: with `keep_kv` the agent has it save them a
/// third of the way into its idle time, and restores them as a Start
/// wakes it, before the request reaches it. `plain` (no keep_kv) sleeps
/// beside it and computes the whole conversation again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_saved_before_its_server_sleeps_is_restored_as_it_wakes() {
    let Some((server, dir, model)) = setup() else {
        return;
    };
    let mport = free_port();
    let sleeps = "[workload.sleep]\nidle = \"6s\"\n";
    let config = pools(dir.path(), "1GB", mport)
        + &workload("kept", &server, &model, true)
        + sleeps
        + &workload("plain", &server, &model, false)
        + sleeps;
    write_config(dir.path(), &config);
    let mut d = Daemon::start_in(dir).await;
    let talk = prompt(500, 1);
    let back = format!("{talk} the a of");
    for id in ["kept", "plain"] {
        let i = d.ready(id, id).await;
        let talk = talk.clone();
        let (computed, _) = tokio::task::spawn_blocking(move || completion(i.port, &talk))
            .await
            .expect("joined");
        assert!(
            computed > 1000,
            "{id}: the first turn computes its prompt: {computed}"
        );
    }
    for id in ["kept", "plain"] {
        d.asleep(id).await;
    }
    assert!(
        stored(&mut d).await > 1_000_000,
        "kept's state was saved before it slept"
    );
    let log = d.log();
    assert_eq!(
        log.matches("quiet ahead of its sleep").count(),
        1,
        "one save ahead of the sleep, kept's: {log}"
    );
    comes_back(&mut d, &back, mport, "after its sleep").await;
}

/// A disk pool with room for one saved state: the second save evicts the
/// first (least recently used); the pool never holds more than its budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_pool_evicts_the_oldest_saved_state_for_room() {
    let Some((server, dir, model)) = setup() else {
        return;
    };
    // About 2.4 MB per 1,150-token state: room for one, not two.
    let mport = free_port();
    let config = pools(dir.path(), "4MB", mport)
        + &workload("a", &server, &model, true)
        + &workload("b", &server, &model, true);
    write_config(dir.path(), &config);
    let kv = dir.path().join("kv");
    let mut d = Daemon::start_in(dir).await;
    for id in ["a", "b"] {
        let i = d.ready(id, id).await;
        let talk = prompt(500, 2);
        tokio::task::spawn_blocking(move || completion(i.port, &talk))
            .await
            .expect("joined");
        stop(&mut d, id).await;
        let used = stored(&mut d).await;
        assert!(
            used > 0 && used <= 4_000_000,
            "{id}: within the budget: {used}"
        );
        assert_eq!(used, bytes_under(&kv), "{id}: charged what its file holds");
    }
    let count = |w: &str| std::fs::read_dir(kv.join(w)).map_or(0, |d| d.count());
    assert_eq!((count("a"), count("b")), (0, 1), "a's older state went");
    let log = d.log();
    assert!(
        log.contains("saved states evicted") && !log.contains("larger than the room reserved"),
        "a went for b, and the room reserved before b wrote its state held it: {log}"
    );
    let metrics = metrics_page(mport).await;
    assert!(
        metrics.contains("residentd_kv_states_total{event=\"evicted\"} 1"),
        "{metrics}"
    );
}

/// A save that fails (the server cannot write its state: its directory
/// went away under it) and a restore that fails (a state file damaged)
/// leave the stop and the start working; each is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_save_or_restore_leaves_the_stop_and_the_start_working() {
    let Some((server, dir, model)) = setup() else {
        return;
    };
    let mport = free_port();
    write_config(
        dir.path(),
        &(pools(dir.path(), "1GB", mport) + &workload("m", &server, &model, true)),
    );
    let kv = dir.path().join("kv");
    let mut d = Daemon::start_in(dir).await;
    let i = d.ready("m", "m").await;
    let talk = prompt(300, 3);
    tokio::task::spawn_blocking(move || completion(i.port, &talk))
        .await
        .expect("joined");
    // The server cannot save: its directory went away.
    std::fs::remove_dir_all(kv.join("m")).expect("rm");
    stop(&mut d, "m").await;
    assert_eq!(d.get("m").await.state, pb::State::Exited as i32, "stopped");
    let page = metrics_page(mport).await;
    assert!(
        page.contains("residentd_kv_states_total{event=\"failed\"} 1"),
        "the failed save is counted: {page}"
    );
    // A state saved, then damaged: the restore fails, the start does not.
    let i = d.ready("m", "m").await;
    let talk = prompt(300, 3);
    tokio::task::spawn_blocking(move || completion(i.port, &talk))
        .await
        .expect("joined");
    stop(&mut d, "m").await;
    let mut damaged = 0;
    for f in std::fs::read_dir(kv.join("m")).expect("dir").flatten() {
        std::fs::write(f.path(), b"garbage").expect("damage");
        damaged += 1;
    }
    assert_eq!(damaged, 1, "a state was saved");
    let i = d.ready("m", "m").await;
    assert_eq!(i.state, pb::State::Ready as i32, "started: {i:?}");
    let page = metrics_page(mport).await;
    assert!(
        page.contains("residentd_kv_states_total{event=\"failed\"} 2"),
        "the failed restore is counted: {page}"
    );
}
