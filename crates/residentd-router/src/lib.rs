//! residentd-router: the OpenAI-compatible front door of a residentd node.
//!
//! A request names a model; the router finds the workload (by name or
//! alias, from the agent's roster), gets its instance READY (starting it
//! on demand through the agent's `Start`), holds it against eviction while
//! the answer is sent, and forwards the request to the model's own server
//! on loopback. It is a client of the agent's public gRPC API and nothing
//! more: the agent decides what may be resident, the router only asks.
//!
//! - `agent.rs`: the RPCs the router makes, a refusal decoded, and the
//!   channel to the agent (socket, TCP, or TCP with mutual TLS).
//! - `models.rs`: roster, holds, and the FIFO gate of starts on demand.
//! - `proxy.rs`: forwarding, streaming, and the hold that ends with the
//!   response body.
//! - `error.rs`: OpenAI-shaped errors. `metrics.rs`: `/metrics`.
//! - `guard.rs`: what a request must be to reach any handler (an allowed
//!   `Host` and `Origin`, a JSON body) and which paths the passthrough
//!   forwards.
//! - `limits.rs`: the HTTP server within its bounds (connections, the
//!   time to send headers), the bytes of bodies held at once, and the
//!   console's streams.
//! - `console/`: the node console, `GET /ui` (its page under `ui/`), fed
//!   by Server-Sent Events; its actions only when turned on.
//!
//! docs/router.md is the operator's guide.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, Uri, header};
use serde::Deserialize;

pub mod agent;
pub mod console;
pub mod error;
pub mod guard;
pub mod limits;
pub mod metrics;
pub mod models;
pub mod proxy;
mod waiting;

pub use agent::AgentTls;
pub use error::RouterError;

use crate::agent::Agent;
use crate::metrics::Metrics;
use crate::models::Models;
use crate::proxy::Upstream;

/// What the router is told on its command line.
#[derive(Debug, Clone)]
pub struct Options {
    /// The agent: a Unix socket path, `http://HOST:PORT`, or
    /// `https://HOST:PORT` with `tls`.
    pub agent: String,
    /// The router's side of the agent's mutual TLS.
    pub tls: Option<AgentTls>,
    /// Where to serve HTTP.
    pub listen: SocketAddr,
    /// The longest a request waits for its model's start to get memory
    /// that requests in flight hold.
    pub queue_timeout: Duration,
    /// The largest request body taken, in bytes.
    pub max_body: usize,
    /// The longest a client may take to send its body.
    pub body_timeout: Duration,
    /// How long each hold lasts; renewed every third of it while a request
    /// is in flight, so a router that dies leaves no hold for longer.
    pub hold: Duration,
    /// The console's actions (start, stop, sleep, wake from `/ui`): off
    /// when `None`; on for requests that carry this bearer token.
    pub console_token: Option<String>,
    /// Hosts the router answers to beside the listen address and the
    /// loopback names (`--allow-host`).
    pub allow_hosts: Vec<String>,
    /// The paths `/upstream/{model}/` forwards (`--upstream-allow`);
    /// empty: [`guard::DEFAULT_UPSTREAM`].
    pub upstream_allow: Vec<String>,
    /// The longest a client may take to send a request's headers (and,
    /// on a kept-alive connection, to begin the next request).
    pub header_timeout: Duration,
    /// The most connections open at once.
    pub max_connections: usize,
    /// The most bytes of request bodies held at once.
    pub body_budget: usize,
    /// The most console streams (`/ui/events`, `/ui/logs`) open at once.
    pub max_streams: usize,
    /// How long a start on demand that needs a loaded model's memory lets
    /// that model's new requests go first (`--swap-after`): within it they
    /// are served (no A-B-A thrash), after it they queue behind the start
    /// (nobody starves).
    pub swap_after: Duration,
    /// The most inference requests forwarded at once across all models
    /// (`--max-busy`; 0: no limit).
    pub max_busy: usize,
}

/// The defaults of the options (and of the flags that set them).
pub mod defaults {
    use std::time::Duration;

