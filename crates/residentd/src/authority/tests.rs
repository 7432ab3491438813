//! The rewriter on hand-made byte streams: what a client's HPACK encoder
//! may send (incremental indexing, dynamic-table references, padding,
//! priority, CONTINUATION) must reach h2 as the same header lists, with
//! only an unparseable `:authority` changed.

use loona_hpack::Decoder;

use super::*;

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const SETTINGS: u8 = 0x4;

/// A client-side HPACK block builder that uses the dynamic table.
#[derive(Default)]
struct Block(Vec<u8>);

impl Block {
    /// A static or dynamic table reference (RFC 7541, 6.1).
    fn indexed(mut self, index: usize) -> Self {
        loona_hpack::encoder::encode_integer_into(index, 7, 0x80, &mut self.0).expect("vec");
        self
    }
    /// A literal with a new name, added to the dynamic table (6.2.1).
    fn indexing(mut self, name: &str, value: &str) -> Self {
        self.0.push(0x40);
        self.string(name).string(value)
    }
    /// A literal with a new name, never indexed (6.2.3).
    fn never(mut self, name: &str, value: &str) -> Self {
        self.0.push(0x10);
        self.string(name).string(value)
    }
    fn string(mut self, s: &str) -> Self {
        loona_hpack::encoder::encode_integer_into(s.len(), 7, 0, &mut self.0).expect("vec");
        self.0.extend_from_slice(s.as_bytes());
        self
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = BytesMut::new();
    put_frame(&mut out, kind, flags, stream, payload);
    out.to_vec()
}

/// The preface and an empty SETTINGS frame, as every client opens.
fn opening() -> Vec<u8> {
    let mut v = PREFACE.to_vec();
    v.extend(frame(SETTINGS, 0, 0, &[]));
    v
}

/// Feeds `input` in pieces of `step` bytes, as a socket may deliver it.
fn rewrite_in_steps(input: &[u8], step: usize) -> (Vec<u8>, Rewriter) {
    let mut r = Rewriter::new();
    let (mut pending, mut out) = (BytesMut::new(), BytesMut::new());
    for piece in input.chunks(step) {
        pending.extend_from_slice(piece);
        r.feed(&mut pending, &mut out);
    }
    (out.to_vec(), r)
}

fn rewrite(input: &[u8]) -> Vec<u8> {
    let (out, _) = rewrite_in_steps(input, input.len().max(1));
    out
}

/// What h2 would see: the frames after the opening, header blocks decoded
/// with a decoder of its own (`None` for a block that does not decode).
#[derive(Debug, PartialEq)]
enum Seen {
    Headers {
        stream: u32,
        flags: u8,
        priority: Option<Vec<u8>>,
        fields: Option<Vec<(String, String)>>,
    },
    Other {
        kind: u8,
        payload: Vec<u8>,
    },
}

fn frames_of(out: &[u8]) -> Vec<Seen> {
    assert_eq!(&out[..24], PREFACE, "the preface passes unchanged");
    let mut rest = &out[24..];
    let mut decoder = Decoder::new();
    let mut seen = Vec::new();
    // (stream, flags, priority, block) of a block being gathered.
    type Gathering = (u32, u8, Option<Vec<u8>>, Vec<u8>);
    let mut gathering: Option<Gathering> = None;
    while !rest.is_empty() {
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        assert!(len <= MAX_FRAME, "no frame beyond the server's frame size");
        let (kind, flags) = (rest[3], rest[4]);
        let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
        let payload = rest[9..9 + len].to_vec();
        rest = &rest[9 + len..];
        match kind {
            HEADERS => {
                assert!(gathering.is_none());
                assert_eq!(flags & PADDED, 0, "re-encoded blocks carry no padding");
                let (priority, body) = if flags & PRIORITY != 0 {
                    (Some(payload[..5].to_vec()), payload[5..].to_vec())
                } else {
                    (None, payload)
                };
                gathering = Some((stream, flags & !END_HEADERS, priority, body));
            }
            CONTINUATION => {
                let g = gathering.as_mut().expect("a CONTINUATION follows HEADERS");
                assert_eq!(g.0, stream);
                g.3.extend_from_slice(&payload);
            }
            _ => {
                assert!(gathering.is_none(), "nothing between a block's frames");
                seen.push(Seen::Other { kind, payload });
                continue;
            }
        }
        if flags & END_HEADERS != 0 {
            let (stream, flags, priority, block) = gathering.take().expect("gathering");
            let fields = decoder.decode(&block).ok().map(|f| {
                f.into_iter()
                    .map(|(n, v)| {
                        (
                            String::from_utf8(n).expect("utf-8"),
                            String::from_utf8(v).expect("utf-8"),
                        )
                    })
                    .collect()
            });
            seen.push(Seen::Headers {
                stream,
                flags,
                priority,
                fields,
            });
        }
    }
    seen
}

fn fields(list: &[(&str, &str)]) -> Option<Vec<(String, String)>> {
    Some(
        list.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
    )
}

/// `request(Some(socket path))` as h2 should see it.
const REWRITTEN: [(&str, &str); 6] = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/pkg.Svc/Call"),
    (":authority", LOCAL_AUTHORITY),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
];

