//! Per-instance log capture: stdout and stderr read by line into a bounded
//! ring (for `tail`) and broadcast to followers. Over-long lines are split,
//! invalid UTF-8 is replaced, and a child that floods its pipes costs the
//! agent no more memory than the ring's bound.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::net::unix::pipe;
use tokio::sync::broadcast;

/// Which pipe a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// One captured line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// Position in this instance's log, from 1, across restarts.
    pub seq: u64,
    /// The pipe.
    pub stream: Stream,
    /// The text, without its newline.
    pub line: String,
}

/// Bounds of one ring.
#[derive(Debug, Clone, Copy)]
pub struct LogLimits {
    /// Lines kept for `tail`.
    pub lines: usize,
    /// Bytes of text kept for `tail`.
    pub bytes: usize,
    /// Longer lines are split at this many bytes.
    pub max_line: usize,
    /// Lines a follower may fall behind before it is told it lagged.
    pub follow_buffer: usize,
}

impl Default for LogLimits {
    fn default() -> Self {
        Self {
            lines: 2_000,
            bytes: 1 << 20,
            max_line: 16 << 10,
            follow_buffer: 1_024,
        }
    }
}

#[derive(Debug, Default)]
struct Ring {
    lines: VecDeque<LogLine>,
    bytes: usize,
    next_seq: u64,
    /// Made when the first follower comes, dropped when the last has gone:
    /// its buffer is allocated whole, which a node of hundreds of quiet
    /// instances should not pay for.
    followers: Option<broadcast::Sender<LogLine>>,
}

/// The log of one instance.
#[derive(Debug)]
pub struct LogRing {
    limits: LogLimits,
    ring: Mutex<Ring>,
    /// Woken at every line (the readiness probe listens: a server's line
    /// often says it now listens).
    wrote: tokio::sync::Notify,
}

/// Bytes read from a pipe at a time.
const CHUNK: usize = 16 << 10;