    /// `--queue-timeout`.
    pub const QUEUE_TIMEOUT: Duration = Duration::from_secs(120);
    /// `--max-body`: 32 MiB.
    pub const MAX_BODY: usize = 32 << 20;
    /// `--body-timeout`.
    pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
    /// `--hold`.
    pub const HOLD: Duration = Duration::from_secs(15);
    /// `--header-timeout`: a client on a slow link sends its headers in
    /// well under a second.
    pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
    /// `--max-connections`: each proxied request takes two file
    /// descriptors (the client's, the model server's).
    pub const MAX_CONNECTIONS: usize = 512;
    /// `--body-budget`: 256 MiB, eight bodies of the largest size.
    pub const BODY_BUDGET: usize = 256 << 20;
    /// `--max-streams`: 32 console pages, each with its logs followed.
    pub const MAX_STREAMS: usize = 64;
    /// `--swap-after`.
    pub const SWAP_AFTER: Duration = Duration::from_secs(5);
}

impl Options {
    /// The defaults, reaching the agent at `agent` and serving `listen`.
    pub fn new(agent: impl Into<String>, listen: SocketAddr) -> Self {
        Self {
            agent: agent.into(),
            tls: None,
            listen,
            queue_timeout: defaults::QUEUE_TIMEOUT,
            max_body: defaults::MAX_BODY,
            body_timeout: defaults::BODY_TIMEOUT,
            hold: defaults::HOLD,
            console_token: None,
            allow_hosts: Vec::new(),
            upstream_allow: Vec::new(),
            header_timeout: defaults::HEADER_TIMEOUT,
            max_connections: defaults::MAX_CONNECTIONS,
            body_budget: defaults::BODY_BUDGET,
            max_streams: defaults::MAX_STREAMS,
            swap_after: defaults::SWAP_AFTER,
            max_busy: 0,
        }
    }
}

/// The router's shared state.
#[derive(Debug)]
pub struct App {
    models: Arc<Models>,
    upstream: Upstream,
    metrics: Arc<Metrics>,
    options: Options,
    /// The agent's events for the console's pages.
    feed: console::feed::Feed,
    /// The hosts it answers to.
    hosts: guard::Hosts,
    /// The paths its passthrough forwards.
    upstream_paths: guard::UpstreamPaths,
    /// The bytes of bodies it holds at once.
    bodies: limits::BodyBudget,
    /// The console's streams.
    streams: limits::Streams,
}

impl App {
    /// A router for `options`. Nothing is asked of the agent yet.
    pub fn new(options: Options) -> anyhow::Result<Arc<Self>> {
        let metrics = Arc::new(Metrics::new());
        let agent = Agent::new(&options.agent, options.tls.as_ref())?;
        let models = Models::new(
            agent,
            models::Timing {
                hold: options.hold,
                queue_timeout: options.queue_timeout,
                swap_after: options.swap_after,
                max_busy: options.max_busy,
            },
            metrics.clone(),
        );
        let mut allowed = Vec::new();
        for h in &options.allow_hosts {
            allowed.push(guard::check_host_flag(h).map_err(anyhow::Error::msg)?);
        }
        Ok(Arc::new(Self {
            models,
            upstream: proxy::upstream(),
            hosts: guard::Hosts::new(options.listen, &allowed),
            upstream_paths: guard::UpstreamPaths::new(&options.upstream_allow)
                .map_err(anyhow::Error::msg)?,
            bodies: limits::BodyBudget::new(options.body_budget, metrics.clone()),
            streams: limits::Streams::new(options.max_streams, metrics.clone()),
            metrics,
            options,
            feed: console::feed::Feed::default(),
        }))
    }

    /// The models.
    pub fn models(&self) -> &Arc<Models> {
        &self.models
    }

