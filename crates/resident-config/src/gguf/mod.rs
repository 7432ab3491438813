//! Sizing a model from its GGUF file, so operators need not guess bytes,
//! as llama.cpp (the version llama-cpp-python 0.3.36 vendors) allocates
//! it:
//!
//! - weights: the file's tensor data region (and a vision projector's,
//!   `mmproj`, the same way);
//! - KV cache: per attending layer, its KV heads x (key + value length)
//!   elements per cell, over llama.cpp's cells: the context padded to
//!   256, split per sequence unless the cache is unified. Sliding-window
//!   layers (gemma2, gemma3, cohere2, gpt-oss, olmo2, exaone4, llama4)
//!   hold only min(cells, window x (sequences when unified) + ubatch),
//!   padded to 256, unless `--swa-full`. MLA models (deepseek2 written
//!   with `key_length_mla`) cache K only (the compressed latent and the
//!   rope part). `nextn_predict_layers` (MTP heads) hold none;
//! - recurrent state (mamba, mamba2, rwkv6/7, and the Mamba layers of the
//!   hybrids jamba, granitehybrid, falcon-h1): f32, per sequence, not per
//!   token;
//! - the output buffer: f32 logits over the vocabulary, one row per
//!   sequence.
//!
//! An architecture not listed in `arch.rs` is not sized as llama.cpp
//! does: the model says so (`not_sized`), and its KV figure is a plain
//! dense estimate that the caller must not take silently.
//!
//! Our own reader of GGUF v2 and v3 headers (`reader.rs`): it reads the
//! metadata and the tensor index, never the tensor data.

mod arch;
mod reader;

use std::path::Path;

use reader::Value;

/// What a GGUF header says about memory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GgufModel {
    /// `general.architecture` (`llama`, `qwen2`, ...).
    pub architecture: String,
    /// Bytes of tensor data (what loading the weights takes).
    pub weights_bytes: u64,
    /// `{arch}.block_count`.
    pub layers: u64,
    /// `{arch}.attention.head_count_kv` (or `head_count`; the largest,
    /// when given per layer).
    pub kv_heads: u64,
    /// Per-head key length.
    pub key_length: u64,
    /// Per-head value length.
    pub value_length: u64,
    /// `{arch}.context_length`, the trained context.
    pub context_length: u64,
    /// `{arch}.attention.head_count` (0 for recurrent models).
    pub heads: u64,
    /// `{arch}.embedding_length`.
    pub embedding: u64,
    /// `{arch}.feed_forward_length` (4 x embedding when absent).
    pub feed_forward: u64,
    /// Tokens in `tokenizer.ggml.tokens` (0 when absent).
    pub vocab: u64,
    /// K and V elements one KV cell holds, summed over the layers that
    /// cache the whole context.
    pub kv_full: u64,
    /// The same over the sliding-window layers.
    pub kv_swa: u64,
    /// The sliding window, in tokens (0: none).
    pub sliding_window: u64,
    /// f32 elements of recurrent state one sequence holds, summed over
    /// the recurrent layers.
    pub state: u64,
    /// Why this model's memory is not sized as llama.cpp allocates it
    /// (an architecture this reader does not know); `kv_full` is then a
    /// dense estimate (every layer, whole context), 0 when the header
    /// has no attention geometry.
    pub not_sized: Option<String>,
}

/// Tokens llama.cpp computes in one step at most (its default
/// `n_ubatch`): the compute buffer is sized for this many.
pub const UBATCH: u64 = 512;

/// Most layers (`{arch}.block_count`) a model may have. Real models have
/// well under 1,000; a header claiming more (2^40, say) is refused
/// rather than sized, since sizing holds a few values per layer.
pub const MAX_LAYERS: u64 = 1 << 16;

/// KV cells are allocated in multiples of this (`GGML_PAD(n_ctx, 256)`
/// in llama-context.cpp; the sliding-window cache is padded the same).
pub const CELL_PAD: u64 = 256;

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

