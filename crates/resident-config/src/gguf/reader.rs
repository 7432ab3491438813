//! The GGUF v2 and v3 header: its metadata and tensor index, never the
//! tensor data. A header is read as a claim, never obeyed: a length or
//! count that asks for more than the file holds is refused before
//! anything is allocated for it, arrays nest at most `MAX_DEPTH` deep,
//! and what the reader keeps is at most `MAX_KEPT_BYTES`, whatever the
//! file says (issue #43: a file made to hurt is an error, never an
//! abort).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

/// Longest string (bytes) or array (items) the reader accepts in a
/// header, however large the file: a 40 GB model must not make it
/// allocate gigabytes for one string.
const MAX_LEN: u64 = 1 << 24;

/// Longest array whose integer items are kept (per-layer values such as
/// `head_count_kv` or `sliding_window_pattern`); longer ones keep only
/// their length.
const MAX_KEPT: u64 = 1 << 16;

/// Deepest nesting of arrays the reader follows. llama.cpp's own reader
/// (ggml's `gguf.cpp`) refuses an array of arrays outright, so no model
/// it loads nests deeper than 1; 64 is far above that, and 64 frames of
/// `Reader::array` are a few KiB of stack on any thread (300,000 of them
/// overflowed it).
const MAX_DEPTH: u32 = 64;

/// Bytes of metadata the reader keeps at most: keys, string values,
/// kept array items and each entry's own overhead. Real models keep well
/// under 1 MiB (their tokens and merges are counted, never kept); this
/// bounds what a header of millions of tiny entries can make it hold.
const MAX_KEPT_BYTES: u64 = 64 << 20;

/// What one metadata entry costs beside its key (the map's slot).
const ENTRY_BYTES: u64 = 64;

/// What a header holds that sizing reads: its metadata, and the bytes of
/// tensor data that follow it.
pub(super) struct Header {
    pub(super) meta: HashMap<String, Value>,
    pub(super) data_bytes: u64,
}

#[derive(Debug, Clone)]
pub(super) enum Value {
    Uint(u64),
    Int(i64),
    Str(String),
    /// An array: its length, and its items when they are integers or
    /// booleans (as i64) and not too many; otherwise none are kept.
    Array(u64, Vec<i64>),
    Other,
}

/// The fewest bytes a value of GGUF type `t` takes in the file.
fn min_size(t: u32) -> Result<u64, String> {
    Ok(match t {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        // 64-bit numbers, and a string's length.
        8 | 10..=12 => 8,
        // An array: its item type and length.
        9 => 12,
        other => return Err(format!("unknown metadata value type {other}")),
    })
}

struct Reader<R> {
    r: R,
    /// Bytes read so far.
    read: u64,
    /// The file's size.
    len: u64,
    /// Bytes of metadata kept so far.
    kept: u64,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => "truncated header".to_string(),
            _ => e.to_string(),
        })?;
        self.read += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// Whether `count` things of at least `each` bytes fit in what is
    /// left of the file, and `count` is at most `max`; `what` names them
    /// for the error ("a string of", "bytes").
    fn claim(&self, count: u64, each: u64, max: u64, what: (&str, &str)) -> Result<(), String> {
        let left = self.len.saturating_sub(self.read);
        let (name, unit) = what;
        if count.checked_mul(each).is_none_or(|b| b > left) {
            return Err(format!(
                "{name} {count} {unit}, but only {left} bytes remain in the file (truncated header)"
            ));
        }
        if count > max {
            return Err(format!("{name} {count} {unit} (at most {max})"));
        }
        Ok(())
    }

    /// Counts `bytes` more against `MAX_KEPT_BYTES`.
    fn keep(&mut self, bytes: u64) -> Result<(), String> {
        self.kept = self.kept.saturating_add(bytes);
        if self.kept > MAX_KEPT_BYTES {
            return Err(format!(
                "more than {} MiB of metadata to keep",
                MAX_KEPT_BYTES >> 20
            ));
        }
        Ok(())
    }

    fn skip(&mut self, n: u64) -> Result<(), String> {
        let copied = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())
            .map_err(|e| e.to_string())?;
        if copied != n {
            return Err("truncated header".into());
        }
        self.read += n;
        Ok(())
    }

    /// A string's length, once it is known to fit in the file.
    fn string_len(&mut self) -> Result<u64, String> {
        let len = self.u64()?;
        self.claim(len, 1, MAX_LEN, ("a string of", "bytes"))?;
        Ok(len)
    }

    /// A string the caller keeps (counted against `MAX_KEPT_BYTES`).
    fn string(&mut self) -> Result<String, String> {
        let len = self.string_len()?;
        self.keep(len)?;
        let mut buf = Vec::new();
        buf.try_reserve_exact(len as usize)
            .map_err(|_| format!("cannot allocate a string of {len} bytes"))?;
        (&mut self.r)
            .take(len)
            .read_to_end(&mut buf)
            .map_err(|e| e.to_string())?;
        if buf.len() as u64 != len {
            return Err("truncated header".into());
        }
        self.read += len;
        String::from_utf8(buf).map_err(|_| "a header string is not UTF-8".into())
    }

    /// A value of GGUF type `t` that is not an array; floats are skipped.
    fn scalar(&mut self, t: u32) -> Result<Value, String> {
        Ok(match t {
            0 | 7 => Value::Uint(u64::from(self.bytes::<1>()?[0])),
            1 => Value::Int(i64::from(self.bytes::<1>()?[0] as i8)),
            2 => Value::Uint(u64::from(u16::from_le_bytes(self.bytes()?))),
            3 => Value::Int(i64::from(i16::from_le_bytes(self.bytes()?))),
            4 => Value::Uint(u64::from(self.u32()?)),
            5 => Value::Int(i64::from(i32::from_le_bytes(self.bytes()?))),
            6 => {
                self.skip(4)?;
                Value::Other
            }
            8 => Value::Str(self.string()?),
            10 => Value::Uint(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.bytes()?)),
            12 => {
                self.skip(8)?;
                Value::Other
            }
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }

    /// A value of GGUF type `t`.
    fn value(&mut self, t: u32) -> Result<Value, String> {
        if t == 9 {
            self.array(1)
        } else {
            self.scalar(t)
        }
    }

    /// An array, itself `depth` deep (1: a metadata value). Its length is
    /// checked against the file before any item is read; strings and
    /// nested arrays in it are read past, never kept.
    fn array(&mut self, depth: u32) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err(format!("arrays nested deeper than {MAX_DEPTH}"));
        }
        let inner = self.u32()?;
        let count = self.u64()?;
        if count == 0 {
            return Ok(Value::Array(0, Vec::new()));
        }
        self.claim(count, min_size(inner)?, MAX_LEN, ("an array of", "items"))?;
        let integers = matches!(inner, 0..=5 | 7 | 10 | 11);
        let keep = integers && count <= MAX_KEPT;
        let mut items = Vec::new();
        if keep {
            self.keep(count * 8)?;
            items
                .try_reserve_exact(count as usize)
                .map_err(|_| format!("cannot allocate an array of {count} items"))?;
        }
        for _ in 0..count {
            match inner {
                8 => {
                    let len = self.string_len()?;
                    self.skip(len)?;
                }
                9 => _ = self.array(depth + 1)?,
                _ => match self.scalar(inner)? {
                    Value::Uint(v) if keep => items.push(i64::try_from(v).unwrap_or(i64::MAX)),
                    Value::Int(v) if keep => items.push(v),
                    _ => {}
                },
            }
        }
        Ok(Value::Array(count, items))
    }
}