fn request(authority: Option<&str>) -> Block {
    // :method POST and :scheme http from the static table; the rest enters
    // the dynamic table, as grpc-core's encoder does.
    let b = Block::default()
        .indexed(3)
        .indexed(6)
        .indexing(":path", "/pkg.Svc/Call");
    let b = match authority {
        Some(a) => b.indexing(":authority", a),
        None => b,
    };
    b.indexing("content-type", "application/grpc")
        .indexing("te", "trailers")
}

#[test]
fn a_socket_path_becomes_localhost_and_dynamic_references_still_resolve() {
    let mut input = opening();
    let first = request(Some("/run/residentd/residentd.sock"));
    input.extend(frame(HEADERS, END_HEADERS, 1, &first.0));
    input.extend(frame(DATA, END_STREAM, 1, b"\0\0\0\0\0"));
    // The second call names every field by its dynamic index (62 is the
    // newest entry: te, then content-type, :authority, :path).
    let second = Block::default()
        .indexed(3)
        .indexed(6)
        .indexed(65)
        .indexed(64)
        .indexed(63)
        .indexed(62)
        .never("x-secret", "s");
    input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &second.0));

    let want = |extra: &[(&str, &str)]| {
        let mut all = REWRITTEN.to_vec();
        all.extend_from_slice(extra);
        fields(&all)
    };
    let out = rewrite(&input);
    let seen = frames_of(&out);
    assert_eq!(
        seen,
        vec![
            Seen::Other {
                kind: SETTINGS,
                payload: vec![]
            },
            Seen::Headers {
                stream: 1,
                flags: 0,
                priority: None,
                fields: want(&[])
            },
            Seen::Other {
                kind: DATA,
                payload: b"\0\0\0\0\0".to_vec()
            },
            Seen::Headers {
                stream: 3,
                flags: END_STREAM,
                priority: None,
                fields: want(&[("x-secret", "s")])
            },
        ]
    );
    // However the socket cuts the bytes, the result is the same.
    for step in [1, 2, 7, 9, 10, 64] {
        assert_eq!(rewrite_in_steps(&input, step).0, out, "in steps of {step}");
    }
}

#[test]
fn valid_authorities_and_none_at_all_pass_unchanged() {
    for authority in [
        Some("localhost"),
        Some("localhost:7070"),
        Some("%2Frun%2Fa.sock"),
        None,
    ] {
        let mut input = opening();
        input.extend(frame(HEADERS, END_HEADERS, 1, &request(authority).0));
        let seen = frames_of(&rewrite(&input));
        let Seen::Headers {
            fields: Some(f), ..
        } = &seen[1]
        else {
            panic!("a decodable block: {seen:?}");
        };
        let got = f
            .iter()
            .find(|(n, _)| n == ":authority")
            .map(|(_, v)| v.as_str());
        let want = match authority {
            Some(a) if valid_authority(a.as_bytes()) => Some(a),
            Some(_) => Some(LOCAL_AUTHORITY),
            None => None,
        };
        assert_eq!(got, want, "authority {authority:?}");
        assert!(got.is_none_or(|a| valid_authority(a.as_bytes())));
    }
}

#[test]
fn a_connection_whose_first_block_needs_no_fix_goes_to_h2_as_sent() {
    // The first block is fine: it and everything after it reach h2 byte
    // for byte, the later blocks' references into the client's dynamic
    // table included, since h2's table now follows the client's encoder.
    // A later block's bad authority is h2's to refuse, as without the
    // layer (a client sends one authority per connection).
    let mut input = opening();
    input.extend(frame(
        HEADERS,
        END_HEADERS,
        1,
        &request(Some("localhost")).0,
    ));
    input.extend(frame(DATA, 0, 1, b"payload"));
    let again = Block::default()
        .indexed(3)
        .indexed(6)
        .indexed(65)
        .indexed(64);
    input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &again.0));
    let later = Block::default().indexing(":authority", "/run/x.sock");
    input.extend(frame(HEADERS, END_HEADERS, 5, &later.0));
    for step in [1, 7, input.len()] {
        let (out, r) = rewrite_in_steps(&input, step);
        assert_eq!(out, input, "in pieces of {step}");
        assert!(r.passes_through());
    }
    // A first block that needs the fix keeps the rewriting on.
    let mut input = opening();
    input.extend(frame(
        HEADERS,
        END_HEADERS,
        1,
        &request(Some("/run/x.sock")).0,
    ));
    let (out, r) = rewrite_in_steps(&input, input.len());
    assert_ne!(out, input);
    assert!(!r.passes_through());
}