/// How a server runs the model: what sizes its context memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Serving<'a> {
    /// Context tokens in all (llama-server's `--ctx-size`).
    pub ctx: u64,
    /// KV cache element type.
    pub kv_type: &'a str,
    /// Sequences decoded at once (`--parallel`; at least 1).
    pub seqs: u64,
    /// One KV cache shared by all sequences (`--kv-unified`) rather than
    /// `ctx / seqs` cells for each.
    pub unified: bool,
    /// Sliding-window layers cache the whole context (`--swa-full`).
    pub swa_full: bool,
}

impl<'a> Serving<'a> {
    /// One sequence over `ctx` tokens of `kv_type`.
    pub fn single(ctx: u64, kv_type: &'a str) -> Self {
        Self {
            ctx,
            kv_type,
            seqs: 1,
            unified: false,
            swa_full: false,
        }
    }
}

/// What llama.cpp allocates for a context, beside weights and compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ContextMemory {
    /// KV cells of each stream (`n_ctx_seq`).
    pub cells: u64,
    /// KV cells of each stream in the sliding-window layers.
    pub swa_cells: u64,
    /// KV streams: one when unified, else one per sequence.
    pub streams: u64,
    /// Bytes of K and V (llama.cpp's "KV buffer size").
    pub kv: u64,
    /// Bytes of recurrent state ("RS buffer size").
    pub state: u64,
    /// Bytes of the output (logits) buffer ("output buffer size").
    pub output: u64,
}

fn pad(n: u64) -> u64 {
    n.div_ceil(CELL_PAD).saturating_mul(CELL_PAD)
}

impl GgufModel {
    /// An estimate of what llama.cpp's compute holds on the CPU for a KV
    /// cache of `ctx` cells per stream, in bytes: its compute buffer (the
    /// peak of one micro-batch's graph) and, without flash attention, the
    /// CPU backend's work buffer. The buffer's peak is the larger of
    ///
    /// - the attention: without flash attention the scores of every head
    ///   and the mask (f32, the whole context for one micro-batch); with
    ///   it, the mask alone (f16); plus a micro-batch of activations
    ///   (logits over the vocabulary, a feed-forward and two embedding
    ///   rows per token);
    /// - the feed-forward: three feed-forward and four embedding rows per
    ///   token of a micro-batch (f32), beside the mask.
    ///
    /// Without flash attention the CPU backend converts the scores to f16
    /// for their product with V, in a work buffer of its own (every head,
    /// the whole context, one micro-batch). Fitted to what llama.cpp
    /// 0.3.36 reports for the tests' models (256, 512 and 1024 wide, 4
    /// heads, 335 tokens) at contexts 512, 2048 and 8192, with and without
    /// flash attention: within 2.1 MiB under and 1.8 MiB over its
    /// figure (tests/gguf.rs). Allocated whole, touched as the context
    /// fills.
    pub fn compute_bytes(&self, ctx: u64, flash_attn: bool) -> u64 {
        let ubatch = UBATCH.min(ctx.max(1));
        let per_token = |floats: u64| floats.saturating_mul(ubatch).saturating_mul(4);
        let mask = ctx
            .saturating_mul(ubatch)
            .saturating_mul(if flash_attn { 2 } else { 4 });
        let scores = if flash_attn {
            0
        } else {
            per_token(self.heads.saturating_mul(ctx))
        };
        let rows = self
            .vocab
            .saturating_add(self.feed_forward)
            .saturating_add(self.embedding.saturating_mul(2));
        let attention = mask.saturating_add(scores).saturating_add(per_token(rows));
        let ffn_rows = self
            .feed_forward
            .saturating_mul(3)
            .saturating_add(self.embedding.saturating_mul(4));
        let ffn = mask.saturating_add(per_token(ffn_rows));
        let work = if flash_attn {
            0
        } else {
            self.heads
                .saturating_mul(ctx)
                .saturating_mul(ubatch)
                .saturating_mul(2)
        };
        attention.max(ffn).saturating_add(work)
    }

