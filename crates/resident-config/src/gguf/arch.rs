//! Which layers of an architecture hold what, as llama.cpp (the version
//! llama-cpp-python 0.3.36 vendors) lays out its memory: KV cache over
//! the whole context, KV cache over a sliding window, recurrent state, or
//! nothing. Each rule below names the llama.cpp source it follows
//! (`src/models/ARCH.cpp`, `load_arch_hparams`; `src/llama-model.cpp`,
//! `create_memory`).

/// The header values a layout reads, for one architecture.
pub(super) struct Hparams<'a> {
    pub(super) arch: &'a str,
    pub(super) layers: u64,
    pub(super) embedding: u64,
    /// `attention.head_count_kv`, per layer.
    pub(super) kv_heads: &'a [u64],
    /// `{arch}.KEY` as an integer.
    pub(super) get: &'a dyn Fn(&str) -> Option<u64>,
    /// `{arch}.KEY` as an array of integers.
    pub(super) array: &'a dyn Fn(&str) -> Option<Vec<i64>>,
}

/// What each layer holds.
#[derive(Debug, Default)]
pub(super) struct Layout {
    /// Per layer: KV cache over the whole context (`Some(false)`), over a
    /// sliding window (`Some(true)`), or none.
    pub(super) attention: Vec<Option<bool>>,
    /// Per layer: whether it holds recurrent state.
    pub(super) recurrent: Vec<bool>,
    /// The sliding window in tokens (0: none).
    pub(super) window: u64,
    /// f32 elements of state one recurrent layer holds per sequence
    /// (llama.cpp's `n_embd_r() + n_embd_s()`).
    pub(super) state_per_layer: u64,
}

/// Architectures whose every layer caches K and V over the whole
/// context in a plain `llama_kv_cache` (`create_memory`'s default branch,
/// no sliding window): the common dense and MoE transformers.
const DENSE: &[&str] = &[
    "llama",
    "mistral3",
    "qwen",
    "qwen2",
    "qwen2moe",
    "qwen2vl",
    "qwen3",
    "qwen3moe",
    "qwen3vl",
    "qwen3vlmoe",
    "phi2",
    "phi3",
    "phimoe",
    "starcoder",
    "starcoder2",
    "stablelm",
    "gpt2",
    "gptneox",
    "bloom",
    "mpt",
    "falcon",
    "refact",
    "command-r",
    "internlm2",
    "granite",
    "granitemoe",
    "olmo",
    "olmoe",
    "deepseek",
    "deepseek2",
    "minicpm",
    "chatglm",
    "glm4",
    "exaone",
    "nemotron",
    "baichuan",
    "orion",
    "xverse",
    "codeshell",
    "smollm3",
    "ernie4_5",
    "ernie4_5-moe",
    "seed_oss",
    "arcee",
    "bitnet",
    "dbrx",
];

/// `set_swa_pattern(n_pattern, dense_first = false)` in
/// `llama-hparams.cpp`: layer `il` slides unless it is the last of each
/// group of `n_pattern` (0: every layer slides); or, when the header
/// gives `sliding_window_pattern` as an array, that array.
fn swa_pattern(h: &Hparams<'_>, n_pattern: u64) -> Vec<Option<bool>> {
    let key = "attention.sliding_window_pattern";
    if let Some(flags) = (h.array)(key).filter(|a| !a.is_empty()) {
        return (0..h.layers as usize)
            .map(|il| Some(flags.get(il).is_some_and(|f| *f != 0)))
            .collect();
    }
    let n = (h.get)(key).unwrap_or(n_pattern);
    (0..h.layers)
        .map(|il| Some(n == 0 || il % n < n - 1))
        .collect()
}

/// Mamba's state per layer and sequence (`n_embd_r`, `n_embd_s` in
/// `llama-hparams.cpp`): the convolution's last `conv_kernel - 1` inputs
/// over the inner size and the groups' B and C, and the SSM state.
fn mamba_state(h: &Hparams<'_>) -> Result<u64, String> {
    let need = |k: &str| (h.get)(k).ok_or_else(|| format!("no {}.{k} in the header", h.arch));
    let conv = need("ssm.conv_kernel")?;
    let inner = need("ssm.inner_size")?;
    let state = need("ssm.state_size")?;
    let groups = (h.get)("ssm.group_count").unwrap_or(0);
    let r = 2u64
        .checked_mul(groups)
        .and_then(|g| g.checked_mul(state))
        .and_then(|bc| bc.checked_add(inner))
        .and_then(|row| row.checked_mul(conv.saturating_sub(1)));
    r.and_then(|r| r.checked_add(state.checked_mul(inner)?))
        .ok_or_else(|| overflow(h, "ssm"))
}

