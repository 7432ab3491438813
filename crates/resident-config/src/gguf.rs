//! Sizing a model from its GGUF file, so operators need not guess bytes:
//! weights are the file's tensor data region; the KV cache follows from the
//! header (layers, KV heads, key and value lengths) and the context length
//! and cache type the operator chooses.
//!
//! Our own reader of GGUF v2 and v3 headers: it reads the metadata and the
//! tensor index, never the tensor data.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

/// Longest string or array the reader accepts in a header (a corrupt file
/// must not make us allocate gigabytes).
const MAX_LEN: u64 = 1 << 24;

/// What a GGUF header says about memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufModel {
    /// `general.architecture` (`llama`, `qwen2`, ...).
    pub architecture: String,
    /// Bytes of tensor data (what loading the weights takes).
    pub weights_bytes: u64,
    /// `{arch}.block_count`.
    pub layers: u64,
    /// `{arch}.attention.head_count_kv` (or `head_count`).
    pub kv_heads: u64,
    /// Per-head key length.
    pub key_length: u64,
    /// Per-head value length.
    pub value_length: u64,
    /// `{arch}.context_length`, the trained context.
    pub context_length: u64,
    /// `{arch}.attention.head_count`.
    pub heads: u64,
    /// `{arch}.embedding_length`.
    pub embedding: u64,
    /// `{arch}.feed_forward_length` (4 x embedding when absent).
    pub feed_forward: u64,
    /// Tokens in `tokenizer.ggml.tokens` (0 when absent).
    pub vocab: u64,
}

/// Tokens llama.cpp computes in one step at most (its default
/// `n_ubatch`): the compute buffer is sized for this many.
pub const UBATCH: u64 = 512;

/// KV cache element types and their size in bytes per element, as
/// (numerator, denominator) for the block-quantized ones.
pub fn kv_type_size(kv_type: &str) -> Option<(u64, u64)> {
    Some(match kv_type {
        "f32" => (4, 1),
        "f16" | "bf16" => (2, 1),
        "q8_0" => (34, 32),
        "q5_1" => (24, 32),
        "q5_0" => (22, 32),
        "q4_1" => (20, 32),
        "q4_0" | "iq4_nl" => (18, 32),
        _ => return None,
    })
}

impl GgufModel {
    /// An estimate of llama.cpp's compute buffer on the CPU for `ctx`
    /// tokens, in bytes, without flash attention: the attention scores
    /// and the mask (f32, every head plus one, the whole context for one
    /// micro-batch) plus one micro-batch of activations (logits over the
    /// vocabulary, a feed-forward and two embedding rows per token). For
    /// the tests' 6 MB model (256 wide, 4 heads, 704 feed-forward, 335
    /// tokens) llama.cpp 0.3.36 reports 8.01 MiB at ctx 512 and 43.01
    /// MiB at 4096; this gives 8.03 and 43.03 MiB. The buffer is
    /// allocated whole and touched as batches fill it.
    pub fn compute_bytes(&self, ctx: u64) -> u64 {
        let ubatch = UBATCH.min(ctx.max(1));
        let scores = self
            .heads
            .saturating_add(1)
            .saturating_mul(ctx)
            .saturating_mul(ubatch)
            .saturating_mul(4);
        let rows = self
            .vocab
            .saturating_add(self.feed_forward)
            .saturating_add(self.embedding.saturating_mul(2));
        scores.saturating_add(rows.saturating_mul(ubatch).saturating_mul(4))
    }

    /// KV cache bytes for `ctx` tokens of `kv_type` (None: unknown type).
    pub fn kv_bytes(&self, ctx: u64, kv_type: &str) -> Option<u64> {
        let (num, den) = kv_type_size(kv_type)?;
        let per_token = self
            .layers
            .checked_mul(self.kv_heads)?
            .checked_mul(self.key_length.checked_add(self.value_length)?)?;
        per_token
            .checked_mul(ctx)?
            .checked_mul(num)
            .map(|b| b.div_ceil(den))
    }
}

#[derive(Debug, Clone)]
enum Value {
    Uint(u64),
    Int(i64),
    Str(String),
    /// An array, by its length (its items are skipped).
    Array(u64),
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
                for _ in 0..count {
                    self.value(inner)?;
                }
                Value::Array(count)
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

fn uint(meta: &HashMap<String, Value>, key: &str) -> Option<u64> {
    match meta.get(key)? {
        Value::Uint(v) => Some(*v),
        Value::Int(v) => u64::try_from(*v).ok(),
        _ => None,
    }
}

/// Reads the header of the GGUF file at `path`. Errors say what is wrong
/// (not a GGUF file, unsupported version, truncated, missing keys); the
/// caller names the file and the config key.
pub fn read(path: &Path) -> Result<GgufModel, String> {
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
    let architecture = match meta.get("general.architecture") {
        Some(Value::Str(a)) => a.clone(),
        _ => return Err("no general.architecture in the header".into()),
    };
    let need = |key: &str| {
        uint(&meta, &format!("{architecture}.{key}"))
            .ok_or_else(|| format!("no {architecture}.{key} in the header"))
    };
    let layers = need("block_count")?;
    let heads = need("attention.head_count")?;
    let kv_heads = need("attention.head_count_kv").unwrap_or(heads);
    let embedding = need("embedding_length")?;
    let key_length = need("attention.key_length").unwrap_or(embedding / heads.max(1));
    let value_length = need("attention.value_length").unwrap_or(key_length);
    let context_length = need("context_length")?;
    let feed_forward = need("feed_forward_length").unwrap_or(embedding.saturating_mul(4));
    let vocab = match meta.get("tokenizer.ggml.tokens") {
        Some(Value::Array(n)) => *n,
        _ => 0,
    };
    Ok(GgufModel {
        heads,
        embedding,
        feed_forward,
        vocab,
        architecture: architecture.clone(),
        weights_bytes: file_len - data_start,
        layers,
        kv_heads,
        key_length,
        value_length,
        context_length,
    })
}
