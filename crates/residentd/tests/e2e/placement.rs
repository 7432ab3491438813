//! The agent over gRPC: the reference scenario, exclusions, idempotent
//! starts, eviction, concurrency and bad input, against the real binary.

use crate::support::*;
use resident_api::pb;
use tokio_stream::StreamExt as _;
use tonic::Code;

fn reference_config() -> String {
    let mut c = pool("unified", "96GB");
    c += &sleeper("coder-daily", "unified", 55, "");
    c += &sleeper("coder-small", "unified", 9, "");
    c += &sleeper("planner", "unified", 55, "excludes = [\"role:swarm\"]");
    c += &sleeper("swarm", "unified", 1, "");
    c += &sleeper("reviewer", "unified", 1, "excludes = [\"coder-small\"]");
    c
}

#[tokio::test]
async fn the_reference_ledger_scenario_over_grpc() {
    let mut d = Daemon::start(&reference_config()).await;
    let c = &mut d.client;
    // Instances named after their workloads, as the brief's text has them.
    let a = c
        .start(start_req("coder-daily", "coder-daily"))
        .await
        .expect("55 GB fits")
        .into_inner();
    assert!(a.created);
    c.start(start_req("coder-small", "coder-small"))
        .await
        .expect("9 GB fits");
    let refused = c
        .start(start_req("planner", "c"))
        .await
        .expect_err("55 GB more does not fit");
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(
        refused.message(),
        "unplaceable: 'planner' needs 55.0 GB but only 32.0 GB of the 96.0 GB 'unified' pool is free (held by coder-daily 55.0 GB, coder-small 9.0 GB)"
    );
    let (info, placement) = refusal_details(&refused);
    assert_eq!(
        (info.reason.as_str(), info.domain.as_str()),
        ("OVER_BUDGET", "resident.v1")
    );
    assert_eq!(info.metadata["need_bytes"], "55000000000");
    assert_eq!(info.metadata["free_bytes"], "32000000000");
    assert!(!placement.admitted);
    let Some(pb::refusal::Reason::OverBudget(over)) = &placement.refusals[0].reason else {
        panic!("an over-budget reason: {placement:?}");
    };
    let holders: Vec<(&str, u64)> = over
        .holders
        .iter()
        .map(|h| (h.instance_id.as_str(), h.bytes))
        .collect();
    assert_eq!(
        holders,
        [
            ("coder-daily", 55_000_000_000),
            ("coder-small", 9_000_000_000)
        ]
    );
    // The refusal changed nothing.
    let node = c.node(pb::NodeRequest {}).await.expect("node").into_inner();
    assert_eq!(node.pools[0].used_bytes, 64_000_000_000);
    assert_eq!(node.instances.len(), 2);
    // Stopping the first lets the planner in, on the very next call.
    let stopped = c
        .stop(pb::StopRequest {
            instance_id: "coder-daily".into(),
            grace_ms: 0,
        })
        .await
        .expect("stop");
    let stopped = stopped.into_inner().instance.expect("an instance");
    assert_eq!(stopped.state, pb::State::Exited as i32);
    assert!(!alive(a.instance.expect("instance").pid as i32));
    c.start(start_req("planner", "c"))
        .await
        .expect("now it fits");
    // Two instances of one role are told apart: each by its id, its role
    // beside it.
    c.start(start_req("coder-small", "small-2"))
        .await
        .expect("9 GB more fits");
    let refused = c
        .start(start_req("coder-daily", "big"))
        .await
        .expect_err("55 GB more does not fit");
    assert!(
        refused.message().ends_with(
            "(held by c (planner) 55.0 GB, coder-small 9.0 GB, small-2 (coder-small) 9.0 GB)"
        ),
        "{}",
        refused.message()
    );
}

