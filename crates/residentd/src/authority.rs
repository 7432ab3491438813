//! Stock gRPC clients over the Unix socket, whatever `:authority` they send.
//!
//! grpc-core (Python, C++, Ruby, PHP) and grpc-java send the socket path
//! (`/run/residentd/residentd.sock`, sometimes percent-encoded) as the
//! HTTP/2 `:authority` of every request. The HTTP/2 server under tonic (h2)
//! parses it as a URI authority, finds it malformed and resets the stream,
//! so such a client could not make a single call. Over a Unix socket the
//! authority names nothing, so this layer, wrapped around each accepted
//! Unix connection, rewrites an authority that does not parse into
//! `localhost` before h2 reads it.
//!
//! Header blocks are HPACK-compressed with a dynamic table per connection
//! and direction (RFC 7541), so one field cannot be patched in place: the
//! layer decodes every header block the client sends (HEADERS plus its
//! CONTINUATION frames) with a decoder that follows the client's encoder
//! (`hpack.rs`: bounded, and fast on Huffman-coded strings, which the
//! hpack-rs family of crates decodes bit by bit through hash maps),
//! and re-encodes it with literals only. h2's decoder therefore never
//! sees a dynamic-table insertion and its table stays empty, which keeps
//! both sides consistent without tracking the server's state. Every other
//! frame, and the server-to-client direction, pass through unchanged.
//!
//! A client sends one authority for all the requests of a connection, so
//! the first header block decides: when it needs no fix (tonic, grpc-go,
//! residentctl), it goes to h2 as it came and so does everything after it,
//! read straight from the socket; h2's table then follows the client's
//! encoder, as without this layer. Only connections that need the fix
//! (grpc-core's socket path) pay for decoding and re-encoding each block.
//!
//! Errors stay h2's to report. A frame that breaks HTTP/2's framing rules
//! around header blocks is forwarded as it came and the layer stops
//! rewriting (each such fault is a connection error, which h2 raises); a
//! header block that does not decode, or decodes to more than
//! [`MAX_HEADER_LIST`], is replaced by one that fails h2's decoder, so h2
//! ends the connection with COMPRESSION_ERROR, as it would have. Fields h2
//! rejects (an upper-case name, a bad `:path`) decode fine and reach h2 as
//! they were, so a malformed request still gets a protocol error.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf as _, BufMut as _, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;
use tonic::transport::server::{Connected, UdsConnectInfo};

/// What replaces an authority that does not parse.
pub const LOCAL_AUTHORITY: &str = "localhost";

/// The client connection preface (RFC 9113, 3.4).
const PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
/// SETTINGS_MAX_FRAME_SIZE of our server: h2's default, which the server
/// keeps (`server.rs` sets it explicitly). Larger frames are the client's
/// error; re-encoded blocks are cut to this size.
pub const MAX_FRAME: usize = 16_384;
/// The header table size h2 allows the client (its default setting).
const HEADER_TABLE_SIZE: usize = 4_096;
/// A bound on one decoded header list (RFC 9113 size: name + value + 32
/// per field), far above the 16 KiB the server accepts, so h2 still
/// decides on every list a real client sends; beyond it the connection
/// ends, since an HPACK block that decodes this large is an attack.
pub const MAX_HEADER_LIST: usize = 256 * 1024;
/// A bound on one header block as sent (HEADERS plus CONTINUATIONs).
const MAX_BLOCK: usize = 64 * MAX_FRAME;

const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// A header block that no HPACK decoder accepts: index 0 (RFC 7541, 6.1).
const UNDECODABLE: [u8; 1] = [0x80];

/// Rewrites the client-to-server byte stream of one HTTP/2 connection.
/// Pure: bytes in, bytes out, so it is tested without sockets.
pub struct Rewriter {
    decoder: hpack::Decoder,
    preface_left: usize,
    /// Bytes of a passed-through frame's payload still to copy.
    passing: usize,
    /// A header block being gathered.
    block: Option<Block>,
    mode: Mode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// No header block yet: the first one decides.
    First,
    Rewrite,
    /// Forwarded as it came (the first header block, which needed no fix,
    /// or a framing fault): the rest goes as is.
    Raw,
    /// An undecodable block was sent on; nothing more is forwarded.
    Ended,
}

