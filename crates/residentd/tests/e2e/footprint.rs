//! What the books reserve against what the servers hold: an instance
//! measured above its reservation (an overrun) is told (message, OVERRUN
//! event, metric), counted in the books at what it holds (so a start that
//! fits only by its declaration is refused, naming what it holds), and
//! stopped under `on_overrun = "stop"`; what a workload was measured to
//! hold is learned, journaled, reserved at its next start, kept across a
//! restart, and starts afresh for another command or when forgotten; a
//! model file replaced under a running instance leaves its reservation.

use crate::metrics::scrape;
use crate::support::*;
use resident_api::pb;
use tokio_stream::StreamExt as _;

const MB: u64 = 1_000_000;

/// A Python server that declares `declared` MB of pool `pool` and holds
/// about 120 MB (a touched buffer) beside its interpreter.
pub fn fat(name: &str, pool: &str, declared: u64, extra: &str) -> String {
    format!(
        r#"[[workload]]
name = "{name}"
command = ["python3", "-c", "import time; b = b'x' * (120 * 1000 * 1000); print('held', flush=True); time.sleep(3600)"]
stop_grace = "2s"
{extra}
[workload.memory.{pool}]
weights = "{declared}MB"
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overrun_is_told_counted_and_refuses_what_fits_only_by_the_declaration() {
    let port = free_port();
    let config = format!(
        "metrics_listen = \"127.0.0.1:{port}\"\n[[pool]]\nname = \"ram\"\nbudget = \"400MB\"\nhost = true\n\n{}{}",
        fat("fat", "ram", 20, ""),
        "[[workload]]\nname = \"small\"\ncommand = [\"/bin/sleep\", \"3600\"]\nstop_grace = \"2s\"\n[workload.memory.ram]\nweights = \"300MB\"\n",
    );
    let mut d = Daemon::start(&config).await;
    let mut events = d.watch(0).await;
    d.started("fat", "f").await;
    // The sampler reads the buffer; the books count it from that reading.
    // A sample taken while Python is still filling the buffer already
    // overruns the 20 MB declared, so wait for the whole buffer.
    let over = until(async || {
        let i = d.get("f").await;
        (i.overrun_bytes > 50 * MB && i.reserved_bytes >= 120 * MB).then_some(i)
    })
    .await
    .expect("the overrun is seen and the books hold what it holds");
    assert!(
        over.message.contains("OVERRUN: measured"),
        "{}",
        over.message
    );
    assert!(
        over.message.contains("above its reservation of 20.0 MB"),
        "{}",
        over.message
    );
    assert_eq!(over.cause, pb::Cause::Overrun as i32, "the typed word");
    assert_eq!(
        over.demand[0].reserved_bytes,
        20 * MB,
        "the reservation stays"
    );
    assert_eq!(over.demand[0].overrun_bytes, over.overrun_bytes);
    let event = loop {
        let e = tokio::time::timeout(PATIENCE, events.next())
            .await
            .expect("an OVERRUN event in time")
            .expect("the stream goes on")
            .expect("an event");
        if e.kind == pb::EventKind::Overrun as i32 {
            break e;
        }
    };
    assert_eq!(event.pool, "ram");
    assert!(
        event.message.starts_with("OVERRUN: measured"),
        "{}",
        event.message
    );
    let pool = &d.node().await.pools[0];
    assert!(
        pool.used_bytes >= 120 * MB,
        "used counts the measured bytes: {pool:?}"
    );

    // 300 MB fits beside the declared 20, not beside the 120 held.
    let refused = d.client.start(start_req("small", "s")).await;
    let status = refused.expect_err("refused: the memory is not there");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let (_, placement) = refusal_details(&status);
    let Some(pb::refusal::Reason::OverBudget(why)) = placement.refusals[0].reason.clone() else {
        panic!("not a budget refusal: {placement:?}");
    };
    assert_eq!(why.holders.len(), 1);
    assert!(
        why.holders[0].bytes >= 120 * MB,
        "the holder shows what it holds: {why:?}"
    );

    let text = scrape(port);
    let line = text
        .lines()
        .find(|l| l.starts_with("residentd_overrun_bytes{"))
        .unwrap_or_else(|| panic!("no overrun metric in\n{text}"));
    assert!(
        line.contains("instance=\"f\"") && line.contains("pool=\"ram\""),
        "{line}"
    );
    let bytes: f64 = line
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("a value");
    assert!(bytes > 50e6, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_overrun_stop_stops_the_instance_with_reason_overrun() {
    let config = format!(
        "[[pool]]\nname = \"ram\"\nbudget = \"400MB\"\nhost = true\n\n{}",
        fat("fat", "ram", 20, "on_overrun = \"stop\""),
    );
    let mut d = Daemon::start(&config).await;
    d.started("fat", "f").await;
    let ended = d.wait_state("f", pb::State::Exited).await;
    assert!(
        ended.message.contains("OVERRUN: measured"),
        "{}",
        ended.message
    );
    assert!(
        ended.message.contains("on_overrun = \"stop\""),
        "{}",
        ended.message
    );
    assert_eq!(ended.cause, pb::Cause::Overrun as i32);
    assert_eq!(d.used().await, 0, "its memory is released");
}

/// The roster entry of `workload`.
async fn roster_entry(d: &mut Daemon, workload: &str) -> pb::Workload {
    let roster = d.client.workloads(pb::WorkloadsRequest {}).await;
    let roster = roster.expect("the roster").into_inner().workloads;
    roster
        .into_iter()
        .find(|w| w.name == workload)
        .expect("in the roster")
}

/// The learned line the journal on disk holds for `workload`, if any.
fn learned_line(d: &Daemon, workload: &str) -> Option<residentd::journal::Learned> {
    let journal = residentd::journal::Journal::open(&d.dir.path().join("state"));
    let learned = journal.expect("the state directory").peek().learned;
    learned.into_iter().find(|l| l.workload == workload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_footprint_is_learned_journaled_kept_across_a_restart_and_reset_by_another_command() {
    let config = |extra_arg: &str| {
        let fat = fat("fat", "ram", 20, "").replace(
            "time.sleep(3600)\"]",
            &format!("time.sleep(3600)\"{extra_arg}]"),
        );
        format!("[[pool]]\nname = \"ram\"\nbudget = \"400MB\"\nhost = true\n\n{fat}")
    };
    let mut d = Daemon::start(&config("")).await;
    assert_eq!(roster_entry(&mut d, "fat").await.learned_bytes, 0);
    d.started("fat", "f").await;
    // Learned from the sampler's readings: the roster says so once the
    // journal has been told.
    let learned = until(async || {
        let w = roster_entry(&mut d, "fat").await;
        (w.learned_bytes >= 120 * MB && learned_line(&d, "fat").is_some()).then_some(w)
    })
    .await
    .expect("the footprint is learned and journaled");
    assert_eq!(learned.demand[0].learned_bytes, learned.learned_bytes);
    assert_eq!(
        learned.demand[0].reserved_bytes, learned.learned_bytes,
        "the next start reserves what was learned"
    );
    let line = learned_line(&d, "fat").expect("journaled");
    assert!(line.pools["ram"] >= 120 * MB, "{line:?}");
    // The run that taught it keeps what it was admitted with; the next
    // one reserves at least the learned bytes.
    assert_eq!(d.get("f").await.demand[0].reserved_bytes, 20 * MB);
    let stopped = d.stopped("f").await;
    assert_eq!(stopped.cause, pb::Cause::Stopped as i32, "a Stop says so");
    let next = d.started("fat", "g").await;
    assert!(
        next.demand[0].reserved_bytes >= 120 * MB && next.demand[0].learned_bytes >= 120 * MB,
        "{:?}",
        next.demand
    );
    d.stopped("g").await;

    // Kept across a restart of the agent.
    d.terminate().await;
    let mut d = d.restart().await;
    let after = roster_entry(&mut d, "fat").await;
    assert!(after.learned_bytes >= 120 * MB, "{after:?}");

    // Another command line: what was learned no longer applies.
    std::fs::write(
        d.dir.path().join("residentd.toml"),
        config_text(d.dir.path(), &config(", \"v2\"")),
    )
    .expect("the new config");
    d.client
        .reload(pb::ReloadRequest {})
        .await
        .expect("reloaded");
    assert_eq!(roster_entry(&mut d, "fat").await.learned_bytes, 0);
    let fresh = d.started("fat", "h").await;
    assert_eq!(fresh.demand[0].reserved_bytes, 20 * MB, "as declared");
    // It learns afresh, for the new command, and an operator can forget it.
    let relearned = until(async || {
        let l = learned_line(&d, "fat")?;
        (l.key != line.key && l.pools["ram"] >= 120 * MB).then_some(l)
    })
    .await
    .expect("learned again for the new command");
    d.stopped("h").await;
    let forgot = d
        .client
        .forget_footprint(pb::ForgetFootprintRequest {
            workload: "fat".into(),
        })
        .await
        .expect("forgotten")
        .into_inner();
    assert_eq!(forgot.learned_bytes, 0);
    assert_eq!(forgot.demand[0].reserved_bytes, 20 * MB);
    assert!(
        learned_line(&d, "fat").is_none(),
        "the journal no longer holds {relearned:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_file_replaced_under_a_running_instance_leaves_its_reservation() {
    let Some(python) = crate::llama::python() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("m.gguf");
    crate::llama::make_model(&python, &model, 64, 2);
    let config = format!(
        "[[pool]]\nname = \"ram\"\nbudget = \"4GB\"\n\n[[workload]]\nname = \"m\"\ncommand = [\"/bin/sleep\", \"3600\"]\nstop_grace = \"2s\"\n[workload.memory.ram]\nfrom_gguf = \"{}\"\nctx = 512\n",
        model.display()
    );
    write_config(dir.path(), &config);
    let mut d = Daemon::start_in(dir).await;
    let before = d.started("m", "a").await.demand[0].reserved_bytes;
    // A larger model in its place, read by a reload.
    crate::llama::make_model(&python, &model, 256, 4);
    d.client
        .reload(pb::ReloadRequest {})
        .await
        .expect("reloaded");
    assert_eq!(
        d.get("a").await.demand[0].reserved_bytes,
        before,
        "the running instance keeps what it was admitted with"
    );
    let next = d.started("m", "b").await.demand[0].reserved_bytes;
    assert!(
        next > before + 5 * MB,
        "the next start reserves the new file: {before} then {next}"
    );
}
