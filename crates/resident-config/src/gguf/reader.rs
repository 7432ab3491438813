//! The GGUF v2 and v3 header: its metadata and tensor index, never the
//! tensor data.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

/// Longest string or array the reader accepts in a header (a corrupt file
/// must not make us allocate gigabytes).
const MAX_LEN: u64 = 1 << 24;

/// Longest array whose integer items are kept (per-layer values such as
/// `head_count_kv` or `sliding_window_pattern`); longer ones keep only
/// their length.
const MAX_KEPT: u64 = 1 << 16;

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

struct Reader<R> {
    r: R,
    read: u64,
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

    fn skip(&mut self, n: u64) -> Result<(), String> {
        let copied = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())
            .map_err(|e| e.to_string())?;
        if copied != n {
            return Err("truncated header".into());
        }
        self.read += n;
        Ok(())
    }

    fn string(&mut self) -> Result<String, String> {
        let len = self.u64()?;
        if len > MAX_LEN {
            return Err(format!("a header string of {len} bytes"));
        }
        let mut buf = vec![0u8; len as usize];
        self.r
            .read_exact(&mut buf)
            .map_err(|_| "truncated header".to_string())?;
        self.read += len;
        String::from_utf8(buf).map_err(|_| "a header string is not UTF-8".into())
    }

    /// A value of GGUF type `t`; arrays and floats are skipped.
    fn value(&mut self, t: u32) -> Result<Value, String> {
        Ok(match t {
            0 => Value::Uint(u64::from(self.bytes::<1>()?[0])),
            1 => Value::Int(i64::from(self.bytes::<1>()?[0] as i8)),
            2 => Value::Uint(u64::from(u16::from_le_bytes(self.bytes()?))),
            3 => Value::Int(i64::from(i16::from_le_bytes(self.bytes()?))),
            4 => Value::Uint(u64::from(self.u32()?)),
            5 => Value::Int(i64::from(i32::from_le_bytes(self.bytes()?))),
            6 => {
                self.skip(4)?;
                Value::Other
            }
            7 => Value::Uint(u64::from(self.bytes::<1>()?[0])),
            8 => Value::Str(self.string()?),
            9 => {
                let inner = self.u32()?;
                let count = self.u64()?;
                if count > MAX_LEN {
                    return Err(format!("a header array of {count} items"));
                }
                let keep = count <= MAX_KEPT;
                let mut items = Vec::new();
                for _ in 0..count {
                    match self.value(inner)? {
                        Value::Uint(v) if keep => items.push(i64::try_from(v).unwrap_or(i64::MAX)),
                        Value::Int(v) if keep => items.push(v),
                        _ => {}
                    }
                }
                if items.len() as u64 != count {
                    items.clear();
                }
                Value::Array(count, items)
            }
            10 => Value::Uint(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.bytes()?)),
            12 => {
                self.skip(8)?;
                Value::Other
            }
            other => return Err(format!("unknown metadata value type {other}")),
        })
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
/// (not a GGUF file, unsupported version, truncated).
pub(super) fn header(path: &Path) -> Result<Header, String> {
    let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let file_len = file.metadata().map_err(|e| e.to_string())?.len();
    let mut r = Reader {
        r: BufReader::new(file),
        read: 0,
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
    if tensors > MAX_LEN || kvs > MAX_LEN {
        return Err("implausible tensor or metadata count".into());
    }
    let mut meta = HashMap::new();
    for _ in 0..kvs {
        let key = r.string()?;
        let t = r.u32()?;
        let v = r.value(t)?;
        meta.insert(key, v);
    }
    for _ in 0..tensors {
        r.string()?;
        let dims = r.u32()?;
        if dims > 8 {
            return Err(format!("a tensor with {dims} dimensions"));
        }
        r.skip(u64::from(dims) * 8 + 4 + 8)?;
    }
    let alignment = uint(&meta, "general.alignment").unwrap_or(32).max(1);
    let data_start = r.read.div_ceil(alignment) * alignment;
    if data_start > file_len {
        return Err("truncated: the tensor data is missing".into());
    }
    Ok(Header {
        meta,
        data_bytes: file_len - data_start,
    })
}