#[test]
fn padding_priority_and_continuations_are_gathered_into_one_block() {
    let block = request(Some("/tmp/a.sock")).0;
    let (a, rest) = block.split_at(5);
    let (b, c) = rest.split_at(10);
    let mut headers = vec![3u8]; // pad length
    headers.extend_from_slice(&[0x80, 0, 0, 1, 15]); // exclusive, on stream 1, weight 16
    headers.extend_from_slice(a);
    headers.extend_from_slice(&[0, 0, 0]);
    let mut input = opening();
    input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 3, &headers));
    input.extend(frame(CONTINUATION, 0, 3, b));
    input.extend(frame(CONTINUATION, END_HEADERS, 3, c));
    let seen = frames_of(&rewrite(&input));
    assert_eq!(
        seen[1],
        Seen::Headers {
            stream: 3,
            flags: END_STREAM | PRIORITY,
            priority: Some(vec![0x80, 0, 0, 1, 15]),
            fields: fields(&REWRITTEN),
        }
    );
}

#[test]
fn a_block_larger_than_a_frame_once_re_encoded_is_cut_into_continuations() {
    // A 4000-byte value in the dynamic table, referenced six times: 6
    // bytes as sent, 24 KB as literals.
    let big = "v".repeat(4000);
    let mut block = request(Some("/tmp/a.sock")).indexing("x-big", &big);
    for _ in 0..6 {
        block = block.indexed(62);
    }
    let mut input = opening();
    input.extend(frame(HEADERS, END_HEADERS, 1, &block.0));
    let out = rewrite(&input);
    // frames_of checks that no frame exceeds MAX_FRAME.
    assert!(
        out.len() > 24 + MAX_FRAME,
        "the re-encoded block spans frames"
    );
    let seen = frames_of(&out);
    let Seen::Headers {
        fields: Some(f), ..
    } = &seen[1]
    else {
        panic!("a decodable block: {seen:?}");
    };
    assert_eq!(
        f.iter().filter(|(n, v)| n == "x-big" && *v == big).count(),
        7
    );
}

#[test]
fn an_undecodable_block_reaches_h2_as_one_and_ends_the_stream_of_bytes() {
    let mut input = opening();
    // Index 70 names nothing: the dynamic table is empty.
    input.extend(frame(
        HEADERS,
        END_HEADERS,
        1,
        &Block::default().indexed(70).0,
    ));
    input.extend(frame(DATA, 0, 1, b"ignored"));
    let (out, r) = rewrite_in_steps(&input, 5);
    assert!(r.ended());
    let seen = frames_of(&out);
    assert_eq!(
        seen.len(),
        2,
        "nothing after the undecodable block: {seen:?}"
    );
    assert!(matches!(seen[1], Seen::Headers { fields: None, .. }));
}

#[test]
fn a_block_that_decodes_beyond_the_list_bound_ends_the_connection() {
    let big = "v".repeat(4000);
    let mut block = Block::default().indexing("x-big", &big);
    for _ in 0..(MAX_HEADER_LIST / 4000) {
        block = block.indexed(62);
    }
    let mut input = opening();
    input.extend(frame(HEADERS, END_HEADERS, 1, &block.0));
    let (out, r) = rewrite_in_steps(&input, 4096);
    assert!(r.ended());
    assert!(matches!(
        frames_of(&out)[1],
        Seen::Headers { fields: None, .. }
    ));
}

#[test]
fn framing_faults_are_forwarded_as_received_for_h2_to_refuse() {
    let block = request(Some("/tmp/a.sock")).0;
    let (a, b) = block.split_at(8);
    // A DATA frame between a HEADERS frame and its CONTINUATION.
    let mut fault = frame(HEADERS, 0, 1, a);
    fault.extend(frame(DATA, 0, 1, b"x"));
    fault.extend(frame(CONTINUATION, END_HEADERS, 1, b));
    // A CONTINUATION with no block open; padding longer than the frame;
    // a frame over the server's frame size.
    let stray = frame(CONTINUATION, END_HEADERS, 1, &block);
    let padded = frame(HEADERS, PADDED | END_HEADERS, 1, &[200, 1, 2]);
    let huge = frame(HEADERS, END_HEADERS, 1, &vec![0u8; MAX_FRAME + 1]);
    for case in [fault, stray, padded, huge] {
        let mut input = opening();
        input.extend_from_slice(&case);
        input.extend(frame(DATA, 0, 1, b"after"));
        let (out, r) = rewrite_in_steps(&input, 3);
        assert!(!r.ended());
        assert_eq!(out, input, "forwarded byte for byte");
    }
}

proptest::proptest! {
    /// Whatever a client sends, the rewriter does not panic, and how the
    /// bytes are cut does not change what h2 receives.
    #[test]
    fn any_bytes_in_any_pieces(
        frames in proptest::collection::vec(
            (0u8..12, proptest::num::u8::ANY, 0u32..6, proptest::collection::vec(proptest::num::u8::ANY, 0..64)),
            0..12,
        ),
        step in 1usize..40,
    ) {
        let mut input = opening();
        for (kind, flags, stream, payload) in &frames {
            input.extend(frame(*kind, *flags, *stream, payload));
        }
        let whole = rewrite(&input);
        proptest::prop_assert_eq!(rewrite_in_steps(&input, step).0, whole);
    }
}
