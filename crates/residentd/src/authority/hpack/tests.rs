//! The decoder against RFC 7541's own examples (Appendix C.4, Huffman-coded
//! requests on one connection) and, on random blocks that use every
//! representation, against an independent decoder (loona-hpack).

use proptest::prelude::*;

use super::*;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn decode_all(d: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, Error> {
    let mut out = Vec::new();
    d.decode(block, |n, v| {
        out.push((
            String::from_utf8_lossy(n).into_owned(),
            String::from_utf8_lossy(v).into_owned(),
        ));
        true
    })?;
    Ok(out)
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

#[test]
fn the_rfc_requests_with_huffman_decode_on_one_connection() {
    let mut d = Decoder::new(4096);
    let first = decode_all(&mut d, &hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff"));
    assert_eq!(
        first,
        Ok(pairs(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
        ]))
    );
    let second = decode_all(&mut d, &hex("8286 84be 5886 a8eb 1064 9cbf"));
    assert_eq!(
        second,
        Ok(pairs(&[
            (":method", "GET"),
            (":scheme", "http"),
            (":path", "/"),
            (":authority", "www.example.com"),
            ("cache-control", "no-cache"),
        ]))
    );
    let third = decode_all(
        &mut d,
        &hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
    );
    assert_eq!(
        third,
        Ok(pairs(&[
            (":method", "GET"),
            (":scheme", "https"),
            (":path", "/index.html"),
            (":authority", "www.example.com"),
            ("custom-key", "custom-value"),
        ]))
    );
    assert_eq!(d.size, 164, "the table size the RFC gives after C.4.3");
}

#[test]
fn malformed_blocks_are_errors_not_panics() {
    let cases: [(&str, Error); 7] = [
        ("80", Error::BadIndex),
        ("be", Error::BadIndex),
        ("ff ff ff ff ff 7f", Error::Overflow),
        ("40 85 61", Error::Truncated),
        ("82 20", Error::BadSizeUpdate),
        ("3f e2 1f", Error::BadSizeUpdate),
        // "a" Huffman-coded with a wrong (zero) padding bit pattern.
        ("00 81 18 81 00", Error::BadHuffman),
    ];
    for (block, want) in cases {
        let got = decode_all(&mut Decoder::new(4096), &hex(block));
        assert_eq!(got, Err(want), "{block}");
    }
}

/// Huffman-encodes `s` with the canonical code of `CODE_LENGTHS`.
fn huffman_encode(s: &[u8]) -> Vec<u8> {
    let h = huffman();
    let mut codes = [(0u32, 0u8); 257];
    for (len, (first, off)) in h.first.iter().zip(h.offset).enumerate() {
        for k in 0..h.count[len] {
            let sym = h.symbols[off + k as usize];
            codes[usize::from(sym)] = (first + k, len as u8);
        }
    }
    let (mut out, mut acc, mut bits) = (Vec::new(), 0u64, 0u32);
    for b in s {
        let (code, len) = codes[usize::from(*b)];
        acc = (acc << len) | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            out.push((acc >> (bits - 8)) as u8);
            bits -= 8;
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) as u8) | (0xff >> bits));
    }
    out
}

fn put_int(out: &mut Vec<u8>, value: usize, prefix: u8, high: u8) {
    loona_hpack::encoder::encode_integer_into(value, prefix, high, out).expect("vec");
}

fn put_string(out: &mut Vec<u8>, s: &[u8], huffman: bool) {
    if huffman {
        let coded = huffman_encode(s);
        put_int(out, coded.len(), 7, 0x80);
        out.extend_from_slice(&coded);
    } else {
        put_int(out, s.len(), 7, 0);
        out.extend_from_slice(s);
    }
}

#[derive(Debug, Clone)]
enum Rep {
    Indexed(usize),
    Literal {
        kind: u8,
        name_index: usize,
        name: Vec<u8>,
        value: Vec<u8>,
        huffman: bool,
    },
}

fn rep() -> impl Strategy<Value = Rep> {
    let bytes = proptest::collection::vec(any::<u8>(), 0..40);
    prop_oneof![
        (1..70usize).prop_map(Rep::Indexed),
        (0..3u8, 0..66usize, bytes.clone(), bytes, any::<bool>()).prop_map(
            |(kind, name_index, name, value, huffman)| Rep::Literal {
                kind,
                name_index,
                name,
                value,
                huffman,
            }
        ),
    ]
}

fn encode_block(reps: &[Rep]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in reps {
        match r {
            Rep::Indexed(i) => put_int(&mut out, *i, 7, 0x80),
            Rep::Literal {
                kind,
                name_index,
                name,
                value,
                huffman,
            } => {
                let (prefix, high) = [(6, 0x40), (4, 0x00), (4, 0x10)][usize::from(*kind)];
                put_int(&mut out, *name_index, prefix, high);
                if *name_index == 0 {
                    put_string(&mut out, name, *huffman);
                }
                put_string(&mut out, value, *huffman);
            }
        }
    }
    out
}

proptest! {
    /// Blocks of every representation, some Huffman-coded, decoded on one
    /// connection by this decoder and by loona-hpack: the same fields, and
    /// an error exactly when the other errs too.
    #[test]
    fn agrees_with_an_independent_decoder(blocks in proptest::collection::vec(proptest::collection::vec(rep(), 0..12), 1..6)) {
        let mut ours = Decoder::new(4096);
        let mut theirs = loona_hpack::Decoder::new();
        theirs.set_max_allowed_table_size(4096);
        for reps in &blocks {
            let block = encode_block(reps);
            let a = decode_all(&mut ours, &block);
            let b = theirs.decode(&block).map(|f| {
                f.into_iter()
                    .map(|(n, v)| (String::from_utf8_lossy(&n).into_owned(), String::from_utf8_lossy(&v).into_owned()))
                    .collect::<Vec<_>>()
            });
            match (a, b) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => break,
                (a, b) => prop_assert!(false, "ours {:?}, theirs {:?}", a, b.map(|_| "ok")),
            }
        }
    }

    /// Any bytes: an answer, never a panic.
    #[test]
    fn any_bytes_decode_or_fail(block in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_all(&mut Decoder::new(4096), &block);
    }
}