/// The error for a header whose `{arch}.KEYS.*` sizes overflow 64 bits.
fn overflow(h: &Hparams<'_>, keys: &str) -> String {
    format!("the {}.{keys} sizes in the header overflow 64 bits", h.arch)
}

/// RWKV's state per layer and sequence: `token_shift_count` (2 unless
/// the header says) rows of the embedding, and the WKV state (embedding
/// x head size).
fn rwkv_state(h: &Hparams<'_>) -> Result<u64, String> {
    let head = (h.get)("wkv.head_size")
        .ok_or_else(|| format!("no {}.wkv.head_size in the header", h.arch))?;
    let shift = (h.get)("token_shift_count").unwrap_or(2);
    let shift_rows = shift.checked_mul(h.embedding);
    let wkv = h.embedding.checked_mul(head);
    shift_rows
        .zip(wkv)
        .and_then(|(s, w)| s.checked_add(w))
        .ok_or_else(|| overflow(h, "wkv"))
}

/// The layout of `h.arch`; `Ok(None)` for an architecture this does not
/// know (the caller falls back); `Err` for a known one whose header
/// lacks a key llama.cpp requires.
pub(super) fn layout(h: &Hparams<'_>) -> Result<Option<Layout>, String> {
    let n = h.layers as usize;
    let window_key = (h.get)("attention.sliding_window");
    let need_window = || {
        window_key.ok_or_else(|| {
            format!(
                "no {}.attention.sliding_window in the header (llama.cpp requires it)",
                h.arch
            )
        })
    };
    let mut out = Layout {
        attention: vec![Some(false); n],
        recurrent: vec![false; n],
        ..Layout::default()
    };
    // Sliding-window attention: (window, n_pattern) per models/ARCH.cpp.
    let swa = match h.arch {
        // gemma2.cpp: window 4096 unless the header says; every other layer.
        "gemma2" => Some((window_key.unwrap_or(4096), 2)),
        // gemma3.cpp: only with a nonzero window in the header; 5 of 6.
        "gemma3" => window_key.filter(|w| *w > 0).map(|w| (w, 6)),
        // cohere2.cpp: window required; 3 of 4.
        "cohere2" => Some((need_window()?, 4)),
        // openai-moe.cpp (gpt-oss): window required; every other layer.
        "gpt-oss" => Some((need_window()?, 2)),
        // olmo2.cpp: only with a nonzero window; 3 of 4.
        "olmo2" => window_key.filter(|w| *w > 0).map(|w| (w, 4)),
        // exaone4.cpp: the 64-layer model only, window 4096 unless given.
        "exaone4" if h.layers == 64 => Some((window_key.unwrap_or(4096), 4)),
        "exaone4" => None,
        // llama4.cpp: chunked attention over 8192 tokens (the header's
        // window only switches it off, with 0); 3 of 4 layers.
        "llama4" if window_key == Some(0) => None,
        "llama4" => Some((8192, 4)),
        _ => None,
    };
    if let Some((window, pattern)) = swa {
        out.window = window;
        out.attention = swa_pattern(h, pattern);
        return Ok(Some(out));
    }
    if ["gemma3", "olmo2", "exaone4", "llama4"].contains(&h.arch) || DENSE.contains(&h.arch) {
        return Ok(Some(out));
    }
    match h.arch {
        // llm_arch_is_recurrent: every layer holds state, none a KV cache.
        "mamba" | "mamba2" => {
            out.state_per_layer = mamba_state(h)?;
            out.attention = vec![None; n];
            out.recurrent = vec![true; n];
        }
        "rwkv6" | "rwkv6qwen2" | "rwkv7" | "arwkv7" => {
            out.state_per_layer = rwkv_state(h)?;
            out.attention = vec![None; n];
            out.recurrent = vec![true; n];
        }
        // jamba.cpp, granite-hybrid.cpp: a layer with no KV heads is a
        // Mamba layer; the others attend.
        "jamba" | "granitehybrid" => {
            out.state_per_layer = mamba_state(h)?;
            for il in 0..n {
                let recurrent = h.kv_heads.get(il).copied().unwrap_or(0) == 0;
                out.recurrent[il] = recurrent;
                out.attention[il] = (!recurrent).then_some(false);
            }
        }
        // falcon-h1.cpp: every layer both attends and holds Mamba-2 state.
        "falcon-h1" => {
            out.state_per_layer = mamba_state(h)?;
            out.recurrent = vec![true; n];
        }
        _ => return Ok(None),
    }
    Ok(Some(out))
}
