//! What a request must be to reach the router's handlers at all, so that
//! no web page a user of this machine opens can drive the router:
//!
//! - its `Host` is one the router answers to ([`Hosts`]: `--allow-host`
//!   beside the listen address and the loopback names), else 403
//!   `host_not_allowed`: a page whose name was rebound to 127.0.0.1 (DNS
//!   rebinding) still sends its own name;
//! - an `Origin`, when sent, names an allowed host too, else 403
//!   `origin_not_allowed`: browsers send it on every cross-site request
//!   but simple GETs, and on every POST;
//! - a request with a body to the API or the console's actions (any
//!   method but GET, HEAD and OPTIONS on `/v1/`, `/upstream/`, `/ui/act`)
//!   says `Content-Type: application/json`, else 415: the types a page
//!   may send elsewhere without asking (`text/plain`, forms) never pass.
//!
//! And [`UpstreamPaths`]: which paths `/upstream/{model}/...` forwards
//! (`--upstream-allow`; by default inference and read paths only), so a
//! model server's own controls (vLLM's `/sleep`, llama-server's `/slots`)
//! are not reachable through the router unless the operator says so.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{Method, StatusCode, header};

use crate::App;
use crate::error::{RouterError, excerpt};

/// The hosts the router answers to, lowercase, each as a `Host` header
/// writes it: `name`, `name:port`, `[v6]`, `[v6]:port`.
#[derive(Debug, Clone)]
pub struct Hosts(BTreeSet<String>);

impl Hosts {
    /// The listen address itself and the loopback names `localhost`,
    /// `127.0.0.1` and `[::1]`, each with the listen port and without it;
    /// then each of `extra` (`--allow-host`) as given.
    pub fn new(listen: SocketAddr, extra: &[String]) -> Self {
        let port = listen.port();
        let own = match listen.ip() {
            IpAddr::V4(ip) => ip.to_string(),
            IpAddr::V6(ip) => format!("[{ip}]"),
        };
        let mut set = BTreeSet::new();
        for name in [own.as_str(), "localhost", "127.0.0.1", "[::1]"] {
            set.insert(name.to_string());
            set.insert(format!("{name}:{port}"));
        }
        for e in extra {
            set.insert(e.trim().to_ascii_lowercase());
        }
        Self(set)
    }

    /// Whether `host` (a `Host` header, or an `Origin`'s host and port)
    /// is one of them.
    pub fn allows(&self, host: &str) -> bool {
        self.0.contains(&host.trim().to_ascii_lowercase())
    }
}

/// Whether `--allow-host VALUE` is a host as a `Host` header writes it:
/// a name or address, optionally `:port`, no scheme or path.
pub fn check_host_flag(value: &str) -> Result<String, String> {
    let v = value.trim();
    let bad = || {
        format!(
            "--allow-host '{value}': give a host as clients write it, such as node-7.example.org, node-7.example.org:8080 or [fe80::1]:8080 (no scheme, no path)"
        )
    };
    if v.is_empty() || v.contains("://") || v.contains('/') || v.contains(char::is_whitespace) {
        return Err(bad());
    }
    let (host, port) = match v.strip_prefix('[') {
        Some(rest) => {
            let (ip, after) = rest.split_once(']').ok_or_else(bad)?;
            ip.parse::<std::net::Ipv6Addr>().map_err(|_| bad())?;
            (v, after.strip_prefix(':'))
        }
        None => match v.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (v, None),
        },
    };
    if host.is_empty() || (host.contains(':') && !host.starts_with('[')) {
        return Err(bad());
    }
    if let Some(p) = port
        && p.parse::<u16>().is_err()
    {
        return Err(bad());
    }
    Ok(v.to_ascii_lowercase())
}

/// The paths the passthrough forwards: each entry a path prefix, matched
/// at a segment's end (`/v1/models` matches `/v1/models` and
/// `/v1/models/x`, not `/v1/modelsx`; `/` matches every path), for every
/// method or, written `GET /props`, for GET and HEAD only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamPaths(Vec<(Option<Method>, String)>);

