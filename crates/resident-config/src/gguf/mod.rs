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
//! metadata and the tensor index, never the tensor data, and bounds
//! what a header may claim. `model.rs` turns a header into a
//! `GgufModel`.

mod arch;
mod model;
mod reader;

pub use model::{MAX_LAYERS, read, tensor_bytes};

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
