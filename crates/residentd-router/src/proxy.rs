//! Forwarding one request to a model's server on loopback and its answer
//! back, chunk by chunk as the server writes it (Server-Sent Events pass
//! through unbuffered). The answer's body carries the request's [`Held`]
//! claim: when the body has been sent, or the client went away and the
//! body is dropped (which also closes the upstream connection, cancelling
//! the generation), the hold and the concurrency permit go with it.
//! On its way the body is tallied ([`Tally`]): when its first piece went
//! out, how many tokens it carried; the console lists each answer so.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, Request, Uri, header};
use http_body::{Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::error::RouterError;
use crate::metrics::{Metrics, Served};
use crate::models::Held;

/// The HTTP/1 client of the models' servers (connections are kept alive
/// and reused).
pub type Upstream = Client<HttpConnector, Full<Bytes>>;

/// How long an idle connection to a model's server is kept for reuse:
/// shorter than the servers' own keep-alive (llama-server says `timeout=5`),
/// so that a request is not sent on a connection the server is closing
/// for idleness at that moment.
const IDLE: std::time::Duration = std::time::Duration::from_secs(2);

/// A client for the models' servers.
pub fn upstream() -> Upstream {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(IDLE)
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .build(connector)
}

/// Headers that belong to one connection, never forwarded (RFC 9110 7.6.1).
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
];

/// `headers` less the hop-by-hop ones, and less those the `Connection`
/// header names.
fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    let mut out = headers.clone();
    for listed in headers.get_all(header::CONNECTION) {
        for name in listed.to_str().unwrap_or("").split(',') {
            if let Ok(name) = HeaderName::from_bytes(name.trim().as_bytes()) {
                out.remove(name);
            }
        }
    }
    for h in &HOP_BY_HOP {
        out.remove(h);
    }
    out.remove("keep-alive");
    out
}

/// Sends `method path` with `headers` and `body` to the held model's
/// server; answers its response with a body that ends the hold and, when
/// it ends, tells `metrics` how the answer went. A `streaming` request
/// goes on a connection of its own, closed after it: llama-server closes
/// the connection after a streamed answer though it says keep-alive, and
/// a request sent on it at that moment failed (`connection closed before
/// message completed`).
#[allow(clippy::too_many_arguments)]
pub async fn forward(
    client: &Upstream,
    metrics: &Arc<Metrics>,
    arrived: Arrival,
    held: Held,
    method: Method,
    path_and_query: &str,
    headers: &HeaderMap,
    body: Bytes,
    streaming: bool,
) -> Result<Response, RouterError> {
    let uri: Uri = format!("http://127.0.0.1:{}{path_and_query}", held.port)
        .parse()
        .map_err(|e| {
            RouterError::invalid("invalid_path", format!("the path cannot be forwarded: {e}"))
        })?;
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .body(Full::new(body))
        .map_err(|e| RouterError::upstream(&held.model.name, e))?;
    let mut sent = end_to_end(headers);
    // The length is the body's, which the client sets.
    sent.remove(header::HOST);
    sent.remove(header::CONTENT_LENGTH);
    if streaming {
        sent.insert(header::CONNECTION, http::HeaderValue::from_static("close"));
    }
    *req.headers_mut() = sent;
    let response = client.request(req).await.map_err(|e| {
        RouterError::upstream(
            &held.model.name,
            format!("its server did not answer: {}", causes(&e)),
        )
    })?;
    let (mut parts, incoming) = response.into_parts();
    // The model server's Content-Length stands (also for HEAD and 304,
    // whose bodies are empty).
    parts.headers = end_to_end(&parts.headers);
    let streamed = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let tally = Tally {
        metrics: metrics.clone(),
        model: held.model.name.clone(),
        path: path_and_query.split('?').next().unwrap_or("").to_string(),
        status: parts.status.as_u16(),
        arrived,
        first: None,
        ended: false,
        streamed,
        line: Vec::new(),
        events: 0,
        body: Vec::new(),
    };
    let body = Body::new(Holding {
        inner: incoming,
        tally,
        _held: held,
    });
    Ok(Response::from_parts(parts, body))
}

/// `e` and each error under it, joined by ": " (hyper's own words alone
/// say only `client error (SendRequest)`).
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut said = e.to_string();
    let mut under = e.source();
    while let Some(c) = under {
        said.push_str(": ");
        said.push_str(&c.to_string());
        under = c.source();
    }
    said
}

/// When a request arrived.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    /// For durations.
    pub at: Instant,
    /// For the console's clock, in ms since the Unix epoch.
    pub unix_ms: u64,
}

impl Arrival {
    /// Now.
    pub fn now() -> Self {
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Self {
            at: Instant::now(),
            unix_ms,
        }
    }
}

/// The largest unstreamed answer read for its `usage`.
const USAGE_READ: usize = 64 * 1024;
/// The head of an SSE line kept: enough to tell `data: [DONE]`.
const LINE_HEAD: usize = 12;

/// What an answer's body showed on its way: when its first piece went
/// out, how many SSE `data:` events it carried (a streamed answer: one
/// per token as OpenAI servers send them) or, unstreamed, its body for
/// the `usage`. Told to the metrics when the body is dropped.
struct Tally {
    metrics: Arc<Metrics>,
    model: String,
    path: String,
    status: u16,
    arrived: Arrival,
    first: Option<Instant>,
    ended: bool,
    streamed: bool,
    /// The head of the SSE line being read (across pieces).
    line: Vec<u8>,
    events: u64,
    /// An unstreamed body, up to [`USAGE_READ`].
    body: Vec<u8>,
}