    /// What llama.cpp allocates for serving as `s` says (None: unknown
    /// KV type): llama_context's cells (the context padded to 256, split
    /// per sequence and padded again unless unified), the KV cache over
    /// them, the sliding-window layers' smaller cache
    /// (llama-kv-cache-iswa.cpp), the recurrent state of each sequence
    /// (llama-memory-recurrent.cpp) and the logits of each sequence
    /// (`output_reserve(n_seq_max)`).
    pub fn context_memory(&self, s: &Serving<'_>) -> Option<ContextMemory> {
        let (num, den) = kv_type_size(s.kv_type)?;
        let seqs = s.seqs.max(1);
        let n_ctx = pad(s.ctx.max(1));
        let (cells, streams) = if s.unified || seqs == 1 {
            (n_ctx, 1)
        } else {
            (pad(n_ctx / seqs).max(CELL_PAD), seqs)
        };
        // n_ubatch: 512, or the context when smaller (n_batch is capped
        // by the context).
        let ubatch = UBATCH.min(s.ctx.max(1));
        let swa_cells = if s.swa_full {
            cells
        } else {
            let window_seqs = if s.unified { seqs } else { 1 };
            pad(cells.min(
                self.sliding_window
                    .saturating_mul(window_seqs)
                    .saturating_add(ubatch),
            ))
        };
        let elements = self
            .kv_full
            .checked_mul(cells)?
            .checked_add(self.kv_swa.checked_mul(swa_cells)?)?
            .checked_mul(streams)?;
        Some(ContextMemory {
            cells,
            swa_cells: if self.kv_swa == 0 { 0 } else { swa_cells },
            streams,
            kv: elements.checked_mul(num)?.div_ceil(den),
            state: self.state.checked_mul(4)?.checked_mul(seqs)?,
            output: self.vocab.checked_mul(4)?.checked_mul(seqs)?,
        })
    }

    /// KV cache and recurrent state bytes of one sequence over `ctx`
    /// tokens of `kv_type` (None: unknown type).
    pub fn kv_bytes(&self, ctx: u64, kv_type: &str) -> Option<u64> {
        let m = self.context_memory(&Serving::single(ctx, kv_type))?;
        m.kv.checked_add(m.state)
    }
}

/// Bytes of tensor data in the GGUF file at `path`, whatever its
/// architecture (a vision projector's `clip` has no language-model
/// keys): what loading its tensors takes.
pub fn tensor_bytes(path: &Path) -> Result<u64, String> {
    Ok(reader::header(path)?.data_bytes)
}

