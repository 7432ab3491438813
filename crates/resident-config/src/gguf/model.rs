//! A `GgufModel` from a GGUF header: the keys each architecture's
//! sizing reads (`arch.rs` says which layers hold what), at most
//! `MAX_LAYERS` layers, and sizes whose products must fit in 64 bits.

use std::path::Path;

use super::reader::{self, Value};
use super::{GgufModel, arch};

/// Most layers (`{arch}.block_count`) a model may have. Real models have
/// well under 1,000; a header claiming more (2^40, say) is refused
/// rather than sized, since sizing holds a few values per layer.
pub const MAX_LAYERS: u64 = 1 << 16;

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
