//! The node console, `GET /ui`: one page (ui/ beside src/, embedded in
//! the binary, no build step, nothing fetched from elsewhere) fed by
//! Server-Sent Events. Read-only unless the operator turns actions on
//! (see [`actions`]): it watches with the agent's Watch, Node and Logs,
//! and asks Workloads and Place, which any viewer of the agent may call.
//!
//! - `GET /ui/events`: per viewer, the agent's events (`agent`: the
//!   last ones kept by the router's one Watch, [`feed`], then each new
//!   one) and the node (`node`: pools, instances, the router's traffic),
//!   sent at once, on each event or change of the router's traffic (a
//!   burst of them once a [`TICK`]), and at least every [`REFRESH`], so
//!   that measured bytes move too. An agent out of reach is said
//!   (`status`) and asked again every [`REFRESH`].
//! - `GET /ui/logs/{id}`: the last lines of one instance, then each new
//!   one (`line`), from the agent's Logs.
//!
//! Both kinds of stream count against `--max-streams` together (see
//! `limits.rs`); one more is answered 503 `too_many_streams` and its
//! connection closed.

pub mod actions;
pub mod feed;
pub mod view;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::header;
use resident_api::pb;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::App;
use crate::limits::Streams;

const PAGE: &str = include_str!("../../ui/index.html");
const STYLE: &str = include_str!("../../ui/console.css");
const SCRIPT: &str = include_str!("../../ui/console.js");

/// How soon after an agent event the node is read again.
const TICK: Duration = Duration::from_millis(200);
/// How often the node is read without events, and the agent asked again
/// when out of reach.
const REFRESH: Duration = Duration::from_secs(2);
/// The largest body of `POST /ui/act`.
const ACT_BODY: usize = 16 << 10;
/// How many lines of output the logs pane starts with.
const LOG_TAIL: u32 = 200;

/// The page allows only itself: no inline script, nothing from elsewhere.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The console's routes, to merge into the router's.
pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route(
            "/ui",
            get(|| async { asset("text/html; charset=utf-8", PAGE) }),
        )
        .route(
            "/ui/",
            get(|| async { asset("text/html; charset=utf-8", PAGE) }),
        )
        .route(
            "/ui/console.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
        .route(
            "/ui/console.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route("/ui/events", get(events))
        .route("/ui/workloads", get(actions::workloads))
        .route("/ui/place", get(actions::place))
        // An action is a few words: its body is kept small.
        .route(
            "/ui/act",
            axum::routing::post(actions::act).layer(axum::extract::DefaultBodyLimit::max(ACT_BODY)),
        )
        .route("/ui/logs/{id}", get(logs))
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// An SSE response fed by `feed`, which ends when the viewer leaves (its
/// sends fail), counted as one of the console's streams until then; 503
/// when `--max-streams` are open.
fn stream<F>(
    streams: &Streams,
    feed: impl FnOnce(mpsc::Sender<Result<Event, Infallible>>) -> F,
) -> Response
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let slot = match streams.open() {
        Ok(s) => s,
        Err(e) => {
            let mut r = e.into_response();
            // The client's next try opens a connection of its own: this
            // one is not left idle, holding a place among the connections.
            r.headers_mut()
                .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
            return r;
        }
    };
    let (tx, rx) = mpsc::channel(64);
    let fed = feed(tx);
    tokio::spawn(async move {
        fed.await;
        drop(slot);
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn sse(name: &str, data: &serde_json::Value) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(data.to_string()))
}

async fn events(State(app): State<Arc<App>>) -> Response {
    let fed = app.clone();
    stream(&app.streams, |tx| follow_node(fed, tx))
}

/// Feeds one viewer until it leaves.
async fn follow_node(app: Arc<App>, tx: mpsc::Sender<Result<Event, Infallible>>) {
    let agent = app.models.agent().clone();
    let (kept, mut live) = app.feed.follow(&agent);
    for e in kept {
        if tx.send(sse("agent", &e)).await.is_err() {
            return;
        }
    }
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Due at once; then at once after an event that follows a quiet
    // TICK, and a burst of them once a TICK.
    let mut stale = true;
    let mut sent = Instant::now() - REFRESH;
    let mut traffic = app.metrics.traffic_changes();
    loop {
        tokio::select! {
            got = live.recv() => match got {
                Ok(e) => {
                    stale = true;
                    if tx.send(sse("agent", &e)).await.is_err() {
                        return;
                    }
                }
                // Too slow a viewer misses events, not the node.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => stale = true,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
            Ok(()) = traffic.changed() => stale = true,
            _ = tick.tick() => {}
            () = tx.closed() => return,
        }
        if (stale && sent.elapsed() >= TICK) || sent.elapsed() >= REFRESH {
            sent = Instant::now();
            stale = false;
            let event = match agent.node().await {
                Ok(n) => sse("node", &view::node(&n, &app.metrics.traffic())),
                Err(s) => down(&s),
            };
            if tx.send(event).await.is_err() {
                return;
            }
        }
    }
}

/// The agent could not be asked: `status`, with its words.
fn down(s: &tonic::Status) -> Result<Event, Infallible> {
    sse(
        "status",
        &serde_json::json!({"ok": false, "message": s.message()}),
    )
}

async fn logs(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let fed = app.clone();
    stream(&app.streams, |tx| follow_logs(fed, id, tx))
}

/// Feeds one viewer the output of instance `id` until it leaves or the
/// agent ends the stream.
async fn follow_logs(app: Arc<App>, id: String, tx: mpsc::Sender<Result<Event, Infallible>>) {
    let mut lines = match app.models.agent().logs(&id, LOG_TAIL).await {
        Ok(l) => l,
        Err(s) => {
            let _ = tx.send(down(&s)).await;
            return;
        }
    };
    loop {
        tokio::select! {
            got = lines.message() => {
                let Ok(Some(l)) = got else { return };
                let stream = pb::LogStream::try_from(l.stream).map_or("", |s| s.as_str_name());
                let line = serde_json::json!({"seq": l.seq, "stream": stream, "line": l.line});
                if tx.send(sse("line", &line)).await.is_err() {
                    return;
                }
            }
            () = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_is_small_self_contained_and_puts_agent_text_in_as_text() {
        let size = PAGE.len() + STYLE.len() + SCRIPT.len();
        assert!(size < 100_000, "the page is {size} bytes");
        for (name, text) in [
            ("index.html", PAGE),
            ("console.css", STYLE),
            ("console.js", SCRIPT),
        ] {
            assert!(
                !text.contains("http://") && !text.contains("https://"),
                "{name} reaches out"
            );
        }
        for markup in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
        ] {
            assert!(!SCRIPT.contains(markup), "console.js uses {markup}");
        }
    }
}
