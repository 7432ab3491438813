//! An HPACK decoder (RFC 7541) for the authority layer: the header blocks
//! a client sends, decoded with the dynamic table its encoder keeps.
//!
//! Written for this one use, because every bound matters here: any local
//! process that can open the socket feeds it. Integers are bounded,
//! strings must lie inside the block, size updates may only open a block
//! and never exceed what the server allows, and the caller sees each field
//! as it is decoded (so it can stop a block that decodes too large). The
//! Huffman code (RFC 7541, Appendix B) is canonical, so its decoder is
//! built from the code lengths alone.

use std::collections::VecDeque;
use std::sync::OnceLock;

/// Why a block does not decode: any of these is a COMPRESSION_ERROR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// The block ends inside a representation.
    Truncated,
    /// An integer beyond any sane size.
    Overflow,
    /// Index 0, or past the static and dynamic tables.
    BadIndex,
    /// A table size update past the allowed size or after a field.
    BadSizeUpdate,
    /// Huffman data with EOS inside, or padding that is not EOS's prefix.
    BadHuffman,
    /// The caller stopped the block.
    Stopped,
}

/// The static table (RFC 7541, Appendix A); index 1 is the first entry.
const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// The Huffman code length of each symbol, 0-255 and EOS (256), from
/// RFC 7541, Appendix B.
const CODE_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5,
    5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6,
    6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22,
    23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22,
    21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20,
    22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19,
    21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22,
    22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
];

const EOS: u16 = 256;

/// The canonical code's decoding tables, per code length: the first code
/// of that length, and the symbols of that length in code order.
struct Huffman {
    first: [u32; 31],
    count: [u32; 31],
    /// Index into `symbols` of each length's first symbol.
    offset: [usize; 31],
    symbols: Vec<u16>,
}

fn huffman() -> &'static Huffman {
    static TABLES: OnceLock<Huffman> = OnceLock::new();
    TABLES.get_or_init(|| {
        let mut symbols: Vec<u16> = (0..=EOS).collect();
        symbols.sort_by_key(|s| (CODE_LENGTHS[usize::from(*s)], *s));
        let (mut first, mut count, mut offset) = ([0u32; 31], [0u32; 31], [0usize; 31]);
        let (mut code, mut len) = (0u32, 0u8);
        for (i, s) in symbols.iter().enumerate() {
            let l = CODE_LENGTHS[usize::from(*s)];
            if i > 0 {
                code = (code + 1) << (l - len);
            }
            if count[usize::from(l)] == 0 {
                first[usize::from(l)] = code;
                offset[usize::from(l)] = i;
            }
            count[usize::from(l)] += 1;
            len = l;
        }
        Huffman {
            first,
            count,
            offset,
            symbols,
        }
    })
}

/// Decodes Huffman-coded `data` onto `out`.
fn decode_huffman(data: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
    let h = huffman();
    let (mut code, mut len) = (0u32, 0usize);
    for byte in data {
        for bit in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> bit) & 1);
            len += 1;
            if len > 30 {
                return Err(Error::BadHuffman);
            }
            let at = code.wrapping_sub(h.first[len]);
            if h.count[len] > 0 && code >= h.first[len] && at < h.count[len] {
                let symbol = h.symbols[h.offset[len] + at as usize];
                if symbol == EOS {
                    return Err(Error::BadHuffman);
                }
                out.push(symbol as u8);
                code = 0;
                len = 0;
            }
        }
    }
    // At most 7 bits of padding, all ones (the start of EOS).
    if len > 7 || code != (1 << len) - 1 {
        return Err(Error::BadHuffman);
    }
    Ok(())
}