pub(super) fn uint(meta: &HashMap<String, Value>, key: &str) -> Option<u64> {
    match meta.get(key)? {
        Value::Uint(v) => Some(*v),
        Value::Int(v) => u64::try_from(*v).ok(),
        _ => None,
    }
}

/// Reads the header of the GGUF file at `path`. Errors say what is wrong
/// (not a GGUF file, unsupported version, truncated, a length or count
/// the file cannot hold, which metadata entry).
pub(super) fn header(path: &Path) -> Result<Header, String> {
    let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let file_len = file.metadata().map_err(|e| e.to_string())?.len();
    let mut r = Reader {
        r: BufReader::new(file),
        read: 0,
        len: file_len,
        kept: 0,
    };
    if &r
        .bytes::<4>()
        .map_err(|_| "not a GGUF file (too short)".to_string())?
        != b"GGUF"
    {
        return Err("not a GGUF file (no GGUF magic)".into());
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(format!(
            "GGUF version {version} is not supported (2 and 3 are)"
        ));
    }
    let tensors = r.u64()?;
    let kvs = r.u64()?;
    // An entry: its key's length, its type, a byte of value at least. A
    // tensor: its name's length, dimensions, type and offset.
    r.claim(
        kvs,
        8 + 4 + 1,
        MAX_LEN,
        ("the header claims", "metadata entries"),
    )?;
    r.claim(
        tensors,
        8 + 4 + 4 + 8,
        MAX_LEN,
        ("the header claims", "tensors"),
    )?;
    let mut meta = HashMap::new();
    for i in 1..=kvs {
        let key = r
            .string()
            .map_err(|e| format!("metadata key {i} of {kvs}: {e}"))?;
        let entry = |e: String| format!("metadata {key:?}: {e}");
        let t = r.u32().map_err(entry)?;
        let v = r.value(t).map_err(entry)?;
        r.keep(ENTRY_BYTES).map_err(entry)?;
        meta.insert(key, v);
    }
    for i in 1..=tensors {
        let tensor = |e: String| format!("tensor {i} of {tensors}: {e}");
        let name = r.string_len().map_err(tensor)?;
        r.skip(name).map_err(tensor)?;
        let dims = r.u32().map_err(tensor)?;
        if dims > 8 {
            return Err(tensor(format!("{dims} dimensions (at most 8)")));
        }
        r.skip(u64::from(dims) * 8 + 4 + 8).map_err(tensor)?;
    }
    let alignment = uint(&meta, "general.alignment").unwrap_or(32).max(1);
    let data_start = r.read.div_ceil(alignment).checked_mul(alignment);
    let Some(data_start) = data_start.filter(|s| *s <= file_len) else {
        return Err("truncated: the tensor data is missing".into());
    };
    Ok(Header {
        meta,
        data_bytes: file_len - data_start,
    })
}