/// The default of `--upstream-allow`: what OpenAI clients and the
/// servers' own inference APIs call (llama-server, vLLM), and reads of a
/// server's state; not its controls (`/sleep`, `/wake_up`, `/slots`,
/// `/lora-adapters`, `/v1/load_lora_adapter`, `/collective_rpc`, a POST
/// to `/props`, ...) nor its web page at `/`.
pub const DEFAULT_UPSTREAM: &[&str] = &[
    // OpenAI-shaped, both servers.
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/rerank",
    "/v1/score",
    "GET /v1/models",
    // llama-server's own.
    "/completion",
    "/completions",
    "/chat/completions",
    "/embedding",
    "/embeddings",
    "/infill",
    "/rerank",
    "/reranking",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "GET /props",
    "GET /models",
    // vLLM's own.
    "/pooling",
    "/classify",
    "/score",
    "/v2/rerank",
    "GET /version",
    // Health and metrics.
    "GET /health",
    "GET /metrics",
];

impl UpstreamPaths {
    /// The entries of `--upstream-allow` (`default` standing for
    /// [`DEFAULT_UPSTREAM`]); the default alone when there are none.
    pub fn new(entries: &[String]) -> Result<Self, String> {
        let mut out = Vec::new();
        let defaults: Vec<String> = DEFAULT_UPSTREAM.iter().map(|s| s.to_string()).collect();
        let entries = if entries.is_empty() {
            &defaults[..]
        } else {
            entries
        };
        for e in entries {
            if e.trim() == "default" {
                for d in DEFAULT_UPSTREAM {
                    out.push(Self::entry(d)?);
                }
            } else {
                out.push(Self::entry(e)?);
            }
        }
        Ok(Self(out))
    }

    fn entry(e: &str) -> Result<(Option<Method>, String), String> {
        let bad = |why: &str| {
            format!(
                "--upstream-allow '{e}': {why}; give a path prefix such as /v1/ or /metrics, a method and a prefix such as 'GET /props', or default"
            )
        };
        let (method, path) = match e.trim().split_once(char::is_whitespace) {
            Some((m, p)) => {
                if m != "GET" {
                    return Err(bad("only GET may be named (it allows HEAD too)"));
                }
                (Some(Method::GET), p.trim())
            }
            None => (None, e.trim()),
        };
        if !path.starts_with('/') {
            return Err(bad("a path begins with /"));
        }
        if dot_segment(path) {
            return Err(bad("no . or .. segments"));
        }
        Ok((method, path.to_string()))
    }

    /// Whether `method` on `path` (as the client wrote it, percent-escapes
    /// and all, without the query) is forwarded: its decoded form has no
    /// `.` or `..` segment (a server that resolves them would reach what
    /// the prefix does not cover) and an entry matches it.
    pub fn allows(&self, method: &Method, path: &str) -> bool {
        let decoded = percent_decoded(path);
        if dot_segment(&decoded) {
            return false;
        }
        self.0.iter().any(|(m, prefix)| {
            let method_ok = match m {
                None => true,
                Some(_) => *method == Method::GET || *method == Method::HEAD,
            };
            method_ok && under(&decoded, prefix)
        })
    }
}