impl LogRing {
    /// An empty ring.
    pub fn new(limits: LogLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            ring: Mutex::new(Ring::default()),
            wrote: tokio::sync::Notify::new(),
        })
    }

    fn push(&self, stream: Stream, line: String) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.next_seq += 1;
        let entry = LogLine {
            seq: ring.next_seq,
            stream,
            line,
        };
        ring.bytes += entry.line.len();
        // Sent under the lock so followers see lines in seq order.
        match &ring.followers {
            Some(tx) if tx.receiver_count() > 0 => {
                let _ = tx.send(entry.clone());
            }
            Some(_) => ring.followers = None,
            None => {}
        }
        ring.lines.push_back(entry);
        while ring.lines.len() > self.limits.lines || ring.bytes > self.limits.bytes {
            match ring.lines.pop_front() {
                Some(old) => ring.bytes -= old.line.len(),
                None => break,
            }
        }
        drop(ring);
        self.wrote.notify_waiters();
    }

    /// Notified at every new line; nothing is stored for a waiter that
    /// comes later.
    pub fn wrote(&self) -> &tokio::sync::Notify {
        &self.wrote
    }

    /// The last `n` lines, oldest first.
    pub fn tail(&self, n: usize) -> Vec<LogLine> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let skip = ring.lines.len().saturating_sub(n);
        ring.lines.iter().skip(skip).cloned().collect()
    }

    /// The last `n` lines and a subscription to every later line, with no
    /// gap and no repeat between the two.
    pub fn tail_and_follow(&self, n: usize) -> (Vec<LogLine>, broadcast::Receiver<LogLine>) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let buffer = self.limits.follow_buffer.max(1);
        let rx = ring
            .followers
            .get_or_insert_with(|| broadcast::channel(buffer).0)
            .subscribe();
        let skip = ring.lines.len().saturating_sub(n);
        (ring.lines.iter().skip(skip).cloned().collect(), rx)
    }

    /// Bytes of text held now (at most `limits.bytes`).
    pub fn held_bytes(&self) -> usize {
        self.ring.lock().unwrap_or_else(|e| e.into_inner()).bytes
    }

    /// Reads a run's stdout and stderr to their ends, line by line, into
    /// the ring: one task for both pipes, so a run's end costs one wake-up
    /// when both close together. Nothing is held for a pipe while it is
    /// quiet: the read buffer lives on the stack of the call that drains
    /// what is ready.
    pub async fn capture(
        self: Arc<Self>,
        stdout: Option<pipe::Receiver>,
        stderr: Option<pipe::Receiver>,
    ) {
        let mut pipes = [(Stream::Stdout, stdout), (Stream::Stderr, stderr)]
            .map(|(stream, pipe)| (stream, pipe, Lines::new(self.limits.max_line)));
        loop {
            let ready = match (&pipes[0].1, &pipes[1].1) {
                (None, None) => break,
                (Some(out), None) => out.readable().await,
                (None, Some(err)) => err.readable().await,
                (Some(out), Some(err)) => tokio::select! {
                    r = out.readable() => r,
                    r = err.readable() => r,
                },
            };
            // Both are read: a pipe not ready costs nothing (tokio knows it
            // is not, and makes no system call). When the wait itself
            // failed (the runtime is going), what was read is kept.
            for (stream, pipe, lines) in &mut pipes {
                let Some(p) = pipe else { continue };
                let open = matches!(self.drain_ready(p, *stream, lines), Ok(true));
                if !open || ready.is_err() {
                    lines.finish(&self, *stream);
                    *pipe = None;
                }
            }
        }
    }

    /// Reads what `pipe` has now; false at its end.
    fn drain_ready(
        &self,
        pipe: &pipe::Receiver,
        stream: Stream,
        lines: &mut Lines,
    ) -> std::io::Result<bool> {
        let mut chunk = [0u8; CHUNK];
        loop {
            match pipe.try_read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => lines.feed(self, stream, &chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Adds the lines of `bytes` (a last line without a newline included).
    pub fn push_bytes(&self, stream: Stream, bytes: &[u8]) {
        let mut lines = Lines::new(self.limits.max_line);
        lines.feed(self, stream, bytes);
        lines.finish(self, stream);
    }
}

/// Cuts a byte stream into lines of at most `max` bytes.
#[derive(Debug)]
struct Lines {
    pending: Vec<u8>,
    max: usize,
}

impl Lines {
    fn new(max: usize) -> Self {
        Self {
            pending: Vec::new(),
            max: max.max(1),
        }
    }

    fn feed(&mut self, ring: &LogRing, stream: Stream, mut rest: &[u8]) {
        while !rest.is_empty() {
            let room = self.max - self.pending.len();
            let window = &rest[..rest.len().min(room)];
            match window.iter().position(|b| *b == b'\n') {
                Some(i) => {
                    self.pending.extend_from_slice(&window[..i]);
                    self.emit(ring, stream);
                    rest = &rest[i + 1..];
                }
                None => {
                    self.pending.extend_from_slice(window);
                    rest = &rest[window.len()..];
                    if self.pending.len() == self.max {
                        self.emit(ring, stream);
                    }
                }
            }
        }
        if self.pending.is_empty() && self.pending.capacity() > 1024 {
            // A long line passed; a quiet instance keeps no big buffer.
            self.pending = Vec::new();
        }
    }

    fn finish(&mut self, ring: &LogRing, stream: Stream) {
        if !self.pending.is_empty() {
            self.emit(ring, stream);
        }
    }

    fn emit(&mut self, ring: &LogRing, stream: Stream) {
        if self.pending.last() == Some(&b'\r') {
            self.pending.pop();
        }
        let line = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        ring.push(stream, line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(lines: usize, bytes: usize, max_line: usize) -> Arc<LogRing> {
        LogRing::new(LogLimits {
            lines,
            bytes,
            max_line,
            follow_buffer: 16,
        })
    }

    async fn feed(r: &Arc<LogRing>, input: &[u8]) {
        r.push_bytes(Stream::Stdout, input);
    }

    fn texts(lines: Vec<LogLine>) -> Vec<String> {
        lines.into_iter().map(|l| l.line).collect()
    }

    #[tokio::test]
    async fn splits_lines_long_lines_and_replaces_bad_utf8() {
        let r = ring(100, 1 << 20, 4);
        feed(&r, b"ab\ncdefgh\r\n\xffz\nlast").await;
        assert_eq!(texts(r.tail(10)), ["ab", "cdef", "gh", "\u{fffd}z", "last"]);
    }

    #[tokio::test]
    async fn keeps_the_last_lines_within_both_bounds() {
        let r = ring(3, 1 << 20, 64);
        feed(&r, b"1\n2\n3\n4\n5\n").await;
        assert_eq!(texts(r.tail(10)), ["3", "4", "5"]);
        assert_eq!(texts(r.tail(2)), ["4", "5"]);
        let r = ring(100, 6, 64);
        feed(&r, b"aaa\nbbb\nccc\n").await;
        assert_eq!(texts(r.tail(10)), ["bbb", "ccc"]);
        assert!(r.held_bytes() <= 6);
    }

    #[tokio::test]
    async fn one_capture_reads_both_pipes_to_their_ends_whichever_closes_first() {
        use tokio::io::AsyncWriteExt as _;
        let r = ring(100, 1 << 20, 64);
        let (mut out_tx, out_rx) = pipe::pipe().expect("pipe");
        let (mut err_tx, err_rx) = pipe::pipe().expect("pipe");
        let capture = tokio::spawn(r.clone().capture(Some(out_rx), Some(err_rx)));
        err_tx.write_all(b"e1\ne2 unfinished").await.expect("write");
        drop(err_tx);
        // Read on with stderr closed: the capture goes on with stdout.
        out_tx.write_all(b"o1\n").await.expect("write");
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            // Enabled before the look, so a line pushed in between wakes it.
            let wrote = r.wrote().notified();
            tokio::pin!(wrote);
            wrote.as_mut().enable();
            if r.tail(10).len() >= 3 {
                break;
            }
            let waited = tokio::time::timeout_at(deadline, wrote).await;
            assert!(waited.is_ok(), "lines not read: {:?}", r.tail(10));
        }
        out_tx.write_all(b"o2\n").await.expect("write");
        drop(out_tx);
        tokio::time::timeout(std::time::Duration::from_secs(10), capture)
            .await
            .expect("the capture ends when both pipes have")
            .expect("capture");
        let mut by_stream: Vec<(Stream, String)> =
            r.tail(10).into_iter().map(|l| (l.stream, l.line)).collect();
        by_stream.sort_by_key(|(s, _)| *s == Stream::Stderr);
        assert_eq!(
            by_stream,
            [
                (Stream::Stdout, "o1".to_string()),
                (Stream::Stdout, "o2".to_string()),
                (Stream::Stderr, "e1".to_string()),
                (Stream::Stderr, "e2 unfinished".to_string()),
            ]
        );
    }

    #[tokio::test]
    async fn followers_continue_where_the_tail_ends() {
        let r = ring(100, 1 << 20, 64);
        feed(&r, b"old\n").await;
        let (tail, mut rx) = r.tail_and_follow(5);
        feed(&r, b"new\n").await;
        assert_eq!(texts(tail), ["old"]);
        let next = rx.recv().await.expect("a followed line");
        assert_eq!((next.seq, next.line.as_str()), (2, "new"));
    }
}