/// A HEADERS frame and its CONTINUATIONs, as received and as decoded.
struct Block {
    stream: u32,
    /// END_STREAM and PRIORITY of the HEADERS frame.
    flags: u8,
    priority: Option<[u8; 5]>,
    /// The frames as they came, for forwarding when they break the rules.
    raw: BytesMut,
    fragment: BytesMut,
}

impl std::fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rewriter")
            .field("mode", &self.mode)
            .field("gathering", &self.block.is_some())
            .finish_non_exhaustive()
    }
}

impl Default for Rewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl Rewriter {
    /// A rewriter at the start of a connection.
    pub fn new() -> Self {
        Self {
            decoder: hpack::Decoder::new(HEADER_TABLE_SIZE),
            preface_left: PREFACE_LEN,
            passing: 0,
            block: None,
            mode: Mode::First,
        }
    }

    /// True once the connection has been handed a block that ends it.
    pub fn ended(&self) -> bool {
        self.mode == Mode::Ended
    }

    /// True once everything from here on goes to h2 as it comes.
    pub fn passes_through(&self) -> bool {
        self.mode == Mode::Raw
    }

    /// Consumes what it can of `input` and appends the bytes for the server
    /// to `out`. What remains in `input` is an incomplete frame.
    pub fn feed(&mut self, input: &mut BytesMut, out: &mut BytesMut) {
        loop {
            match self.mode {
                Mode::Ended => {
                    input.clear();
                    return;
                }
                Mode::Raw => {
                    out.extend_from_slice(input);
                    input.clear();
                    return;
                }
                Mode::First | Mode::Rewrite => {}
            }
            let pass = if self.preface_left > 0 {
                &mut self.preface_left
            } else {
                &mut self.passing
            };
            if *pass > 0 {
                let n = (*pass).min(input.len());
                out.extend_from_slice(&input.split_to(n));
                *pass -= n;
                if *pass > 0 {
                    return;
                }
                continue;
            }
            if input.len() < FRAME_HEADER_LEN {
                return;
            }
            let len =
                usize::from(input[0]) << 16 | usize::from(input[1]) << 8 | usize::from(input[2]);
            let kind = input[3];
            let gathering = self.block.is_some();
            if kind != HEADERS && kind != CONTINUATION && !gathering {
                out.extend_from_slice(&input.split_to(FRAME_HEADER_LEN));
                self.passing = len;
                continue;
            }
            let out_of_place = if gathering {
                kind != CONTINUATION
            } else {
                kind != HEADERS
            };
            if len > MAX_FRAME || out_of_place {
                // Too large, a frame between a block's frames, or a
                // CONTINUATION without a block: connection errors for h2.
                self.forward_as_received(out);
                continue;
            }
            if input.len() < FRAME_HEADER_LEN + len {
                return;
            }
            let frame = input.split_to(FRAME_HEADER_LEN + len);
            self.header_frame(frame, out);
        }
    }

    /// Hands h2 what the client sent, from the gathered block on, and
    /// stops rewriting.
    fn forward_as_received(&mut self, out: &mut BytesMut) {
        if let Some(block) = self.block.take() {
            out.extend_from_slice(&block.raw);
        }
        self.mode = Mode::Raw;
    }

    /// One complete HEADERS or CONTINUATION frame.
    fn header_frame(&mut self, frame: BytesMut, out: &mut BytesMut) {
        let flags = frame[4];
        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[FRAME_HEADER_LEN..];
        if let Some(block) = self.block.as_mut()
            && block.stream != stream
        {
            // A CONTINUATION of another stream.
            block.raw.extend_from_slice(&frame);
            return self.forward_as_received(out);
        }
        let block = match self.block.as_mut() {
            Some(block) => block,
            None => match open_block(stream, flags, payload) {
                Some(block) => self.block.insert(block),
                None => {
                    out.extend_from_slice(&frame);
                    self.mode = Mode::Raw;
                    return;
                }
            },
        };
        if frame[3] == CONTINUATION {
            block.fragment.extend_from_slice(payload);
        }
        block.raw.extend_from_slice(&frame);
        if block.raw.len() > MAX_BLOCK {
            return self.forward_as_received(out);
        }
        if flags & END_HEADERS != 0 {
            let block = self.block.take().expect("gathering");
            self.finish(block, out);
        }
    }

