//! Any bytes as what the router reads from a client (the first byte picks
//! which): a request body (the model it names and whether it streams), a
//! `Host` header, an `/upstream` path, a string quoted in an error or a
//! log line. Never a panic; a body is read only when it is a JSON object
//! naming a model; an allowed upstream path is absolute and has no `..`
//! segment, however encoded; a quote has no control character.
#![no_main]

use libfuzzer_sys::fuzz_target;
use residentd_router::error::excerpt;
use residentd_router::guard::{Hosts, UpstreamPaths, check_host_flag};

fuzz_target!(|data: &[u8]| {
    let Some((kind, rest)) = data.split_first() else {
        return;
    };
    match kind % 4 {
        0 => {
            if let Ok((model, _)) = residentd_router::request_model(rest) {
                assert!(!model.is_empty());
                let first = rest.iter().find(|b| !b.is_ascii_whitespace());
                assert_eq!(first, Some(&b'{'));
            }
        }
        1 => {
            let text = String::from_utf8_lossy(rest);
            let hosts = Hosts::new("127.0.0.1:8080".parse().expect("an address"), &[]);
            let _ = hosts.allows(&text);
            let _ = check_host_flag(&text);
        }
        2 => {
            let path = String::from_utf8_lossy(rest);
            let paths = UpstreamPaths::new(&["default".to_string()]).expect("the default");
            for method in [http::Method::GET, http::Method::POST] {
                if paths.allows(&method, &path) {
                    assert!(path.starts_with('/'), "{path:?}");
                    let lower = path.to_ascii_lowercase();
                    let decoded = lower.replace("%2e", ".").replace("%2f", "/");
                    assert!(!decoded.split('/').any(|s| s == ".."), "{path:?}");
                }
            }
        }
        _ => {
            let text = String::from_utf8_lossy(rest);
            assert!(!excerpt(&text).chars().any(char::is_control));
        }
    }
});
