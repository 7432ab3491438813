//! The sending half of a server stream (Watch, WatchNode, Logs) that does
//! not wait forever for its client. A client that takes nothing (its
//! HTTP/2 window left shut) would otherwise keep the stream's task, its
//! unsent tail or events and a full buffer for as long as it stays
//! connected, on each of its streams. Here a message waits at most
//! [`STALL`] for room; past it the stream is cut: its task ends and frees
//! what it held, and the client, once it reads again, gets what was
//! already buffered, then `RESOURCE_EXHAUSTED` saying why (never a clean
//! end that a tail could be mistaken for).

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::sync::mpsc::error::SendTimeoutError;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

/// How long a message waits for its client to make room.
pub const STALL: Duration = Duration::from_secs(30);

/// Messages buffered per stream.
const CAPACITY: usize = 256;

/// Where a stream's task sends; see the module's words.
#[derive(Debug)]
pub struct Outbox<T> {
    tx: mpsc::Sender<Result<T, Status>>,
    cut: Arc<OnceLock<Status>>,
}

impl<T> Outbox<T> {
    /// Sends `item`, waiting at most [`STALL`] for room. False when the
    /// client went away or the stream was cut: the task should end.
    pub async fn send(&self, item: Result<T, Status>) -> bool {
        match self.tx.send_timeout(item, STALL).await {
            Ok(()) => true,
            Err(SendTimeoutError::Closed(_)) => false,
            Err(SendTimeoutError::Timeout(_)) => {
                let _ = self.cut.set(Status::resource_exhausted(format!(
                    "the client took nothing for {} s: the stream was ended (call again; Watch resumes from the last revision it saw)",
                    STALL.as_secs()
                )));
                false
            }
        }
    }
}

/// The stream a tonic server-streaming call answers with.
pub type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// A stream's outbox and the stream tonic answers with.
pub fn outbox<T: Send + 'static>() -> (Outbox<T>, Streamed<T>) {
    let (tx, rx) = mpsc::channel(CAPACITY);
    let cut = Arc::new(OnceLock::new());
    let stream = Inbox {
        rx: ReceiverStream::new(rx),
        cut: cut.clone(),
        ended: false,
    };
    (Outbox { tx, cut }, Box::pin(stream))
}

/// The receiving half: the messages, then the cut's status if there was
/// one.
struct Inbox<T> {
    rx: ReceiverStream<Result<T, Status>>,
    cut: Arc<OnceLock<Status>>,
    ended: bool,
}

impl<T> Stream for Inbox<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.rx).poll_next(cx) {
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(self.cut.get().cloned().map(Err))
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt as _;

    #[tokio::test(start_paused = true)]
    async fn a_client_that_takes_nothing_is_cut_after_the_stall_and_told_why() {
        let (out, mut stream) = outbox::<u32>();
        let mut sent = 0;
        while out.send(Ok(sent)).await {
            sent += 1;
        }
        // The buffer filled, then one more waited STALL (paused time) and
        // was not sent.
        assert_eq!(sent as usize, CAPACITY);
        drop(out);
        let mut got = 0;
        let last = loop {
            match stream.next().await {
                Some(Ok(_)) => got += 1,
                Some(Err(s)) => break s,
                None => panic!("ended cleanly after {got}: a cut must say so"),
            }
        };
        assert_eq!(got, CAPACITY);
        assert_eq!(last.code(), tonic::Code::ResourceExhausted);
        assert!(last.message().contains("took nothing for 30 s"), "{last:?}");
        assert!(stream.next().await.is_none());
    }

    #[tokio::test]
    async fn a_stream_that_ends_without_a_cut_ends_cleanly() {
        let (out, mut stream) = outbox::<u32>();
        assert!(out.send(Ok(1)).await);
        drop(out);
        assert_eq!(stream.next().await.map(|r| r.ok()), Some(Some(1)));
        assert!(stream.next().await.is_none());
    }
}
