//! Any bytes as what a client sends on the Unix socket: the authority
//! layer's rewriter never panics, and where the socket cuts the bytes (the
//! first byte picks the cut) never changes what reaches h2.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use residentd::authority::Rewriter;

fn rewrite(pieces: &[&[u8]]) -> Vec<u8> {
    let mut r = Rewriter::new();
    let (mut pending, mut out) = (BytesMut::new(), BytesMut::new());
    for piece in pieces {
        pending.extend_from_slice(piece);
        r.feed(&mut pending, &mut out);
    }
    out.to_vec()
}

fuzz_target!(|data: &[u8]| {
    let Some((cut, body)) = data.split_first() else {
        return;
    };
    // The preface first, as every client sends it, then the fuzzer's bytes.
    let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    input.extend_from_slice(body);
    let at = usize::from(*cut) % input.len();
    let (a, b) = input.split_at(at);
    assert_eq!(rewrite(&[a, b]), rewrite(&[&input]));
});
