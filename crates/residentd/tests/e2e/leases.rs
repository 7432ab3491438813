//! Owners' leases: an instance started with a lease runs while its owner
//! renews it (any Touch) and is stopped and released with LEASE_EXPIRED
//! once the owner stops renewing; the lease survives a restart of the
//! agent through the journal.

use std::time::{Duration, Instant};

use crate::support::*;
use resident_api::pb;
use tokio_stream::StreamExt as _;

const LEASE_MS: u64 = 1_500;

#[tokio::test]
async fn a_renewed_lease_keeps_its_instance_and_a_lapsed_one_stops_it() {
    let mut config = pool("ram", "10GB");
    config += &sleeper("sleeper", "ram", 2, "");
    let mut d = Daemon::start(&config).await;
    let mut events = d.watch(0).await;
    let began = Instant::now();
    for id in ["kept", "lapsed"] {
        let r = d.client.start(leased("sleeper", id, LEASE_MS)).await;
        let i = r
            .expect("admitted")
            .into_inner()
            .instance
            .expect("instance");
        assert_eq!(i.lease_ms, LEASE_MS);
        assert!(i.lease_left_ms <= LEASE_MS && i.lease_left_ms > 0, "{i:?}");
    }
    // The owner of "kept" renews it (a Touch every 300 ms, well inside the
    // lease); nobody renews "lapsed".
    let mut c = d.client.clone();
    let lapsed = until(async || {
        c.touch(pb::TouchRequest {
            instance_id: "kept".into(),
            hold_ms: 0,
            ..Default::default()
        })
        .await
        .expect("touch renews");
        let i = c
            .get(pb::GetRequest {
                instance_id: "lapsed".into(),
            })
            .await
            .expect("get")
            .into_inner();
        if i.state == pb::State::Exited as i32 {
            return Some(i);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        None
    })
    .await
    .expect("the lapsed lease stops its instance");
    assert!(
        began.elapsed() >= Duration::from_millis(LEASE_MS),
        "not before the lease ran out"
    );
    assert!(
        lapsed.message.starts_with("LEASE_EXPIRED"),
        "{}",
        lapsed.message
    );
    assert_eq!(
        lapsed.cause,
        pb::Cause::LeaseExpired as i32,
        "the typed word too"
    );
    let kept = d.get("kept").await;
    assert_eq!(kept.state, pb::State::Ready as i32, "renewed: {kept:?}");
    assert_eq!(
        d.used().await,
        2_000_000_000,
        "the lapsed one's memory is back"
    );
    // Its EXITED event says why, too.
    let exited = until(async || {
        let e = events.next().await?.ok()?;
        let i = e.instance?;
        (i.instance_id == "lapsed" && i.state == pb::State::Exited as i32).then_some(i)
    })
    .await
    .expect("an EXITED event");
    assert!(
        exited.message.starts_with("LEASE_EXPIRED"),
        "{}",
        exited.message
    );
}

#[tokio::test]
async fn a_lease_survives_a_restart_of_the_agent() {
    let mut config = pool("ram", "10GB");
    config += &sleeper("sleeper", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    d.client
        .start(leased("sleeper", "owned", 600_000))
        .await
        .expect("admitted");
    // kill -9 right after the answer, then a new agent on the same state.
    let mut d = d.restart().await;
    let back = d.get("owned").await;
    assert_eq!(back.lease_ms, 600_000, "{back:?}");
    assert!(back.lease_left_ms > 0, "{back:?}");
    let too_long = d
        .client
        .start(leased("sleeper", "greedy", 8 * 24 * 3600 * 1000))
        .await
        .expect_err("a lease over a week is refused");
    assert_eq!(too_long.code(), tonic::Code::InvalidArgument);
}