#[tokio::test]
async fn exclusions_hold_both_ways_and_starts_are_idempotent() {
    let mut d = Daemon::start(&reference_config()).await;
    let c = &mut d.client;
    c.start(start_req("planner", "p")).await.expect("fits");
    let e = c
        .start(start_req("swarm", "s"))
        .await
        .expect_err("planner excludes swarm");
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert_eq!(
        e.message(),
        "unplaceable: 'swarm' cannot be resident beside 'planner' ('planner' excludes it)"
    );
    assert_eq!(refusal_details(&e).0.reason, "EXCLUDED");
    c.start(start_req("coder-small", "cs")).await.expect("fits");
    let e = c
        .start(start_req("reviewer", "r"))
        .await
        .expect_err("reviewer excludes coder-small");
    assert_eq!(
        e.message(),
        "unplaceable: 'reviewer' cannot be resident beside 'coder-small' ('reviewer' excludes it)"
    );
    // Idempotent: the same id and workload again is the same instance.
    let again = c
        .start(start_req("planner", "p"))
        .await
        .expect("idempotent")
        .into_inner();
    assert!(!again.created);
    let node = c.node(pb::NodeRequest {}).await.expect("node").into_inner();
    assert_eq!(node.pools[0].used_bytes, 64_000_000_000, "counted once");
    // The same id with another workload is not.
    let e = c
        .start(start_req("coder-daily", "p"))
        .await
        .expect_err("id taken");
    assert_eq!(e.code(), Code::AlreadyExists);
}