    /// The HTTP routes.
    pub fn routes(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(openai))
            .route("/v1/completions", post(openai))
            .route("/v1/embeddings", post(openai))
            .route("/v1/responses", post(openai))
            .route("/v1/models", get(list_models))
            .route("/upstream/{model}", any(upstream))
            // A wildcard matches one character at least: the server's root
            // with its slash has a route of its own.
            .route("/upstream/{model}/", any(upstream))
            .route("/upstream/{model}/{*rest}", any(upstream))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .merge(console::routes())
            .fallback(unknown_endpoint)
            .layer(axum::middleware::from_fn_with_state(
                self.clone(),
                guard::check,
            ))
            .with_state(self.clone())
    }

    /// Serves on `listener` until `shutdown` resolves, then lets the
    /// answers in flight finish.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        if let Err(e) = self.models.refresh().await {
            tracing::warn!(error = %e.message(), "the agent's roster could not be read yet; asking again at the first request");
        }
        let renew = tokio::spawn(self.models.clone().renew_holds());
        limits::serve(
            listener,
            self.routes(),
            self.options.max_connections,
            self.options.header_timeout,
            self.metrics.clone(),
            shutdown,
        )
        .await;
        renew.abort();
        self.models.settle().await;
        Ok(())
    }

    /// Reads a request body within the size and time limits, once the
    /// body budget has room for it (its declared length, else the largest
    /// body); the room is held until the [`limits::Buffered`] is dropped.
    async fn body(
        &self,
        headers: &HeaderMap,
        body: Body,
    ) -> Result<(Bytes, limits::Buffered), RouterError> {
        let max = self.options.max_body;
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(n) = declared.filter(|n| *n > max as u64) {
            // The 413 is read only by a client that could send its body:
            // one refused before it finishes writing finds the connection
            // reset (unread bytes make the kernel answer RST) and never
            // sees the answer. Read and drop what it sends, up to a bound.
            if n <= DRAIN_AT_MOST {
                let drained = drain(body);
                let _ = tokio::time::timeout(self.options.body_timeout, drained).await;
            }
            return Err(RouterError::too_large(max));
        }
        let hint = http_body::Body::size_hint(&body);
        let need = hint
            .upper()
            .and_then(|n| usize::try_from(n).ok())
            .map_or(max, |n| n.min(max));
        let room = self.bodies.room(need, self.options.queue_timeout).await?;
        let read = axum::body::to_bytes(body, max);
        match tokio::time::timeout(self.options.body_timeout, read).await {
            Err(_) => Err(RouterError::slow_body(self.options.body_timeout.as_secs())),
            Ok(Ok(bytes)) => Ok((bytes, room)),
            Ok(Err(e)) if is_length_limit(&e) => Err(RouterError::too_large(max)),
            Ok(Err(e)) => Err(RouterError::invalid(
                "unreadable_body",
                format!("the request body could not be read: {e}"),
            )),
        }
    }

    /// Holds `model` READY and forwards the request to it. A streamed
    /// request (`streaming`) still waiting for its model after
    /// [`waiting::FIRST`] (a load) is answered at once with an event
    /// stream that says it waits, then carries the model's events
    /// (`waiting.rs`).
    async fn route(
        self: &Arc<Self>,
        model: &str,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: Bytes,
        streaming: bool,
    ) -> Response {
        let arrived = proxy::Arrival::now();
        let began = arrived.at;
        let (app, wanted, path, headers) = (
            self.clone(),
            model.to_string(),
            path_and_query.to_string(),
            headers.clone(),
        );
        let work = async move {
            let answer = async {
                let m = app.models.resolve(&wanted).await?;
                let held = app.models.acquire(m).await?;
                let (name, pid) = (held.model.name.clone(), held.pid);
                let response = proxy::forward(
                    &app.upstream,
                    &app.metrics,
                    arrived,
                    held,
                    method,
                    &path,
                    &headers,
                    body,
                    streaming,
                )
                .await?;
                app.metrics.first_byte(&name, began.elapsed());
                Ok::<_, RouterError>((name, pid, response))
            }
            .await;
            match answer {
                Ok((name, pid, response)) => {
                    let status = response.status();
                    app.metrics.answered(&name, status.as_u16());
                    tracing::info!(model = %name, instance = %name, pid, status = status.as_u16(), first_byte_ms = began.elapsed().as_millis() as u64, path = %path, "forwarded");
                    Ok(response)
                }
                Err(e) => {
                    app.failed_quietly(&wanted, &e);
                    Err(e)
                }
            }
        };
        if !streaming {
            return work.await.unwrap_or_else(IntoResponse::into_response);
        }
        let mut task = tokio::spawn(work);
        tokio::select! {
            done = &mut task => match done {
                Ok(answer) => answer.unwrap_or_else(IntoResponse::into_response),
                Err(e) => RouterError::agent(format!("the request's task failed: {e}")).into_response(),
            },
            () = tokio::time::sleep(waiting::FIRST) => {
                let name = self.models.known(model).unwrap_or_else(|| model.to_string());
                waiting::stream_while(name, task)
            }
        }
    }

    /// Counts and logs a request answered with `e` (not forwarded).
    fn failed_quietly(&self, model: &str, e: &RouterError) {
        // Labelled with the workload a known name stands for; anything
        // else a client sends would make a series per string.
        let label = self.models.known(model).unwrap_or_default();
        self.metrics.answered(&label, e.status.as_u16());
        tracing::info!(model = %error::excerpt(model), status = e.status.as_u16(), kind = e.kind, code = %e.code, message = %e.message, "not forwarded");
    }

    fn failed(&self, model: &str, e: RouterError) -> Response {
        self.failed_quietly(model, &e);
        e.into_response()
    }
}

