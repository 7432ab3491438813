//! What the books reserve against what the servers hold: an instance
//! measured above its reservation (an overrun) is told (message, OVERRUN
//! event, metric), counted in the books at what it holds (so a start that
//! fits only by its declaration is refused, naming what it holds), and
//! stopped under `on_overrun = "stop"`.

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
    let over = until(async || {
        let i = d.get("f").await;
        (i.overrun_bytes > 50 * MB).then_some(i)
    })
    .await
    .expect("the overrun is seen");
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
    assert_eq!(
        over.demand[0].reserved_bytes,
        20 * MB,
        "the reservation stays"
    );
    assert_eq!(over.demand[0].overrun_bytes, over.overrun_bytes);
    assert!(
        over.reserved_bytes >= 120 * MB,
        "the books hold what it holds: {}",
        over.reserved_bytes
    );
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
    assert_eq!(d.used().await, 0, "its memory is released");
}