    /// Decodes a whole block, fixes the authority, and emits the block
    /// re-encoded as HEADERS plus CONTINUATIONs; the connection's first
    /// block, when it needs no fix, goes as it came, and so does the rest.
    fn finish(&mut self, block: Block, out: &mut BytesMut) {
        let first = self.mode == Mode::First;
        self.mode = Mode::Rewrite;
        let encoded = match reencode(&mut self.decoder, &block.fragment) {
            Ok((_, false)) if first => {
                out.extend_from_slice(&block.raw);
                self.mode = Mode::Raw;
                return;
            }
            Ok((encoded, _)) => encoded,
            Err(()) => {
                self.mode = Mode::Ended;
                UNDECODABLE.to_vec()
            }
        };
        let mut first = Vec::with_capacity(MAX_FRAME);
        if let Some(p) = block.priority {
            first.extend_from_slice(&p);
        }
        let room = MAX_FRAME - first.len();
        let (head, mut rest) = encoded.split_at(room.min(encoded.len()));
        first.extend_from_slice(head);
        let mut flags = block.flags;
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        put_frame(out, HEADERS, flags, block.stream, &first);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(MAX_FRAME.min(rest.len()));
            rest = tail;
            let flags = if rest.is_empty() { END_HEADERS } else { 0 };
            put_frame(out, CONTINUATION, flags, block.stream, chunk);
        }
    }
}

/// The start of a block from its HEADERS frame; `None` when the frame's
/// padding or priority fields do not fit in it.
fn open_block(stream: u32, flags: u8, payload: &[u8]) -> Option<Block> {
    let mut body = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        pad = usize::from(*body.first()?);
        body = &body[1..];
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        priority = Some(<[u8; 5]>::try_from(body.get(..5)?).ok()?);
        body = &body[5..];
    }
    let fragment = body.get(..body.len().checked_sub(pad)?)?;
    Some(Block {
        stream,
        flags: flags & (END_STREAM | PRIORITY),
        priority,
        raw: BytesMut::new(),
        fragment: BytesMut::from(fragment),
    })
}

/// Decodes a block and re-encodes each field as it comes, as a literal
/// without indexing (RFC 7541, 6.2.2), so nothing enters the server's
/// dynamic table; an `:authority` that does not parse becomes
/// [`LOCAL_AUTHORITY`]; true when one did. Err when the block does not
/// decode or decodes beyond [`MAX_HEADER_LIST`].
fn reencode(decoder: &mut hpack::Decoder, fragment: &[u8]) -> Result<(Vec<u8>, bool), ()> {
    let mut out = Vec::with_capacity(fragment.len() * 2);
    let mut size = 0usize;
    let mut fixed = false;
    decoder
        .decode(fragment, |name, value| {
            size += name.len() + value.len() + 32;
            let value = if name == b":authority" && !valid_authority(value) {
                fixed = true;
                LOCAL_AUTHORITY.as_bytes()
            } else {
                value
            };
            out.push(0);
            for s in [name, value] {
                put_integer(&mut out, s.len(), 7);
                out.extend_from_slice(s);
            }
            size <= MAX_HEADER_LIST
        })
        .map_err(|_| ())?;
    Ok((out, fixed))
}

/// Whether h2 accepts `value` as an authority.
fn valid_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// An HPACK integer with a `prefix`-bit prefix and zero high bits (RFC
/// 7541, 5.1).
fn put_integer(out: &mut Vec<u8>, mut value: usize, prefix: u8) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(value as u8);
        return;
    }
    out.push(max as u8);
    value -= max;
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_frame(out: &mut BytesMut, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = u32::try_from(payload.len()).expect("a frame of at most MAX_FRAME bytes");
    out.put_slice(&len.to_be_bytes()[1..]);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream);
    out.put_slice(payload);
}