#[tokio::test]
async fn evict_stops_the_least_recently_used_first_or_nothing() {
    let mut d = Daemon::start(&reference_config()).await;
    let c = &mut d.client;
    let a = c
        .start(start_req("coder-daily", "a"))
        .await
        .expect("fits")
        .into_inner();
    c.start(start_req("coder-small", "b")).await.expect("fits");
    let a_pid = a.instance.expect("instance").pid as i32;
    // b is used after a: a is the least recently used.
    c.touch(pb::TouchRequest {
        instance_id: "b".into(),
        hold_ms: 0,
        ..Default::default()
    })
    .await
    .expect("touch");
    // A target that cannot fit even after every eviction: nothing stops.
    let mut huge = start_req("planner", "x");
    huge.on_full = pb::Policy::Evict as i32;
    // planner is 55 GB; with a 55 GB resident held, it cannot fit.
    c.touch(pb::TouchRequest {
        instance_id: "a".into(),
        hold_ms: 60_000,
        ..Default::default()
    })
    .await
    .expect("hold");
    let e = c
        .start(huge.clone())
        .await
        .expect_err("a is held: no room even with eviction");
    assert_eq!(e.code(), Code::ResourceExhausted);
    // Only the hold stands in the way: the refusal says waiting may help.
    let (info, placement) = refusal_details(&e);
    assert_eq!(
        info.metadata.get("temporary").map(String::as_str),
        Some("true")
    );
    assert!(
        placement.refusals.iter().all(|r| r.temporary),
        "{placement:?}"
    );
    // Under refuse, holds do not matter: not temporary.
    let e = c
        .start(start_req("planner", "y"))
        .await
        .expect_err("refused under refuse");
    let (info, placement) = refusal_details(&e);
    assert_eq!(info.metadata.get("temporary"), None);
    assert!(placement.refusals.iter().all(|r| !r.temporary));
    assert!(
        alive(a_pid),
        "nothing was stopped for a start that could not fit"
    );
    let list = c.list(pb::ListRequest {}).await.expect("list").into_inner();
    assert!(
        list.instances
            .iter()
            .all(|i| i.state == pb::State::Ready as i32)
    );
    // Ending the hold lets the same start evict at once. The release is a
    // use of a, so b is the least recently used, but a alone makes the
    // room: only as many as it takes go, and b stays.
    c.touch(pb::TouchRequest {
        instance_id: "a".into(),
        hold_ms: 60_000,
        release_hold: true,
    })
    .await
    .expect("release the hold");
    let plan = c
        .place(pb::PlaceRequest {
            workload: "planner".into(),
            on_full: pb::Policy::Evict as i32,
            ..Default::default()
        })
        .await
        .expect("place")
        .into_inner();
    assert!(plan.admitted && plan.evict == ["a"], "{plan:?}");
    // What the victim holds, and what the start would leave: 96 GB less
    // b's 9 and the planner's 55 once a is gone.
    let victims: Vec<(&str, u64)> = plan
        .victims
        .iter()
        .map(|v| (v.instance_id.as_str(), v.bytes))
        .collect();
    assert_eq!(victims, [("a", 55_000_000_000)]);
    assert_eq!(plan.free_after_bytes, Some(32_000_000_000));
    // Under no hold, a (55 GB) must go; b stays.
    let mut d2 = Daemon::start(&reference_config()).await;
    let c2 = &mut d2.client;
    let a = c2
        .start(start_req("coder-daily", "a"))
        .await
        .expect("fits")
        .into_inner();
    c2.start(start_req("coder-small", "b")).await.expect("fits");
    let a_pid = a.instance.expect("instance").pid as i32;
    let mut events = d2.watch(0).await;
    let c2 = &mut d2.client;
    let started = c2
        .start(huge)
        .await
        .expect("fits after evicting a")
        .into_inner();
    assert_eq!(started.evicted, ["a"]);
    assert!(!alive(a_pid), "the victim was stopped before the answer");
    let a_now = c2
        .get(pb::GetRequest {
            instance_id: "a".into(),
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(a_now.state, pb::State::Exited as i32);
    // Its message, and the EXITED event watchers saw, say it was evicted,
    // for which start and in which pool; a manual stop does not.
    let want =
        "evicted to make room for 'planner' (instance 'x') in pool 'unified' (killed by SIGTERM";
    assert!(a_now.message.starts_with(want), "{}", a_now.message);
    assert_eq!(a_now.cause, pb::Cause::Evicted as i32);
    let exited = loop {
        let e = tokio::time::timeout(PATIENCE, events.next())
            .await
            .expect("the snapshot in time")
            .expect("an event")
            .expect("not an error");
        let Some(i) = e.instance.filter(|i| i.instance_id == "a") else {
            continue;
        };
        if e.kind == pb::EventKind::Transition as i32 && i.state == pb::State::Exited as i32 {
            break i;
        }
    };
    assert!(exited.message.starts_with(want), "{}", exited.message);
    let c2 = &mut d2.client;
    let node = c2
        .node(pb::NodeRequest {})
        .await
        .expect("node")
        .into_inner();
    assert_eq!(node.pools[0].used_bytes, 64_000_000_000);
    let b_stopped = d2.stopped("b").await;
    assert!(
        b_stopped.message.starts_with("stopped ("),
        "{}",
        b_stopped.message
    );
}

#[tokio::test]
async fn concurrent_starts_never_over_commit() {
    let mut config = pool("unified", "10GB");
    config += &sleeper("one", "unified", 1, "");
    let d = Daemon::start(&config).await;
    let starts = (0..64).map(|i| {
        let mut c = d.client.clone();
        tokio::spawn(async move { c.start(start_req("one", &format!("i{i}"))).await })
    });
    let mut admitted = 0;
    for s in starts.collect::<Vec<_>>() {
        match s.await.expect("joined") {
            Ok(_) => admitted += 1,
            Err(e) => assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}"),
        }
    }
    assert_eq!(admitted, 10, "exactly K = 10 of 1 GB fit in 10 GB");
    let mut c = d.client.clone();
    let node = c.node(pb::NodeRequest {}).await.expect("node").into_inner();
    assert_eq!(node.pools[0].used_bytes, 10_000_000_000);
    let running = node.instances.iter().filter(|i| i.pid != 0).count();
    assert_eq!(running, 10);
}

#[tokio::test]
async fn bad_input_is_invalid_argument_with_field_violations_and_changes_nothing() {
    use tonic_types::StatusExt as _;
    let mut d = Daemon::start(&reference_config()).await;
    let c = &mut d.client;
    let cases = [
        (start_req("", "ok"), "workload"),
        (start_req("planner", "bad id"), "instance_id"),
        (start_req("planner", &"x".repeat(129)), "instance_id"),
        (
            pb::StartRequest {
                on_full: 9,
                ..start_req("planner", "ok")
            },
            "on_full",
        ),
    ];
    for (req, field) in cases {
        let e = c.start(req).await.expect_err("invalid");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        let details = e.get_error_details();
        let bad = details.bad_request().expect("BadRequest details");
        assert_eq!(bad.field_violations[0].field, field);
    }
    let e = c
        .start(start_req("nope", "x"))
        .await
        .expect_err("unknown workload");
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .get(pb::GetRequest {
            instance_id: "ghost".into(),
        })
        .await
        .expect_err("unknown instance");
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .stop(pb::StopRequest {
            instance_id: "".into(),
            grace_ms: 0,
        })
        .await
        .expect_err("empty id");
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .place(pb::PlaceRequest {
            workload: "".into(),
            on_full: 0,
            ..Default::default()
        })
        .await
        .expect_err("empty workload");
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .place(pb::PlaceRequest {
            workload: "planner".into(),
            on_full: -1,
            ..Default::default()
        })
        .await
        .expect_err("bad policy");
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .touch(pb::TouchRequest {
            instance_id: "".into(),
            hold_ms: 5,
            ..Default::default()
        })
        .await
        .expect_err("empty id");
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .get(pb::GetRequest {
            instance_id: "a/b".into(),
        })
        .await
        .expect_err("bad id");
    assert_eq!(e.code(), Code::InvalidArgument);
    let logs = pb::LogsRequest {
        instance_id: "x\n".into(),
        tail: 1,
        follow: false,
    };
    let e = c.logs(logs).await.expect_err("bad id");
    assert_eq!(e.code(), Code::InvalidArgument);
    let logs = pb::LogsRequest {
        instance_id: "ghost".into(),
        tail: 1_000_000,
        follow: false,
    };
    let e = c.logs(logs).await.expect_err("tail too long");
    assert_eq!(e.code(), Code::InvalidArgument);
    let logs = pb::LogsRequest {
        instance_id: "ghost".into(),
        tail: 1,
        follow: false,
    };
    let e = c.logs(logs).await.expect_err("unknown instance");
    assert_eq!(e.code(), Code::NotFound);
    let list = c.list(pb::ListRequest {}).await.expect("list").into_inner();
    assert!(list.instances.is_empty(), "nothing changed");
    let node = c.node(pb::NodeRequest {}).await.expect("node").into_inner();
    assert_eq!(node.pools[0].used_bytes, 0);
}

#[tokio::test]
async fn place_is_the_same_plan_without_side_effects() {
    let mut d = Daemon::start(&reference_config()).await;
    let c = &mut d.client;
    c.start(start_req("coder-daily", "a")).await.expect("fits");
    c.start(start_req("coder-small", "b")).await.expect("fits");
    let refuse = c
        .place(pb::PlaceRequest {
            workload: "planner".into(),
            on_full: 0,
            ..Default::default()
        })
        .await
        .expect("place");
    let refuse = refuse.into_inner();
    assert!(!refuse.admitted);
    assert!(
        refuse.refusals[0]
            .message
            .contains("'planner' needs 55.0 GB")
    );
    let evict = pb::PlaceRequest {
        workload: "planner".into(),
        on_full: pb::Policy::Evict as i32,
        ..Default::default()
    };
    let evict = c.place(evict).await.expect("place").into_inner();
    assert!(evict.admitted);
    assert_eq!(evict.evict, ["a"]);
    assert_eq!(evict.pools[0].used_bytes, 64_000_000_000);
    let list = c.list(pb::ListRequest {}).await.expect("list").into_inner();
    assert!(
        list.instances
            .iter()
            .all(|i| i.state == pb::State::Ready as i32),
        "nothing was stopped"
    );
    let ids: Vec<&str> = list
        .instances
        .iter()
        .map(|i| i.instance_id.as_str())
        .collect();
    assert_eq!(ids, ["a", "b"], "nothing was started");
    let node = c.node(pb::NodeRequest {}).await.expect("node").into_inner();
    assert_eq!(node.pools, evict.pools, "nothing was reserved");

    // The Starts the two Places described. Under refuse: refused, its
    // placement the Place's, reason for reason.
    let e = c
        .start(start_req("planner", "p"))
        .await
        .expect_err("refused, as placed");
    let (_, refused) = refusal_details(&e);
    assert!(!refused.admitted);
    assert_eq!(refused.refusals, refuse.refusals, "the Place's reasons");
    assert_eq!(refused.pools, refuse.pools);
    // Under evict: admitted, evicting what the Place named, holding what it
    // said, leaving what it said free.
    let mut req = start_req("planner", "p");
    req.on_full = pb::Policy::Evict as i32;
    let started = c.start(req).await.expect("admitted, as placed");
    let started = started.into_inner();
    assert!(started.created);
    assert_eq!(started.evicted, evict.evict, "the Place's victims");
    assert_eq!(started.slept, evict.sleep);
    let instance = started.instance.expect("an instance");
    assert_eq!(instance.demand, evict.demand, "the Place's demand");
    let a = d.wait_state("a", pb::State::Exited).await;
    assert!(a.message.contains("evict"), "{}", a.message);
    let node = d.node().await;
    let free = node.pools[0].free_bytes;
    assert_eq!(free, evict.free_after_bytes, "what the Place said is left");
    assert_eq!(node.pools[0].used_bytes, 64_000_000_000);
    assert_eq!(d.get("b").await.state, pb::State::Ready as i32);
}

#[tokio::test]
async fn the_roster_is_served_and_a_start_may_name_an_alias() {
    let mut config = pool("ram", "10GB");
    config += &sleeper(
        "chat-7b",
        "ram",
        2,
        "aliases = [\"chat\", \"gpt-4o-mini\"]\nconcurrency_limit = 4",
    );
    config += &sleeper("embed", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    let roster = d
        .client
        .workloads(pb::WorkloadsRequest {})
        .await
        .expect("workloads")
        .into_inner()
        .workloads;
    let names: Vec<&str> = roster.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["chat-7b", "embed"]);
    assert_eq!(roster[0].aliases, ["chat", "gpt-4o-mini"]);
    assert_eq!(roster[0].concurrency_limit, 4);
    assert_eq!(roster[0].demand[0].weights_bytes, 2_000_000_000);
    assert_eq!(roster[1].concurrency_limit, 0, "no limit");
    let started = d.started("gpt-4o-mini", "c1").await;
    assert_eq!(started.workload, "chat-7b", "an alias starts its workload");
    let placed = d
        .client
        .place(pb::PlaceRequest {
            workload: "chat".into(),
            on_full: 0,
            ..Default::default()
        })
        .await
        .expect("place by alias")
        .into_inner();
    assert!(placed.admitted);
}

/// Place naming an instance id is the dry run of that Start: admitted at
/// once for an instance already resident (a new instance of the same
/// workload would not fit), refused like the Start for an id another
/// workload holds or one that is no id, and a new instance's answer for
/// an id nobody holds. Nothing changes.
#[tokio::test]
async fn place_naming_an_instance_is_that_starts_dry_run() {
    let config = pool("ram", "4GB") + &sleeper("a", "ram", 3, "") + &sleeper("b", "ram", 3, "");
    let mut d = Daemon::start(&config).await;
    d.started("a", "a1").await;
    let place = |workload: &str, id: &str| pb::PlaceRequest {
        workload: workload.into(),
        instance_id: id.into(),
        ..Default::default()
    };
    let c = &mut d.client;
    let same = c
        .place(place("a", "a1"))
        .await
        .expect("placed")
        .into_inner();
    assert!(same.admitted && same.evict.is_empty(), "{same:?}");
    let new = c.place(place("a", "")).await.expect("placed").into_inner();
    assert!(!new.admitted, "a second 3 GB does not fit: {new:?}");
    let b1 = c
        .place(place("b", "b1"))
        .await
        .expect("placed")
        .into_inner();
    assert_eq!(
        (b1.admitted, b1.refusals.len()),
        (new.admitted, new.refusals.len()),
        "an id nobody holds: a new instance's answer"
    );
    let taken = c.place(place("b", "a1")).await.expect_err("a1 is a's");
    assert_eq!(taken.code(), Code::AlreadyExists, "{taken:?}");
    let bad = c.place(place("a", "no such id!")).await.expect_err("no id");
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("instance_id"), "{}", bad.message());
    assert_eq!(d.ids().await, vec!["a1".to_string()], "nothing changed");
}
