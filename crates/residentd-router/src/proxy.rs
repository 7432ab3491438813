//! Forwarding one request to a model's server on loopback and its answer
//! back, chunk by chunk as the server writes it (Server-Sent Events pass
//! through unbuffered). The answer's body carries the request's [`Held`]
//! claim: when the body has been sent, or the client went away and the
//! body is dropped (which also closes the upstream connection, cancelling
//! the generation), the hold and the concurrency permit go with it.

use std::pin::Pin;
use std::task::{Context, Poll};

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
use crate::models::Held;

/// The HTTP/1 client of the models' servers (connections are kept alive
/// and reused).
pub type Upstream = Client<HttpConnector, Full<Bytes>>;

/// A client for the models' servers.
pub fn upstream() -> Upstream {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
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
/// server; answers its response with a body that ends the hold.
pub async fn forward(
    client: &Upstream,
    held: Held,
    method: Method,
    path_and_query: &str,
    headers: &HeaderMap,
    body: Bytes,
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
    *req.headers_mut() = sent;
    let response = client.request(req).await.map_err(|e| {
        RouterError::upstream(&held.model.name, format!("its server did not answer: {e}"))
    })?;
    let (mut parts, incoming) = response.into_parts();
    // The model server's Content-Length stands (also for HEAD and 304,
    // whose bodies are empty).
    parts.headers = end_to_end(&parts.headers);
    let body = Body::new(Holding {
        inner: incoming,
        _held: held,
    });
    Ok(Response::from_parts(parts, body))
}

/// A response body that keeps its request's claim until it is dropped.
struct Holding {
    inner: Incoming,
    _held: Held,
}

impl http_body::Body for Holding {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
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