/// A Unix connection whose client-to-server header blocks pass through a
/// [`Rewriter`]; writes go straight to the socket.
#[derive(Debug)]
pub struct AuthorityFix {
    inner: UnixStream,
    /// The caller's supplementary groups, taken from the socket when it
    /// connected (`SO_PEERGROUPS`): never read again later from a pid
    /// that may have been reused.
    groups: Option<Vec<u32>>,
    rewriter: Rewriter,
    /// Received, not yet rewritten (an incomplete frame).
    input: BytesMut,
    /// Rewritten, not yet read by the server.
    output: BytesMut,
    eof: bool,
}

impl AuthorityFix {
    /// Wraps an accepted connection.
    pub fn new(inner: UnixStream) -> Self {
        let groups = peer_groups(&inner);
        Self {
            inner,
            groups,
            rewriter: Rewriter::new(),
            input: BytesMut::new(),
            output: BytesMut::new(),
            eof: false,
        }
    }
}

/// Who called over a Unix connection: its credentials (`SO_PEERCRED`)
/// and supplementary groups (`SO_PEERGROUPS`), both as they were when it
/// connected.
#[derive(Debug, Clone)]
pub struct UnixPeer {
    /// tonic's: uid, gid, pid.
    pub uds: UdsConnectInfo,
    /// Its supplementary groups; `None` where the kernel cannot say
    /// (before Linux 4.13).
    pub groups: Option<Vec<u32>>,
}

impl Connected for AuthorityFix {
    type ConnectInfo = UnixPeer;

    fn connect_info(&self) -> Self::ConnectInfo {
        UnixPeer {
            uds: self.inner.connect_info(),
            groups: self.groups.clone(),
        }
    }
}

/// The supplementary groups of the process at the other end of `stream`,
/// as they were when it connected (`SO_PEERGROUPS`, Linux 4.13).
fn peer_groups(stream: &UnixStream) -> Option<Vec<u32>> {
    use std::os::fd::AsRawFd as _;
    const SO_PEERGROUPS: nix::libc::c_int = 59;
    let fd = stream.as_raw_fd();
    let mut groups: Vec<nix::libc::gid_t> = vec![0; 64];
    for _ in 0..4 {
        let mut len =
            (groups.len() * std::mem::size_of::<nix::libc::gid_t>()) as nix::libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `groups`,
        // which holds that many, and says in `len` how many it wrote (or,
        // with ERANGE, how many it needs).
        let r = unsafe {
            nix::libc::getsockopt(
                fd,
                nix::libc::SOL_SOCKET,
                SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<nix::libc::gid_t>();
        if r == 0 {
            groups.truncate(n);
            return Some(groups);
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(nix::libc::ERANGE) {
            return None;
        }
        groups.resize(n.max(groups.len() * 2), 0);
    }
    None
}

impl AsyncRead for AuthorityFix {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        loop {
            if me.output.is_empty() && me.input.is_empty() && me.rewriter.passes_through() {
                // Nothing of ours left to hand over: the socket's bytes go
                // to h2 without a copy.
                return Pin::new(&mut me.inner).poll_read(cx, buf);
            }
            if !me.output.is_empty() {
                let n = me.output.len().min(buf.remaining());
                buf.put_slice(&me.output[..n]);
                me.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if me.eof || me.rewriter.ended() {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut me.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                // A frame cut short by the client's close: h2 sees the
                // close where the client made it.
                me.eof = true;
                continue;
            }
            me.input.extend_from_slice(read.filled());
            me.rewriter.feed(&mut me.input, &mut me.output);
        }
    }
}

impl AsyncWrite for AuthorityFix {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

mod hpack;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod peer_groups_tests {
    /// The groups the kernel gives for the peer of a connected socket are
    /// the connecting process's own, taken at connect.
    #[tokio::test]
    async fn a_callers_groups_are_taken_at_connect() {
        let (a, _b) = tokio::net::UnixStream::pair().expect("a pair");
        let mine: Vec<u32> = nix::unistd::getgroups()
            .expect("getgroups")
            .iter()
            .map(|g| g.as_raw())
            .collect();
        let mut got = super::peer_groups(&a).expect("SO_PEERGROUPS (Linux 4.13)");
        got.sort_unstable();
        let mut want = mine;
        want.sort_unstable();
        assert_eq!(got, want);
    }
}
