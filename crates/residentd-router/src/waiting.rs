//! A streamed request (`"stream": true`) whose model is loading: rather
//! than silence until the model is READY (which proxies and clients time
//! out), it is answered at once with an event stream of SSE comment lines
//! (`: waiting for 'MODEL' to load`), every [`EVERY`], then the model's
//! own events once it answers; a load that fails, or an answer that is
//! not a success, ends the stream with an OpenAI-shaped `error` event. A
//! client that goes away while it waits drops its wait (and so, if it was
//! the last request waiting for the load, the load: `models.rs`).

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{StatusCode, header};
use http_body_util::BodyExt as _;
use tokio::sync::mpsc;

use crate::error::RouterError;

/// A streamed answer that has not begun this long is a wait for a load:
/// its stream begins with a comment.
pub const FIRST: Duration = Duration::from_millis(500);

/// A comment line while the wait goes on.
pub const EVERY: Duration = Duration::from_secs(2);

/// The answer of a streamed request whose `work` (the model held, the
/// request forwarded) has not finished within [`FIRST`]: an event stream
/// that says it waits, then carries the answer.
pub fn stream_while(
    model: String,
    mut work: tokio::task::JoinHandle<Result<Response, RouterError>>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        let comment = Bytes::from(format!(": waiting for '{model}' to load\n\n"));
        if tx.send(Ok(comment.clone())).await.is_err() {
            work.abort();
            return;
        }
        let done = loop {
            tokio::select! {
                done = &mut work => break done,
                () = tokio::time::sleep(EVERY) => {
                    if tx.send(Ok(comment.clone())).await.is_err() {
                        // The client went away: so does its wait.
                        work.abort();
                        return;
                    }
                }
            }
        };
        let response = match done {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return error_event(&tx, &e.body()).await,
            Err(e) => {
                let body = RouterError::agent(format!("the request's task failed: {e}")).body();
                return error_event(&tx, &body).await;
            }
        };
        if !response.status().is_success() {
            let status = response.status();
            let text = response
                .into_body()
                .collect()
                .await
                .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                .unwrap_or_default();
            let body = serde_json::from_str::<serde_json::Value>(&text).unwrap_or_else(|_| {
                serde_json::json!({"error": {"message": text, "type": "upstream_error", "code": status.as_u16().to_string()}})
            });
            return error_event(&tx, &body).await;
        }
        let mut body = response.into_body();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => {
                    if let Ok(data) = f.into_data()
                        && tx.send(Ok(data)).await.is_err()
                    {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                    return;
                }
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut response = Response::new(Body::from_stream(stream));
    *response.status_mut() = StatusCode::OK;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        "text/event-stream".parse().expect("a value"),
    );
    h.insert(header::CACHE_CONTROL, "no-cache".parse().expect("a value"));
    response
}

/// Ends a stream with an `error` event and `[DONE]`.
async fn error_event(tx: &mpsc::Sender<Result<Bytes, std::io::Error>>, body: &serde_json::Value) {
    let text = format!("data: {body}\n\ndata: [DONE]\n\n");
    let _ = tx.send(Ok(Bytes::from(text))).await;
}