impl Tally {
    fn saw(&mut self, piece: &[u8]) {
        if self.first.is_none() && !piece.is_empty() {
            self.first = Some(Instant::now());
        }
        if !self.streamed {
            if self.body.len() + piece.len() <= USAGE_READ {
                self.body.extend_from_slice(piece);
            }
            return;
        }
        let mut rest = piece;
        while !rest.is_empty() {
            let end = rest.iter().position(|&b| b == b'\n');
            let (part, next) = match end {
                Some(i) => (&rest[..i], &rest[i + 1..]),
                None => (rest, &[][..]),
            };
            let room = LINE_HEAD.saturating_sub(self.line.len());
            self.line.extend_from_slice(&part[..part.len().min(room)]);
            if end.is_some() {
                if let Some(data) = self.line.strip_prefix(b"data:")
                    && !data.trim_ascii_start().starts_with(b"[DONE]")
                {
                    self.events += 1;
                }
                self.line.clear();
            }
            rest = next;
        }
    }

    /// The tokens the answer carried, when it says.
    fn tokens(&self) -> Option<u64> {
        if self.streamed {
            return Some(self.events);
        }
        let v: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        v.get("usage")?.get("completion_tokens")?.as_u64()
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        let now = Instant::now();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        let tokens = self.tokens();
        let tokens_per_s = match (tokens, self.first) {
            (Some(n), Some(first)) if n >= 2 && now > first => {
                Some((n - 1) as f64 / (now - first).as_secs_f64())
            }
            _ => None,
        };
        self.metrics.served(Served {
            model: std::mem::take(&mut self.model),
            path: std::mem::take(&mut self.path),
            status: self.status,
            arrived_unix_ms: self.arrived.unix_ms,
            first_token_ms: self.first.map(|f| ms(f - self.arrived.at)),
            total_ms: ms(now - self.arrived.at),
            tokens,
            tokens_per_s,
            cut_off: !self.ended,
        });
    }
}

/// A response body that keeps its request's claim until it is dropped.
struct Holding {
    inner: Incoming,
    tally: Tally,
    _held: Held,
}

impl http_body::Body for Holding {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.tally.saw(data);
                }
                if this.inner.is_end_stream() {
                    this.tally.ended = true;
                }
            }
            Poll::Ready(None) => this.tally.ended = true,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(metrics: &Arc<Metrics>, streamed: bool) -> Tally {
        Tally {
            metrics: metrics.clone(),
            model: "chat".into(),
            path: "/v1/chat/completions".into(),
            status: 200,
            arrived: Arrival::now(),
            first: None,
            ended: false,
            streamed,
            line: Vec::new(),
            events: 0,
            body: Vec::new(),
        }
    }

    #[test]
    fn a_streamed_answer_counts_its_data_events_across_pieces_and_not_done() {
        let metrics = Arc::new(Metrics::new());
        let mut t = tally(&metrics, true);
        for piece in [
            &b"data: {\"a\":1}\n\nda"[..],
            b"ta: {\"b\":2}\n",
            b"\n: a comment\n\ndata:{\"c\":3}\n\ndata: [DO",
            b"NE]\n\n",
        ] {
            t.saw(piece);
        }
        t.ended = true;
        drop(t);
        let served = metrics.traffic().recent;
        assert_eq!(served.len(), 1);
        let s = &served[0];
        assert_eq!((s.tokens, s.cut_off), (Some(3), false));
        assert!(
            s.first_token_ms.is_some() && s.tokens_per_s.is_some(),
            "{s:?}"
        );
    }

    #[test]
    fn an_unstreamed_answer_reads_its_usage_and_a_dropped_one_is_cut_off() {
        let metrics = Arc::new(Metrics::new());
        let mut t = tally(&metrics, false);
        t.saw(br#"{"choices":[],"usage":{"prompt_tokens":5,"#);
        t.saw(br#""completion_tokens":7}}"#);
        t.ended = true;
        drop(t);
        drop(tally(&metrics, false));
        let served = metrics.traffic().recent;
        assert_eq!(served.len(), 2);
        assert_eq!((served[0].tokens, served[0].cut_off), (None, true));
        assert_eq!((served[1].tokens, served[1].cut_off), (Some(7), false));
        assert_eq!(served[0].first_token_ms, None);
    }

    #[test]
    fn connection_headers_are_not_forwarded() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "keep-alive, x-hop".parse().expect("value"),
        );
        h.insert("x-hop", "1".parse().expect("value"));
        h.insert(header::PROXY_AUTHENTICATE, "Basic".parse().expect("value"));
        h.insert("keep-alive", "timeout=5".parse().expect("value"));
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().expect("value"));
        h.insert(header::CONTENT_LENGTH, "12".parse().expect("value"));
        h.insert(header::AUTHORIZATION, "Bearer x".parse().expect("value"));
        h.insert(header::ACCEPT, "text/event-stream".parse().expect("value"));
        let out = end_to_end(&h);
        let mut names: Vec<&str> = out.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["accept", "authorization", "content-length"]);
    }
}