/// Whether `path` is `prefix` or below it.
fn under(path: &str, prefix: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

/// Whether a segment of `path` (split at `/` and `\`) is `.` or `..`.
fn dot_segment(path: &str) -> bool {
    path.split(['/', '\\']).any(|s| s == "." || s == "..")
}

/// `path` with its `%XX` escapes decoded (others left as they are).
fn percent_decoded(path: &str) -> String {
    let b = path.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push(h << 4 | l);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(c: u8) -> Option<u8> {
    (c as char).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

/// The host and port an `Origin` names (`http://host:port` gives
/// `host:port`); `None` for `null` or anything else that names no host.
fn origin_host(origin: &str) -> Option<&str> {
    let (_, rest) = origin.split_once("://")?;
    let host = rest.split('/').next().unwrap_or("");
    (!host.is_empty()).then_some(host)
}

/// Whether a request of `method` to `path` must carry a JSON body.
fn needs_json(method: &Method, path: &str) -> bool {
    let api = path.starts_with("/v1/") || path.starts_with("/upstream/") || path == "/ui/act";
    api && !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Whether `value` (a Content-Type) is `application/json`, with any
/// parameters.
fn is_json(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
}

/// 403 with the OpenAI shape.
fn forbidden(code: &str, message: String) -> RouterError {
    let mut e = RouterError::invalid(code, message);
    e.status = StatusCode::FORBIDDEN;
    e.kind = "forbidden";
    e
}

/// The request checks above, before any handler.
pub async fn check(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    match refusal(&app.hosts, &request) {
        None => next.run(request).await,
        Some((why, e)) => {
            app.metrics.refused(why);
            tracing::info!(method = %request.method(), path = %excerpt(request.uri().path()), status = e.status.as_u16(), code = %e.code, message = %e.message, "refused");
            e.into_response()
        }
    }
}

/// Why `request` is refused, if it is: the metric's label and the error.
fn refusal(hosts: &Hosts, request: &Request) -> Option<(&'static str, RouterError)> {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| request.uri().authority().map(|a| a.as_str().to_string()));
    match host {
        Some(h) if hosts.allows(&h) => {}
        Some(h) => {
            return Some((
                "host",
                forbidden(
                    "host_not_allowed",
                    format!(
                        "this router does not answer to the host {} (a page whose name points here, as DNS rebinding does, must not reach it): to serve it, start residentd-router with --allow-host {}",
                        excerpt(&h),
                        excerpt(&h)
                    ),
                ),
            ));
        }
        None => {
            return Some((
                "host",
                forbidden(
                    "host_not_allowed",
                    "the request names no host (Host header): the router answers only to the hosts it allows (--allow-host)".to_string(),
                ),
            ));
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let text = String::from_utf8_lossy(origin.as_bytes());
        if !origin_host(&text).is_some_and(|h| hosts.allows(h)) {
            return Some((
                "origin",
                forbidden(
                    "origin_not_allowed",
                    format!(
                        "a page of {} may not call this router (a cross-site request): only pages of the hosts it allows may (--allow-host)",
                        excerpt(&text)
                    ),
                ),
            ));
        }
    }
    if needs_json(request.method(), request.uri().path()) {
        let kind = headers
            .get(header::CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        if !kind.as_deref().is_some_and(is_json) {
            let named = kind.map_or("none".to_string(), |k| excerpt(&k));
            let mut e = RouterError::invalid(
                "unsupported_media_type",
                format!("the body must be JSON (Content-Type: application/json), not {named}"),
            );
            e.status = StatusCode::UNSUPPORTED_MEDIA_TYPE;
            return Some(("content_type", e));
        }
    }
    None
}

/// 403 for a passthrough path `--upstream-allow` does not cover.
pub fn upstream_refused(method: &Method, model: &str, path: &str) -> RouterError {
    forbidden(
        "upstream_path_not_allowed",
        format!(
            "{method} {} is not forwarded to the server of {}: its path is not among those --upstream-allow lets through (by default inference and read paths only; docs/router.md)",
            excerpt(path),
            excerpt(model)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_hosts_are_the_listen_address_and_loopback_with_and_without_the_port() {
        let listen: SocketAddr = "127.0.0.1:8080".parse().expect("address");
        let hosts = Hosts::new(listen, &["Node-7.example.org:8080".into()]);
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:8080",
            "LOCALHOST",
            "[::1]:8080",
            "[::1]",
            "node-7.example.org:8080",
        ] {
            assert!(hosts.allows(ok), "{ok}");
        }
        for no in [
            "evil.example",
            "evil.example:8080",
            "localhost:8081",
            "node-7.example.org",
            "127.0.0.1.evil.example",
            "",
        ] {
            assert!(!hosts.allows(no), "{no}");
        }
        let v6: SocketAddr = "[fe80::1]:9000".parse().expect("address");
        assert!(Hosts::new(v6, &[]).allows("[fe80::1]:9000"));
    }

    #[test]
    fn allow_host_takes_hosts_as_clients_write_them() {
        for ok in [
            "node-7",
            "node-7.example.org:8080",
            "[fe80::1]:80",
            "10.0.0.7",
        ] {
            assert!(check_host_flag(ok).is_ok(), "{ok}");
        }
        for no in [
            "http://node-7",
            "node-7/ui",
            "node-7:http",
            "fe80::1",
            "[nope]:80",
            "",
            "a b",
        ] {
            let e = check_host_flag(no).expect_err(no);
            assert!(e.contains(&format!("'{no}'")), "{e}");
        }
    }

    #[test]
    fn origins_name_their_host_and_port() {
        assert_eq!(origin_host("http://127.0.0.1:8080"), Some("127.0.0.1:8080"));
        assert_eq!(origin_host("https://evil.example"), Some("evil.example"));
        assert_eq!(origin_host("null"), None);
        assert_eq!(origin_host("http://"), None);
    }

    #[test]
    fn only_json_bodies_reach_the_api() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/jsonx"));
        assert!(!is_json("application/x-www-form-urlencoded"));
        assert!(needs_json(&Method::POST, "/v1/chat/completions"));
        assert!(needs_json(&Method::POST, "/upstream/m/v1/completions"));
        assert!(needs_json(&Method::POST, "/ui/act"));
        assert!(!needs_json(&Method::GET, "/v1/models"));
        assert!(!needs_json(&Method::POST, "/nothing"));
    }

    #[test]
    fn the_passthrough_forwards_inference_and_reads_by_default_and_what_it_is_told() {
        let d = UpstreamPaths::new(&[]).expect("default");
        let (get, post) = (Method::GET, Method::POST);
        for (m, p) in [
            (&post, "/v1/chat/completions"),
            (&post, "/completion"),
            (&get, "/v1/models"),
            (&get, "/v1/models/org%2Fname"),
            (&get, "/metrics"),
            (&Method::HEAD, "/health"),
            (&get, "/props"),
        ] {
            assert!(d.allows(m, p), "{m} {p}");
        }
        for (m, p) in [
            (&post, "/sleep"),
            (&post, "/wake_up"),
            (&get, "/slots"),
            (&post, "/slots/0"),
            (&post, "/props"),
            (&post, "/v1/load_lora_adapter"),
            (&get, "/"),
            (&get, "/v1/models/../../sleep"),
            (&get, "/v1/models/%2e%2e/%2E%2E/sleep"),
            (&get, "/health/..%5csleep"),
            (&get, "/v1/modelsx"),
            (&post, "/%73leep"),
        ] {
            assert!(!d.allows(m, p), "{m} {p}");
        }
        let wide = UpstreamPaths::new(&["default".into(), "/slots".into()]).expect("wide");
        assert!(wide.allows(&post, "/slots/0"));
        assert!(wide.allows(&post, "/v1/completions"));
        assert!(!wide.allows(&post, "/sleep"));
        let all = UpstreamPaths::new(&["/".into()]).expect("all");
        assert!(all.allows(&post, "/sleep"));
        assert!(all.allows(&get, "/"));
        assert!(!all.allows(&get, "/a/../b"));
        for bad in ["sleep", "POST /x", "/a/../b"] {
            let e = UpstreamPaths::new(&[bad.into()]).expect_err(bad);
            assert!(e.contains(&format!("'{bad}'")), "{e}");
        }
    }
}