/// Whether a body read failed for being longer than allowed.
fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// The one field the router reads of an OpenAI request.
#[derive(Deserialize)]
struct Named {
    model: Option<serde_json::Value>,
    #[serde(default)]
    stream: Option<serde_json::Value>,
}

/// Whether an OpenAI request asks for a streamed answer.
fn streamed(body: &[u8]) -> bool {
    serde_json::from_slice::<Named>(body)
        .ok()
        .and_then(|n| n.stream)
        .is_some_and(|s| s == serde_json::Value::Bool(true))
}

/// What the router reads of an OpenAI request's body: the model it names
/// and whether it asks for a streamed answer; or the error the client is
/// answered. Public for the fuzz target (fuzz/fuzz_targets/router.rs).
pub fn request_model(body: &[u8]) -> Result<(String, bool), RouterError> {
    Ok((model_of(body)?, streamed(body)))
}

/// The model an OpenAI request names.
fn model_of(body: &[u8]) -> Result<String, RouterError> {
    // serde reads a struct from a JSON array too (its fields in order):
    // an array (or any other value) is not a request, whatever it holds.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        let kind =
            serde_json::from_slice::<serde_json::Value>(body).map_or("not JSON", |v| json_kind(&v));
        return Err(RouterError::invalid(
            "invalid_json",
            format!("the request body is not a JSON object: it is {kind}"),
        ));
    }
    let named: Named = serde_json::from_slice(body).map_err(|e| {
        RouterError::invalid(
            "invalid_json",
            format!("the request body is not a JSON object: {e}"),
        )
    })?;
    match named.model {
        Some(serde_json::Value::String(m)) if !m.is_empty() => Ok(m),
        Some(serde_json::Value::String(_)) | None => Err(RouterError::invalid(
            "missing_model",
            "the request names no model: set \"model\" to one of GET /v1/models",
        )),
        Some(other) => Err(RouterError::invalid(
            "invalid_model",
            format!("\"model\" must be a string, not {}", json_kind(&other)),
        )),
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

async fn openai(
    State(app): State<Arc<App>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (body, room) = match app.body(&headers, body).await {
        Ok(b) => b,
        Err(e) => return app.failed("", e),
    };
    let model = match model_of(&body) {
        Ok(m) => m,
        Err(e) => return app.failed("", e),
    };
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let streaming = streamed(&body);
    let answer = app
        .route(&model, method, path, &headers, body, streaming)
        .await;
    // Forwarded (or answered without): its room is given back.
    drop(room);
    answer
}

async fn upstream(
    State(app): State<Arc<App>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    // From the raw path, not axum's decoded captures: `%2F` or `%20` in
    // the rest must reach the model's server as the client wrote them.
    let after = uri.path().strip_prefix("/upstream/").unwrap_or("");
    let (model, rest) = after.split_once('/').unwrap_or((after, ""));
    let model = model.to_string();
    let mut path = format!("/{rest}");
    if !app.upstream_paths.allows(&method, &path) {
        app.metrics.refused("upstream_path");
        return app.failed(&model, guard::upstream_refused(&method, &model, &path));
    }
    if let Some(q) = uri.query() {
        path.push('?');
        path.push_str(q);
    }
    let (body, room) = match app.body(&headers, body).await {
        Ok(b) => b,
        Err(e) => return app.failed(&model, e),
    };
    let answer = app
        .route(&model, method, &path, &headers, body, false)
        .await;
    drop(room);
    answer
}

async fn list_models(State(app): State<Arc<App>>) -> Response {
    let listed = async {
        app.models.refresh().await?;
        app.models.agent().list().await
    }
    .await;
    let instances = match listed {
        Ok(i) => i,
        Err(s) => return app.failed("", RouterError::from_status(&s)),
    };
    // The state of the instance that serves a workload: the router's own
    // (its id is the name) unless another of the workload's is READY (an
    // instance someone started under an id of their own serves as well).
    let state_of = |name: &str| {
        let ready = |i: &&resident_api::pb::Instance| {
            i.workload == name && i.state == resident_api::pb::State::Ready as i32
        };
        let own = instances.iter().find(|i| i.instance_id == name);
        own.filter(ready)
            .or_else(|| instances.iter().find(ready))
            .or(own)
            .map_or("STOPPED", |i| {
                resident_api::pb::State::try_from(i.state)
                    .map_or("STATE_UNSPECIFIED", |s| s.as_str_name())
            })
    };
    let mut data = Vec::new();
    for w in app.models.workloads() {
        let state = state_of(&w.name);
        data.push(serde_json::json!({
            "id": w.name,
            "object": "model",
            "created": 0,
            "owned_by": "residentd",
            "state": state,
            "aliases": w.aliases,
        }));
        for alias in &w.aliases {
            data.push(serde_json::json!({
                "id": alias,
                "object": "model",
                "created": 0,
                "owned_by": "residentd",
                "state": state,
                "alias_of": w.name,
            }));
        }
    }
    json(serde_json::json!({"object": "list", "data": data}))
}

fn json(value: serde_json::Value) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    match app.models.agent().workloads().await {
        Ok(_) => json(serde_json::json!({"status": "ok"})),
        Err(s) => RouterError::from_status(&s).into_response(),
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

async fn unknown_endpoint(method: Method, uri: Uri) -> Response {
    let mut e = RouterError::invalid(
        "unknown_endpoint",
        format!(
            "{method} {} is not served here (docs/router.md lists the endpoints)",
            error::excerpt(uri.path())
        ),
    );
    e.status = StatusCode::NOT_FOUND;
    e.into_response()
}

/// The largest declared body a refusal reads and drops before its 413
/// (within the body timeout); a larger one is refused at once, and its
/// client may see the connection reset instead.
const DRAIN_AT_MOST: u64 = 64 << 20;

/// Reads `body` to its end and drops it.
async fn drain(mut body: Body) {
    use http_body_util::BodyExt as _;
    while let Some(Ok(_)) = body.frame().await {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_read_or_the_error_says_what_is_wrong() {
        assert_eq!(model_of(br#"{"model": "a", "x": [1]}"#), Ok("a".into()));
        let e = model_of(b"{not json").expect_err("malformed");
        assert_eq!(
            (e.status, e.code.as_str()),
            (StatusCode::BAD_REQUEST, "invalid_json")
        );
        assert!(e.message.contains("line 1 column 2"), "{}", e.message);
        let e = model_of(br#"{"messages": []}"#).expect_err("no model");
        assert_eq!(e.code, "missing_model");
        let e = model_of(br#"{"model": 7}"#).expect_err("a number");
        assert_eq!(e.code, "invalid_model");
        assert!(e.message.contains("a number"));
        let e = model_of(b"[1, 2]").expect_err("not an object");
        assert_eq!(e.code, "invalid_json");
    }
}
