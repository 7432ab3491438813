//! Any bytes as a request message (the first byte picks the RPC): decoded
//! by prost, then validated; never a panic, and what validation accepts
//! is within the contract.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use resident_api::pb;
use residentd::validate;

fuzz_target!(|data: &[u8]| {
    let Some((kind, body)) = data.split_first() else {
        return;
    };
    let ok_id = |id: &str| {
        (1..=validate::MAX_ID).contains(&id.len())
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    };
    match kind % 5 {
        0 => {
            if let Ok(r) = pb::StartRequest::decode(body)
                && let Ok((id, _)) = validate::start(&r)
            {
                assert!(!r.workload.is_empty() && r.workload.len() <= validate::MAX_ID);
                assert!(id.is_none_or(|id| ok_id(id.as_str())));
            }
        }
        1 => {
            if let Ok(r) = pb::StopRequest::decode(body)
                && let Ok((id, _)) = validate::stop(&r)
            {
                assert!(ok_id(id.as_str()));
            }
        }
        2 => {
            if let Ok(r) = pb::PlaceRequest::decode(body) {
                let _ = validate::place(&r);
            }
        }
        3 => {
            if let Ok(r) = pb::WatchNodeRequest::decode(body)
                && let Ok((every, heartbeat)) = validate::watch_node(&r)
            {
                let ms = every.as_millis();
                assert!((50..=60_000).contains(&ms));
                assert!(heartbeat.is_none_or(|h| (100..=3_600_000).contains(&h.as_millis())));
            }
        }
        _ => {
            if let Ok(r) = pb::LogsRequest::decode(body)
                && let Ok(id) = validate::logs(&r)
            {
                assert!(ok_id(id.as_str()) && r.tail <= validate::MAX_TAIL);
            }
        }
    }
});