/// Reads the header of the GGUF file at `path`. Errors say what is wrong
/// (not a GGUF file, unsupported version, truncated, missing keys); the
/// caller names the file and the config key.
pub fn read(path: &Path) -> Result<GgufModel, String> {
    let header = reader::header(path)?;
    let meta = &header.meta;
    let architecture = match meta.get("general.architecture") {
        Some(Value::Str(a)) => a.clone(),
        _ => return Err("no general.architecture in the header".into()),
    };
    let full = |key: &str| format!("{architecture}.{key}");
    let get = |key: &str| reader::uint(meta, &full(key));
    let array = |key: &str| match meta.get(&full(key)) {
        Some(Value::Array(_, items)) => Some(items.clone()),
        _ => None,
    };
    let need = |key: &str| get(key).ok_or_else(|| format!("no {} in the header", full(key)));
    let layers = need("block_count")?;
    if layers > MAX_LAYERS {
        return Err(format!(
            "{} is {layers}, more layers than any model has (at most {MAX_LAYERS})",
            full("block_count")
        ));
    }
    let embedding = need("embedding_length")?;
    let context_length = need("context_length")?;
    // Per layer, or one value for all; the largest stands for the model.
    let per_layer = |key: &str| -> Option<Vec<u64>> {
        if let Some(v) = get(key) {
            return Some(vec![v; layers as usize]);
        }
        let items = array(key)?;
        let mut out: Vec<u64> = items
            .iter()
            .map(|i| u64::try_from(*i).unwrap_or(0))
            .collect();
        out.resize(layers as usize, 0);
        Some(out)
    };
    let heads_per_layer = per_layer("attention.head_count");
    let heads = heads_per_layer
        .as_ref()
        .and_then(|h| h.iter().copied().max())
        .unwrap_or(0);
    let recurrent_arch = ["mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"]
        .contains(&architecture.as_str());
    if heads_per_layer.is_none() && !recurrent_arch {
        return Err(format!("no {} in the header", full("attention.head_count")));
    }
    let kv_per_layer = per_layer("attention.head_count_kv")
        .or(heads_per_layer)
        .unwrap_or_else(|| vec![0; layers as usize]);
    let kv_heads = kv_per_layer.iter().copied().max().unwrap_or(0);
    let key_length = get("attention.key_length").unwrap_or(embedding / heads.max(1));
    let value_length = get("attention.value_length").unwrap_or(key_length);
    let feed_forward = get("feed_forward_length").unwrap_or(embedding.saturating_mul(4));
    let vocab = match meta.get("tokenizer.ggml.tokens") {
        Some(Value::Array(n, _)) => *n,
        _ => 0,
    };
    let mut model = GgufModel {
        architecture: architecture.clone(),
        weights_bytes: header.data_bytes,
        layers,
        kv_heads,
        key_length,
        value_length,
        context_length,
        heads,
        embedding,
        feed_forward,
        vocab,
        ..GgufModel::default()
    };
    let hparams = arch::Hparams {
        arch: &architecture,
        layers,
        embedding,
        kv_heads: &kv_per_layer,
        get: &get,
        array: &array,
    };
    // MLA (llama-kv-cache.cpp, `is_mla`): the header gives the per-head
    // sizes before compression; the cache holds K only, one
    // (kv_lora_rank + rope) row per KV head.
    let mla =
        get("attention.key_length_mla").is_some() && get("attention.value_length_mla").is_some();
    // A header's sizes are taken as the model's word, but nothing says
    // their products fit in 64 bits: an overflow is an error, never a
    // wrapped figure (nor, in a debug build, a panic).
    let overflow = || {
        format!(
            "the KV geometry in the header ({}, key and value lengths) overflows 64 bits",
            full("attention.head_count_kv")
        )
    };
    let per_head = |swa: bool| {
        let (k, v) = if swa {
            (
                get("attention.key_length_swa").unwrap_or(key_length),
                get("attention.value_length_swa").unwrap_or(value_length),
            )
        } else {
            (key_length, value_length)
        };
        if mla { Some(k) } else { k.checked_add(v) }
    };
    let layer_elements = |il: usize, swa: bool| {
        per_head(swa)
            .and_then(|per| kv_per_layer[il].checked_mul(per))
            .ok_or_else(overflow)
    };
    let unknown = |why: String| -> Result<_, String> {
        // A plain dense estimate: every layer caches the whole context.
        let mut kv_full = 0u64;
        for il in 0..kv_per_layer.len() {
            kv_full = kv_full
                .checked_add(layer_elements(il, false)?)
                .ok_or_else(overflow)?;
        }
        Ok((kv_full, Some(why)))
    };
    match arch::layout(&hparams)? {
        None => {
            (model.kv_full, model.not_sized) = unknown(format!(
                "architecture '{architecture}' is not one residentd sizes as llama.cpp does"
            ))?;
        }
        Some(_) if get("attention.shared_kv_layers").is_some() => {
            (model.kv_full, model.not_sized) = unknown(format!(
                "architecture '{architecture}' with {} (layers sharing a KV cache) is not sized as llama.cpp does",
                full("attention.shared_kv_layers")
            ))?;
        }
        Some(layout) => {
            // MTP heads (nextn_predict_layers) hold no KV in the trunk's
            // context (create_memory's layer filter).
            let trunk = layers.saturating_sub(get("nextn_predict_layers").unwrap_or(0));
            for (il, attends) in layout.attention.iter().enumerate() {
                let Some(swa) = *attends else { continue };
                if il as u64 >= trunk {
                    continue;
                }
                let sum = if swa {
                    &mut model.kv_swa
                } else {
                    &mut model.kv_full
                };
                *sum = sum
                    .checked_add(layer_elements(il, swa)?)
                    .ok_or_else(overflow)?;
            }
            model.sliding_window = layout.window;
            let recurrent = layout.recurrent.iter().filter(|r| **r).count() as u64;
            model.state = recurrent
                .checked_mul(layout.state_per_layer)
                .ok_or_else(|| format!("the {architecture} recurrent state overflows 64 bits"))?;
        }
    }
    Ok(model)
}