/// A cursor over one block.
struct Cursor<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.data.get(self.at).copied()
    }

    /// An integer with a `prefix`-bit prefix (RFC 7541, 5.1), at most
    /// 2^28: nothing in a header block needs more.
    fn integer(&mut self, prefix: u8) -> Result<usize, Error> {
        let mask = (1u16 << prefix) - 1;
        let first = self.peek().ok_or(Error::Truncated)?;
        self.at += 1;
        let mut value = usize::from(u16::from(first) & mask);
        if value < usize::from(mask) {
            return Ok(value);
        }
        for shift in (0..28).step_by(7) {
            let byte = self.peek().ok_or(Error::Truncated)?;
            self.at += 1;
            value += usize::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(Error::Overflow)
    }

    /// A string literal (RFC 7541, 5.2), Huffman-decoded if marked so.
    fn string(&mut self) -> Result<Vec<u8>, Error> {
        let huffman = self.peek().ok_or(Error::Truncated)? & 0x80 != 0;
        let len = self.integer(7)?;
        let end = self.at.checked_add(len).ok_or(Error::Overflow)?;
        let raw = self.data.get(self.at..end).ok_or(Error::Truncated)?;
        self.at = end;
        if !huffman {
            return Ok(raw.to_vec());
        }
        let mut out = Vec::with_capacity(raw.len() * 8 / 5);
        decode_huffman(raw, &mut out)?;
        Ok(out)
    }
}

/// The decoding side of one connection's client-to-server direction.
#[derive(Debug)]
pub struct Decoder {
    /// Newest first.
    dynamic: VecDeque<(Vec<u8>, Vec<u8>)>,
    size: usize,
    max: usize,
    /// The most the server allows (its SETTINGS_HEADER_TABLE_SIZE).
    allowed: usize,
}

fn entry_size(name: &[u8], value: &[u8]) -> usize {
    name.len() + value.len() + 32
}

impl Decoder {
    /// A decoder for a server whose header table may hold `allowed` bytes.
    pub fn new(allowed: usize) -> Self {
        Self {
            dynamic: VecDeque::new(),
            size: 0,
            max: allowed,
            allowed,
        }
    }

    fn field(&self, index: usize) -> Result<(&[u8], &[u8]), Error> {
        match index {
            0 => Err(Error::BadIndex),
            1..=61 => {
                let (n, v) = STATIC[index - 1];
                Ok((n.as_bytes(), v.as_bytes()))
            }
            _ => self
                .dynamic
                .get(index - 62)
                .map(|(n, v)| (n.as_slice(), v.as_slice()))
                .ok_or(Error::BadIndex),
        }
    }

    fn evict_to(&mut self, max: usize) {
        while self.size > max {
            match self.dynamic.pop_back() {
                Some((n, v)) => self.size -= entry_size(&n, &v),
                None => break,
            }
        }
    }

    fn insert(&mut self, name: Vec<u8>, value: Vec<u8>) {
        let size = entry_size(&name, &value);
        if size > self.max {
            self.dynamic.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max - size);
        self.size += size;
        self.dynamic.push_front((name, value));
    }

    /// Decodes one whole header block, handing each field to `each`, which
    /// may stop the block (then `Error::Stopped`; the table is then no
    /// longer in step with the client's and the connection must end).
    pub fn decode(
        &mut self,
        block: &[u8],
        mut each: impl FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), Error> {
        let mut c = Cursor { data: block, at: 0 };
        let mut fields = 0usize;
        while let Some(first) = c.peek() {
            let (name, value) = if first & 0x80 != 0 {
                let index = c.integer(7)?;
                let (n, v) = self.field(index)?;
                (n.to_vec(), v.to_vec())
            } else if first & 0xe0 == 0x20 {
                let size = c.integer(5)?;
                if fields > 0 || size > self.allowed {
                    return Err(Error::BadSizeUpdate);
                }
                self.max = size;
                self.evict_to(size);
                continue;
            } else {
                let indexing = first & 0x40 != 0;
                let index = c.integer(if indexing { 6 } else { 4 })?;
                let name = match index {
                    0 => c.string()?,
                    i => self.field(i)?.0.to_vec(),
                };
                let value = c.string()?;
                if indexing {
                    self.insert(name.clone(), value.clone());
                }
                (name, value)
            };
            fields += 1;
            if !each(&name, &value) {
                return Err(Error::Stopped);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
