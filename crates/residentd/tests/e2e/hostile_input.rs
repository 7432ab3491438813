//! The fuzz targets' properties on the stable toolchain (proptest), so the
//! suite checks them on every run: the config parser, the unit parser,
//! request validation and the router's reading of a client's body, quotes
//! and upstream paths never panic and accept only what the contract
//! allows; and random messages against a live agent never break it, while
//! an INVALID_ARGUMENT changes nothing.

use std::path::Path;

use crate::support::*;
use proptest::prelude::*;
use resident_api::pb;
use residentd::validate;

const BRIEF: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../examples/brief.toml"
));

/// Strings that look like what the parsers meet: ids, units, TOML bits.
fn texty() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[a-zA-Z0-9._/ -]{0,140}",
        "[0-9]{0,25}(\\.[0-9]{0,5})?[ ]?(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB|XB|gb)?",
    ]
}

fn id_ok(id: &str) -> bool {
    (1..=validate::MAX_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_text_is_a_config_or_an_error_naming_the_file(text in any::<String>()) {
        if let Err(e) = resident_config::parse(Path::new("in.toml"), &text) {
            prop_assert!(e.to_string().starts_with("in.toml"), "{}", e);
        }
    }

    #[test]
    fn a_mangled_brief_is_a_config_or_an_error_naming_the_file(
        at in 0usize..BRIEF.len(),
        cut in 0usize..40,
        insert in texty(),
    ) {
        let at = (0..=at).rev().find(|i| BRIEF.is_char_boundary(*i)).unwrap_or(0);
        let end = (at + cut).min(BRIEF.len());
        let end = (end..=BRIEF.len()).find(|i| BRIEF.is_char_boundary(*i)).unwrap_or(BRIEF.len());
        let text = format!("{}{}{}", &BRIEF[..at], insert, &BRIEF[end..]);
        if let Err(e) = resident_config::parse(Path::new("in.toml"), &text) {
            prop_assert!(e.to_string().starts_with("in.toml"), "{}", e);
        }
    }

    #[test]
    fn the_router_reads_a_body_only_when_it_is_an_object_naming_a_model(
        body in prop_oneof![
            any::<Vec<u8>>(),
            "[ \\[{]{0,2}\"model\"[: ]{0,2}(\"[a-z\n]{0,5}\"|7|null|\\[\\])[,}\\]]{0,2}".prop_map(String::into_bytes),
        ],
    ) {
        if let Ok((model, _)) = residentd_router::request_model(&body) {
            prop_assert!(!model.is_empty());
            prop_assert_eq!(body.iter().find(|b| !b.is_ascii_whitespace()), Some(&b'{'));
        }
    }

    #[test]
    fn the_routers_quotes_and_upstream_paths_hold_whatever_a_client_sends(
        text in any::<String>(),
        path in "/[a-z%2eEfF./]{0,30}",
    ) {
        let quoted = residentd_router::error::excerpt(&text);
        prop_assert!(!quoted.chars().any(char::is_control), "{:?}", quoted);
        let paths = residentd_router::guard::UpstreamPaths::new(&["/".to_string()]).expect("/");
        if paths.allows(&http::Method::POST, &path) {
            let decoded = path.to_ascii_lowercase().replace("%2e", ".").replace("%2f", "/");
            prop_assert!(!decoded.split('/').any(|s| s == ".."), "{}", path);
        }
    }

    #[test]
    fn byte_quantities_parse_or_fail_and_round_trip(text in texty()) {
        if let Ok(bytes) = resident_core::parse_bytes(&text) {
            prop_assert_eq!(resident_core::parse_bytes(&bytes.to_string()), Ok(bytes));
        }
    }

    #[test]
    fn validation_accepts_only_the_contract(
        workload in texty(),
        id in texty(),
        on_full in any::<i32>(),
        tail in any::<u32>(),
        lease_ms in prop_oneof![Just(0u64), any::<u64>(), 0..=validate::MAX_LEASE_MS],
    ) {
        let start = pb::StartRequest {
            workload: workload.clone(),
            instance_id: id.clone(),
            on_full,
            wait_ready: false,
            lease_ms,
        };
        match validate::start(&start) {
            Ok((got, _)) => {
                prop_assert!(!workload.is_empty() && workload.len() <= validate::MAX_ID);
                prop_assert!(got.is_none_or(|g| id_ok(g.as_str())));
                prop_assert!((0..=2).contains(&on_full));
                prop_assert!(lease_ms <= validate::MAX_LEASE_MS);
            }
            Err(resident_api::ApiError::InvalidArgument(v)) => prop_assert!(!v.is_empty()),
            Err(e) => prop_assert!(false, "not an invalid argument: {e}"),
        }
        let logs = pb::LogsRequest { instance_id: id.clone(), tail, follow: false };
        if validate::logs(&logs).is_ok() {
            prop_assert!(id_ok(&id) && tail <= validate::MAX_TAIL);
        }
    }
}

/// One random request against the live agent.
#[derive(Debug, Clone)]
enum Call {
    Start(String, String, i32),
    Stop(String, u64),
    Place(String, String, i32),
    Touch(String, u64),
    Get(String),
}

fn call() -> impl Strategy<Value = Call> {
    // Mostly real names, so valid calls happen too.
    let workload = prop_oneof![Just("nap".to_string()), Just("big".to_string()), texty()];
    let id = prop_oneof![Just("n1".to_string()), Just(String::new()), texty()];
    let policy = prop_oneof![0..3i32, any::<i32>()];
    prop_oneof![
        (workload.clone(), id.clone(), policy.clone()).prop_map(|(w, i, p)| Call::Start(w, i, p)),
        (id.clone(), any::<u64>()).prop_map(|(i, g)| Call::Stop(i, g % 5000)),
        (workload.clone(), id.clone(), policy.clone()).prop_map(|(w, i, p)| Call::Place(w, i, p)),
        (id.clone(), any::<u64>()).prop_map(|(i, h)| Call::Touch(i, h)),
        id.prop_map(Call::Get),
    ]
}

/// What an invalid call must not change, and the countdowns kept apart.
struct Books {
    /// The instances (timers and sampled memory zeroed) and the pools.
    stable: (Vec<pb::Instance>, Vec<pb::PoolStatus>),
    /// Per instance: the hold and the lease left, in ms. They count down on
    /// their own between two reads, so they are compared with the time that
    /// passed, not for equality.
    timers: Vec<(String, u64, u64)>,
}

async fn books(c: &mut Client) -> Books {
    let list = c.list(pb::ListRequest {}).await.expect("list").into_inner();
    let node = c.node(pb::NodeRequest {}).await.expect("node").into_inner();
    let mut timers = Vec::new();
    // The transient fields of a live instance (sampled memory, and when it
    // was sampled) may move on their own; what an invalid call must not
    // change is the rest.
    let stable = list
        .instances
        .into_iter()
        .map(|mut i| {
            timers.push((i.instance_id.clone(), i.hold_left_ms, i.lease_left_ms));
            i.measured_bytes = 0;
            i.measured_unix_ms = 0;
            i.hold_left_ms = 0;
            i.lease_left_ms = 0;
            i
        })
        .collect();
    Books {
        stable: (stable, node.pools),
        timers,
    }
}

/// The countdowns after a call are those before it, less at most the time
/// that passed between the two reads (a hold set or lengthened shows).
fn timers_only_ran_down(before: &Books, after: &Books, elapsed_ms: u64) -> Result<(), String> {
    if before.timers.len() != after.timers.len() {
        return Err(format!("{:?} became {:?}", before.timers, after.timers));
    }
    for ((id, hold0, lease0), (id1, hold1, lease1)) in before.timers.iter().zip(&after.timers) {
        let ran_down = |t0: u64, t1: u64| t1 <= t0 && t0 - t1 <= elapsed_ms + 1;
        if id != id1 || !ran_down(*hold0, *hold1) || !ran_down(*lease0, *lease1) {
            return Err(format!(
                "{id}: hold {hold0} ms, lease {lease0} ms became {id1}: hold {hold1} ms, lease {lease1} ms in {elapsed_ms} ms"
            ));
        }
    }
    Ok(())
}

async fn send(c: &mut Client, call: Call) -> Result<(), tonic::Status> {
    match call {
        Call::Start(workload, instance_id, on_full) => c
            .start(pb::StartRequest {
                workload,
                instance_id,
                on_full,
                wait_ready: false,
                lease_ms: 0,
            })
            .await
            .map(drop),
        Call::Stop(instance_id, grace_ms) => c
            .stop(pb::StopRequest {
                instance_id,
                grace_ms,
            })
            .await
            .map(drop),
        Call::Place(workload, instance_id, on_full) => c
            .place(pb::PlaceRequest {
                workload,
                on_full,
                instance_id,
            })
            .await
            .map(drop),
        Call::Touch(instance_id, hold_ms) => c
            .touch(pb::TouchRequest {
                instance_id,
                hold_ms,
                ..Default::default()
            })
            .await
            .map(drop),
        Call::Get(instance_id) => c.get(pb::GetRequest { instance_id }).await.map(drop),
    }
}

#[test]
fn random_messages_never_break_the_agent_and_invalid_ones_change_nothing() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let roster =
        pool("ram", "10GB") + &sleeper("nap", "ram", 1, "") + &sleeper("big", "ram", 20, "");
    let mut d = rt.block_on(Daemon::start(&roster));
    let invalid = std::cell::Cell::new(0usize);
    let client = d.client.clone();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(300));
    let result = runner.run(&call(), |call| {
        let mut c = client.clone();
        rt.block_on(async {
            let clock = std::time::Instant::now();
            let before = books(&mut c).await;
            match send(&mut c, call.clone()).await {
                Err(s) if s.code() == tonic::Code::InvalidArgument => {
                    invalid.set(invalid.get() + 1);
                    let after = books(&mut c).await;
                    let elapsed_ms = clock.elapsed().as_millis() as u64;
                    prop_assert_eq!(
                        &before.stable,
                        &after.stable,
                        "{:?} changed the books",
                        call
                    );
                    if let Err(e) = timers_only_ran_down(&before, &after, elapsed_ms) {
                        prop_assert!(false, "{:?} changed a hold or a lease: {}", call, e);
                    }
                }
                Err(s) => prop_assert!(
                    s.code() != tonic::Code::Internal && s.code() != tonic::Code::Unknown,
                    "{call:?}: {s:?}"
                ),
                Ok(()) => {}
            }
            Ok(())
        })
    });
    result.expect("every random call");
    let invalid = invalid.get();
    assert!(
        invalid > 50,
        "too few invalid calls to show anything: {invalid}"
    );
    // Still serving.
    rt.block_on(async {
        d.client
            .node(pb::NodeRequest {})
            .await
            .expect("the agent answers after all of it");
    });
}
