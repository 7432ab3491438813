//! GGUF sizing on small GGUF files the test writes itself.

#![allow(clippy::disallowed_methods)] // clippy.toml is for src/validate/ only

use std::path::{Path, PathBuf};

use resident_config::gguf;

/// A little GGUF writer: metadata, a tensor index, aligned tensor data.
struct Gguf {
    version: u32,
    meta: Vec<u8>,
    meta_count: u64,
    tensors: Vec<(String, Vec<u64>, u32, usize)>,
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend((s.len() as u64).to_le_bytes());
    buf.extend(s.as_bytes());
}

impl Gguf {
    fn new(version: u32) -> Self {
        Self {
            version,
            meta: Vec::new(),
            meta_count: 0,
            tensors: Vec::new(),
        }
    }

    fn u32(mut self, key: &str, v: u32) -> Self {
        put_str(&mut self.meta, key);
        self.meta.extend(4u32.to_le_bytes());
        self.meta.extend(v.to_le_bytes());
        self.meta_count += 1;
        self
    }

    fn string(mut self, key: &str, v: &str) -> Self {
        put_str(&mut self.meta, key);
        self.meta.extend(8u32.to_le_bytes());
        put_str(&mut self.meta, v);
        self.meta_count += 1;
        self
    }

    fn strings(mut self, key: &str, items: &[&str]) -> Self {
        put_str(&mut self.meta, key);
        self.meta.extend(9u32.to_le_bytes());
        self.meta.extend(8u32.to_le_bytes());
        self.meta.extend((items.len() as u64).to_le_bytes());
        for i in items {
            put_str(&mut self.meta, i);
        }
        self.meta_count += 1;
        self
    }

    /// An array of u32 (GGUF type 4 inside type 9).
    fn u32s(mut self, key: &str, items: &[u32]) -> Self {
        put_str(&mut self.meta, key);
        self.meta.extend(9u32.to_le_bytes());
        self.meta.extend(4u32.to_le_bytes());
        self.meta.extend((items.len() as u64).to_le_bytes());
        for i in items {
            self.meta.extend(i.to_le_bytes());
        }
        self.meta_count += 1;
        self
    }

    /// An array of booleans (GGUF type 7 inside type 9).
    fn bools(mut self, key: &str, items: &[bool]) -> Self {
        put_str(&mut self.meta, key);
        self.meta.extend(9u32.to_le_bytes());
        self.meta.extend(7u32.to_le_bytes());
        self.meta.extend((items.len() as u64).to_le_bytes());
        self.meta.extend(items.iter().map(|b| u8::from(*b)));
        self.meta_count += 1;
        self
    }

    fn f32(mut self, key: &str, v: f32) -> Self {
        put_str(&mut self.meta, key);
        self.meta.extend(6u32.to_le_bytes());
        self.meta.extend(v.to_le_bytes());
        self.meta_count += 1;
        self
    }

    /// An f32 tensor of these dimensions.
    fn tensor(mut self, name: &str, dims: &[u64]) -> Self {
        let bytes = dims.iter().product::<u64>() as usize * 4;
        self.tensors
            .push((name.to_string(), dims.to_vec(), 0, bytes));
        self
    }

    /// Writes the file; returns the bytes of tensor data (aligned to 32).
    fn write(&self, path: &Path) -> u64 {
        let align = |n: usize| n.div_ceil(32) * 32;
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.meta_count.to_le_bytes());
        out.extend(&self.meta);
        let mut offset = 0usize;
        for (name, dims, ty, bytes) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset += align(*bytes);
        }
        out.resize(align(out.len()), 0);
        let header = out.len();
        out.resize(header + offset, 0x5a);
        std::fs::write(path, &out).expect("write the model");
        offset as u64
    }
}

fn llama() -> Gguf {
    Gguf::new(3)
        .string("general.architecture", "llama")
        .string("general.name", "tiny test model")
        .u32("llama.block_count", 4)
        .u32("llama.context_length", 2048)
        .u32("llama.embedding_length", 256)
        .u32("llama.attention.head_count", 8)
        .u32("llama.attention.head_count_kv", 2)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .strings("tokenizer.ggml.tokens", &["<unk>", "<s>", "</s>", "hello"])
        .tensor("token_embd.weight", &[256, 4])
        .tensor("blk.0.attn_q.weight", &[256, 256])
        .tensor("output_norm.weight", &[3])
}

fn temp(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(name);
    (dir, path)
}

#[test]
fn reads_weights_and_kv_geometry_from_the_header() {
    let (_dir, path) = temp("tiny.gguf");
    let data = llama().write(&path);
    let m = gguf::read(&path).expect("a valid GGUF");
    assert_eq!(m.architecture, "llama");
    assert_eq!(m.weights_bytes, data);
    assert_eq!(
        data,
        4096 + 262_144 + 32,
        "three f32 tensors, each aligned to 32"
    );
    assert_eq!(
        (
            m.layers,
            m.kv_heads,
            m.key_length,
            m.value_length,
            m.context_length
        ),
        (4, 2, 32, 32, 2048)
    );
    // 4 layers x 2 KV heads x (32 + 32) x 512 tokens x 2 bytes.
    assert_eq!(m.kv_bytes(512, "f16"), Some(524_288));
    assert_eq!(m.kv_bytes(512, "q8_0"), Some(524_288 / 2 * 34 / 32));
    assert_eq!(m.kv_bytes(512, "f8"), None);
    // Version 2 reads the same.
    let (_dir2, v2) = temp("v2.gguf");
    let mut old = llama();
    old.version = 2;
    old.write(&v2);
    assert_eq!(gguf::read(&v2).expect("v2").weights_bytes, data);
}

#[test]
fn bad_files_say_what_is_wrong() {
    let (_dir, path) = temp("m.gguf");
    let check = |want: &str| {
        let err = gguf::read(&path).expect_err(want);
        assert!(err.contains(want), "{err:?} should say {want:?}");
    };
    check("cannot open");
    std::fs::write(&path, b"hello world, not a model").expect("write");
    check("no GGUF magic");
    let mut v1 = llama();
    v1.version = 1;
    v1.write(&path);
    check("GGUF version 1 is not supported");
    llama().write(&path);
    let full = std::fs::read(&path).expect("read");
    std::fs::write(&path, &full[..100]).expect("truncate");
    check("truncated header");
    Gguf::new(3)
        .string("general.architecture", "llama")
        .write(&path);
    check("no llama.block_count in the header");
}

#[test]
fn a_workload_can_declare_memory_from_a_gguf_file() {
    let (dir, path) = temp("tiny.gguf");
    let data = llama().write(&path);
    let config = |memory: &str| {
        format!(
            "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/x.sock\"\n[[pool]]\nname = \"gpu0\"\nbudget = \"24GB\"\n[[workload]]\nname = \"tiny\"\ncommand = [\"/bin/true\"]\n[workload.memory.gpu0]\n{memory}\n"
        )
    };
    let file = dir.path().join("c.toml");
    let ok = config(&format!(
        "from_gguf = \"{}\"\nctx = 512\nkv_type = \"q8_0\"",
        path.display()
    ));
    let c = resident_config::parse(&file, &ok).expect("valid");
    let d = c.workloads["tiny"].spec.demand["gpu0"];
    assert_eq!((d.weights, d.kv), (data, 278_528));
    // Without ctx, the trained context length; without kv_type, f16.
    let c = resident_config::parse(
        &file,
        &config(&format!("from_gguf = \"{}\"", path.display())),
    )
    .expect("valid");
    assert_eq!(
        c.workloads["tiny"].spec.demand["gpu0"].kv,
        4 * 2 * 64 * 2048 * 2
    );
    let err = |memory: String| {
        resident_config::parse(&file, &config(&memory))
            .expect_err("invalid")
            .to_string()
    };
    let missing = err("from_gguf = \"/nonexistent/model.gguf\"".into());
    assert!(
        missing.contains(
            ":11: workload[tiny].memory.gpu0.from_gguf: /nonexistent/model.gguf: cannot open"
        ),
        "{missing}"
    );
    let bad_type = err(format!(
        "from_gguf = \"{}\"\nkv_type = \"f8\"",
        path.display()
    ));
    assert!(
        bad_type.contains("workload[tiny].memory.gpu0.kv_type: \"f8\" is not a KV cache type"),
        "{bad_type}"
    );
    let both = err(format!(
        "weights = \"1GB\"\nfrom_gguf = \"{}\"",
        path.display()
    ));
    assert!(
        both.contains("give either weights (bytes) or from_gguf"),
        "{both}"
    );
    std::fs::write(&path, b"GGUF").expect("truncate");
    let truncated = err(format!("from_gguf = \"{}\"", path.display()));
    assert!(truncated.contains("truncated header"), "{truncated}");
}

/// The geometry of the tests' small llama.cpp model (tests/llama/
/// make_model.py --embd 256 --layers 4): 4 heads, 704 feed-forward, 335
/// tokens.
fn small_test_model() -> Gguf {
    let tokens: Vec<String> = (0..335).map(|i| format!("t{i}")).collect();
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    Gguf::new(3)
        .string("general.architecture", "llama")
        .u32("llama.block_count", 4)
        .u32("llama.context_length", 4096)
        .u32("llama.embedding_length", 256)
        .u32("llama.feed_forward_length", 704)
        .u32("llama.attention.head_count", 4)
        .u32("llama.attention.head_count_kv", 2)
        .strings("tokenizer.ggml.tokens", &tokens)
        .tensor("token_embd.weight", &[256, 335])
}

/// The tests' model geometry at `embd` wide (4 heads, 2 KV heads, a
/// feed-forward 11/4 as wide, 335 tokens), as make_model.py writes it.
fn test_model(embd: u64) -> Gguf {
    let tokens: Vec<String> = (0..335).map(|i| format!("t{i}")).collect();
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    Gguf::new(3)
        .string("general.architecture", "llama")
        .u32("llama.block_count", 4)
        .u32("llama.context_length", 8192)
        .u32("llama.embedding_length", embd as u32)
        .u32("llama.feed_forward_length", (embd * 11 / 4) as u32)
        .u32("llama.attention.head_count", 4)
        .u32("llama.attention.head_count_kv", 2)
        .strings("tokenizer.ggml.tokens", &tokens)
        .tensor("token_embd.weight", &[embd, 335])
}

#[test]
fn the_compute_buffer_estimate_matches_what_llama_cpp_reports() {
    let (_dir, path) = temp("small.gguf");
    small_test_model().write(&path);
    let m = gguf::read(&path).expect("a valid GGUF");
    assert_eq!(
        (m.heads, m.embedding, m.feed_forward, m.vocab),
        (4, 256, 704, 335)
    );
    // "CPU compute buffer size = N MiB" (sched_reserve) as llama.cpp
    // 0.3.36 printed it through llama-cpp-python (`Llama(model, n_ctx,
    // flash_attn, type_k/type_v = 8 with flash attention)`, CPU), for
    // the tests' models 256, 512 and 1024 wide, at contexts 512, 2048
    // and 8192: without flash attention, then with it.
    let reported: [(u64, bool, [f64; 3]); 6] = [
        (256, false, [8.01, 23.01, 83.01]),
        (512, false, [13.26, 26.01, 86.01]),
        (1024, false, [27.51, 32.01, 92.01]),
        (256, true, [6.17, 7.67, 13.67]),
        (512, true, [12.84, 13.34, 19.34]),
        (1024, true, [25.28, 24.78, 30.78]),
    ];
    let mib = |b: u64| b as f64 / 1_048_576.0;
    for (embd, flash, figures) in reported {
        let (_dir, path) = temp("m.gguf");
        test_model(embd).write(&path);
        let m = gguf::read(&path).expect("a valid GGUF");
        for (ctx, reported) in [512, 2048, 8192].into_iter().zip(figures) {
            // Less the CPU backend's work buffer, which llama.cpp does not
            // count in its compute buffer.
            let work = if flash { 0 } else { 4 * ctx * 512 * 2 };
            let estimate = mib(m.compute_bytes(ctx, flash) - work);
            assert!(
                (-2.1..=1.8).contains(&(estimate - reported)),
                "{embd} wide, ctx {ctx}, flash attention {flash}: {estimate:.2} MiB against {reported} MiB"
            );
        }
    }
    // A feed-forward length the header does not give is 4 x embedding.
    let (_dir, bare) = temp("bare.gguf");
    llama().write(&bare);
    assert_eq!(gguf::read(&bare).expect("valid").feed_forward, 1024);
}

#[test]
fn a_flavor_reserves_its_servers_process_and_compute_buffer() {
    let (dir, path) = temp("small.gguf");
    small_test_model().write(&path);
    let m = gguf::read(&path).expect("a valid GGUF");
    let config = |flavor: &str, memory: &str| {
        format!(
            "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/x.sock\"\n[[pool]]\nname = \"ram\"\nbudget = \"24GB\"\n[[workload]]\nname = \"s\"\nflavor = \"{flavor}\"\nmodel = \"{}\"\nctx = 512\n{memory}\n",
            path.display()
        )
    };
    let file = dir.path().join("c.toml");
    let demand = |text: String| {
        let c = resident_config::parse(&file, &text).expect("valid");
        c.workloads["s"].spec.demand["ram"]
    };
    let py = demand(config("llama-cpp-python", ""));
    // The process, the compute buffer and one sequence's logits.
    assert_eq!(
        py.overhead,
        76_000_000 + m.compute_bytes(512, false) + 335 * 4
    );
    assert_eq!(py.kv, m.kv_bytes(512, "f16").expect("f16"));
    assert_eq!(py.footprint(), py.weights + py.kv + py.overhead);
    let server = demand(config("llama-server", ""));
    assert!(server.overhead > m.compute_bytes(512, true) && server.overhead < py.overhead);
    // A declared overhead stands.
    let own = demand(config(
        "llama-server",
        "[workload.memory.ram]\noverhead = \"10MB\"",
    ));
    assert_eq!(own.overhead, 10_000_000);
    // vLLM's share of its card is its whole footprint: no overhead added.
    let vllm = demand(config("vllm", ""));
    assert_eq!(vllm.overhead, 0);
}

/// `n` token strings (the tests' models have make_model.py's 335).
fn tokens(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("t{i}")).collect()
}

/// A header of `arch` with the keys every model of tests/llama/
/// arch_models.py has (its GEOMETRY, 335 tokens), and `heads` attention
/// heads (0 for the recurrent ones, as that script writes).
fn arch_model(arch: &str, layers: u32, heads: u32) -> Gguf {
    let tokens = tokens(335);
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    Gguf::new(3)
        .string("general.architecture", arch)
        .u32(&format!("{arch}.context_length"), 8192)
        .u32(&format!("{arch}.embedding_length"), 64)
        .u32(&format!("{arch}.block_count"), layers)
        .u32(&format!("{arch}.attention.head_count"), heads)
        .strings("tokenizer.ggml.tokens", &tokens)
        .tensor("token_embd.weight", &[64, 335])
}

fn gemma2() -> Gguf {
    arch_model("gemma2", 4, 4)
        .u32("gemma2.feed_forward_length", 128)
        .u32("gemma2.attention.head_count_kv", 2)
        .u32("gemma2.attention.key_length", 64)
        .u32("gemma2.attention.value_length", 64)
        .u32("gemma2.attention.sliding_window", 256)
}

fn gemma3() -> Gguf {
    arch_model("gemma3", 7, 4)
        .u32("gemma3.feed_forward_length", 128)
        .u32("gemma3.attention.head_count_kv", 1)
        .u32("gemma3.attention.key_length", 32)
        .u32("gemma3.attention.value_length", 32)
        .u32("gemma3.attention.sliding_window", 512)
}

/// MLA as convert_hf_to_gguf writes it: one KV head whose key is the
/// compressed latent (64) plus the rope part (16).
fn deepseek2() -> Gguf {
    arch_model("deepseek2", 3, 4)
        .u32("deepseek2.feed_forward_length", 128)
        .u32("deepseek2.attention.head_count_kv", 1)
        .u32("deepseek2.attention.key_length", 80)
        .u32("deepseek2.attention.value_length", 64)
        .u32("deepseek2.attention.key_length_mla", 48)
        .u32("deepseek2.attention.value_length_mla", 32)
        .u32("deepseek2.attention.kv_lora_rank", 64)
        .u32("deepseek2.rope.dimension_count", 16)
}

fn ssm(g: Gguf, arch: &str) -> Gguf {
    g.u32(&format!("{arch}.ssm.conv_kernel"), 4)
        .u32(&format!("{arch}.ssm.inner_size"), 128)
        .u32(&format!("{arch}.ssm.state_size"), 16)
        .u32(&format!("{arch}.ssm.time_step_rank"), 4)
}

fn mamba() -> Gguf {
    ssm(arch_model("mamba", 3, 0), "mamba")
}

fn rwkv6() -> Gguf {
    arch_model("rwkv6", 3, 0)
        .u32("rwkv6.feed_forward_length", 224)
        .u32("rwkv6.wkv.head_size", 16)
}

/// Attention on layers 1 and 3 (2 KV heads), Mamba on 0 and 2.
fn jamba() -> Gguf {
    ssm(arch_model("jamba", 4, 4), "jamba")
        .u32("jamba.feed_forward_length", 128)
        .u32s("jamba.attention.head_count_kv", &[0, 2, 0, 2])
}

/// One row of the table: a model, how llama-server ran it, and what it
/// reported.
struct Reported {
    case: &'static str,
    model: fn() -> Gguf,
    ctx: u64,
    kv_type: &'static str,
    seqs: u64,
    unified: bool,
    swa_full: bool,
    /// KV cells per stream, and in the sliding-window layers (0: none).
    cells: (u64, u64),
    /// "KV buffer size" in MiB, summed over llama.cpp's caches (the
    /// full-context one and the sliding-window one).
    kv_mib: f64,
    /// "RS buffer size" in MiB.
    state_mib: f64,
    /// "output buffer size" in MiB.
    output_mib: f64,
}

/// What llama.cpp itself reports for these headers. Recorded with
/// `tests/llama/record_sizes.sh` (it writes the models with
/// tests/llama/arch_models.py and make_model.py, runs `llama-server -v -t
/// 1 -m MODEL.gguf ARGS` of llama.cpp as llama-cpp-python 0.3.36 vendors
/// it, on the CPU, and keeps the lines `llama_kv_cache: CPU KV buffer
/// size = ...`, `llama_kv_cache_iswa: creating [non-]SWA KV cache, size
/// = N cells`, `llama_kv_cache: size = ... (N cells, ...)`,
/// `llama_memory_recurrent: CPU RS buffer size = ...` and `llama_context:
/// CPU output buffer size = ...` of the context it serves with). It
/// prints MiB with two decimals: our bytes must round to the same.
const REPORTED: &[Reported] = &[
    // -c 4096 -np 4: 1024 cells for each of 4 sequences.
    Reported {
        case: "llama -c 4096 -np 4",
        model: small_test_model,
        ctx: 4096,
        kv_type: "f16",
        seqs: 4,
        unified: false,
        swa_full: false,
        cells: (1024, 0),
        kv_mib: 8.00,
        state_mib: 0.0,
        output_mib: 0.01,
    },
    // -c 4096 -np 4 -kvu, and llama-server's default (no -np: 4 slots
    // over one unified cache): 4096 cells shared.
    Reported {
        case: "llama -c 4096 -np 4 -kvu",
        model: small_test_model,
        ctx: 4096,
        kv_type: "f16",
        seqs: 4,
        unified: true,
        swa_full: false,
        cells: (4096, 0),
        kv_mib: 8.00,
        state_mib: 0.0,
        output_mib: 0.01,
    },
    // -c 1000 -np 1: padded to 1024 cells.
    Reported {
        case: "llama -c 1000 -np 1",
        model: small_test_model,
        ctx: 1000,
        kv_type: "f16",
        seqs: 1,
        unified: false,
        swa_full: false,
        cells: (1024, 0),
        kv_mib: 2.00,
        state_mib: 0.0,
        output_mib: 0.00,
    },
    // -c 4096 -np 1 -fa on -ctk q8_0 -ctv q8_0.
    Reported {
        case: "llama -c 4096 -np 1 q8_0",
        model: small_test_model,
        ctx: 4096,
        kv_type: "q8_0",
        seqs: 1,
        unified: false,
        swa_full: false,
        cells: (4096, 0),
        kv_mib: 4.25,
        state_mib: 0.0,
        output_mib: 0.00,
    },
    // gemma2 -c 4096 (default: 4 slots, unified): non-SWA 4096 cells
    // (4.00 MiB), SWA 1536 cells = 256 x 4 + 512 (1.50 MiB).
    Reported {
        case: "gemma2 -c 4096",
        model: gemma2,
        ctx: 4096,
        kv_type: "f16",
        seqs: 4,
        unified: true,
        swa_full: false,
        cells: (4096, 1536),
        kv_mib: 4.00 + 1.50,
        state_mib: 0.0,
        output_mib: 0.01,
    },
    // gemma2 -c 4096 -np 1: SWA 768 cells = 256 + 512 (0.75 MiB).
    Reported {
        case: "gemma2 -c 4096 -np 1",
        model: gemma2,
        ctx: 4096,
        kv_type: "f16",
        seqs: 1,
        unified: false,
        swa_full: false,
        cells: (4096, 768),
        kv_mib: 4.00 + 0.75,
        state_mib: 0.0,
        output_mib: 0.00,
    },
    // gemma2 -c 4096 -np 2: 2048 and 768 cells, 2 streams.
    Reported {
        case: "gemma2 -c 4096 -np 2",
        model: gemma2,
        ctx: 4096,
        kv_type: "f16",
        seqs: 2,
        unified: false,
        swa_full: false,
        cells: (2048, 768),
        kv_mib: 4.00 + 1.50,
        state_mib: 0.0,
        output_mib: 0.00,
    },
    // gemma2 -c 4096 -np 1 --swa-full: both caches 4096 cells.
    Reported {
        case: "gemma2 -c 4096 -np 1 --swa-full",
        model: gemma2,
        ctx: 4096,
        kv_type: "f16",
        seqs: 1,
        unified: false,
        swa_full: true,
        cells: (4096, 4096),
        kv_mib: 4.00 + 4.00,
        state_mib: 0.0,
        output_mib: 0.00,
    },
    // gemma3 -c 8192 -np 1: 1 non-SWA layer over 8192 cells (1.00 MiB),
    // 6 SWA layers over 512 + 512 = 1024 (0.75 MiB).
    Reported {
        case: "gemma3 -c 8192 -np 1",
        model: gemma3,
        ctx: 8192,
        kv_type: "f16",
        seqs: 1,
        unified: false,
        swa_full: false,
        cells: (8192, 1024),
        kv_mib: 1.00 + 0.75,
        state_mib: 0.0,
        output_mib: 0.00,
    },
    // deepseek2 -c 8192 -np 1: "K (f16): 3.75 MiB, V (f16): 0.00 MiB".
    Reported {
        case: "deepseek2 (MLA) -c 8192 -np 1",
        model: deepseek2,
        ctx: 8192,
        kv_type: "f16",
        seqs: 1,
        unified: false,
        swa_full: false,
        cells: (8192, 0),
        kv_mib: 3.75,
        state_mib: 0.0,
        output_mib: 0.00,
    },
    // mamba -c 4096 -np 64: "RS buffer size = 1.78 MiB", no KV cache.
    Reported {
        case: "mamba -c 4096 -np 64",
        model: mamba,
        ctx: 4096,
        kv_type: "f16",
        seqs: 64,
        unified: false,
        swa_full: false,
        cells: (256, 0),
        kv_mib: 0.0,
        state_mib: 1.78,
        output_mib: 0.08,
    },
    // rwkv6 -c 4096 -np 64: "RS buffer size = 0.84 MiB".
    Reported {
        case: "rwkv6 -c 4096 -np 64",
        model: rwkv6,
        ctx: 4096,
        kv_type: "f16",
        seqs: 64,
        unified: false,
        swa_full: false,
        cells: (256, 0),
        kv_mib: 0.0,
        state_mib: 0.84,
        output_mib: 0.08,
    },
    // jamba -c 65536 -np 64: KV 16.00 MiB (1024 cells, 2 layers, 64
    // streams), RS 1.19 MiB (the 2 Mamba layers).
    Reported {
        case: "jamba -c 65536 -np 64",
        model: jamba,
        ctx: 65536,
        kv_type: "f16",
        seqs: 64,
        unified: false,
        swa_full: false,
        cells: (1024, 0),
        kv_mib: 16.00,
        state_mib: 1.19,
        output_mib: 0.08,
    },
];

#[test]
fn kv_state_and_output_match_what_llama_cpp_reports() {
    let mib = |b: u64| b as f64 / 1_048_576.0;
    // llama.cpp prints "%8.2f": ours must print the same.
    let same = |ours: u64, reported: f64| format!("{:.2}", mib(ours)) == format!("{reported:.2}");
    for r in REPORTED {
        let (_dir, path) = temp("m.gguf");
        (r.model)().write(&path);
        let m = gguf::read(&path).unwrap_or_else(|e| panic!("{}: {e}", r.case));
        assert_eq!(m.not_sized, None, "{}", r.case);
        let got = m
            .context_memory(&gguf::Serving {
                ctx: r.ctx,
                kv_type: r.kv_type,
                seqs: r.seqs,
                unified: r.unified,
                swa_full: r.swa_full,
            })
            .expect("a known KV type");
        let (cells, swa_cells) = r.cells;
        if r.kv_mib > 0.0 {
            assert_eq!(got.cells, cells, "{}: cells", r.case);
        }
        assert_eq!(got.swa_cells, swa_cells, "{}: SWA cells", r.case);
        assert!(
            same(got.kv, r.kv_mib),
            "{}: KV {:.4} MiB, llama.cpp {:.2}",
            r.case,
            mib(got.kv),
            r.kv_mib
        );
        assert!(
            same(got.state, r.state_mib),
            "{}: state {:.4} MiB, llama.cpp {:.2}",
            r.case,
            mib(got.state),
            r.state_mib
        );
        assert!(
            same(got.output, r.output_mib),
            "{}: output {:.4} MiB, llama.cpp {:.2}",
            r.case,
            mib(got.output),
            r.output_mib
        );
    }
}

#[test]
fn the_layouts_follow_llama_cpps_rules() {
    let read = |g: Gguf| {
        let (_dir, path) = temp("m.gguf");
        g.write(&path);
        gguf::read(&path).expect("valid")
    };
    // gemma2: layers 0 and 2 slide, 1 and 3 attend over the context.
    let m = read(gemma2());
    assert_eq!((m.kv_full, m.kv_swa, m.sliding_window), (512, 512, 256));
    // gemma3: 5 of each 6 slide (layers 0-4 and 6 of 7).
    let m = read(gemma3());
    assert_eq!((m.kv_full, m.kv_swa), (64, 6 * 64));
    // gemma3 without a window: every layer over the whole context.
    let m = read(
        arch_model("gemma3", 7, 4)
            .u32("gemma3.attention.head_count_kv", 1)
            .u32("gemma3.attention.key_length", 32),
    );
    assert_eq!((m.kv_full, m.kv_swa, m.sliding_window), (7 * 64, 0, 0));
    // A pattern the header gives as an array wins over the default.
    let m = read(gemma2().bools(
        "gemma2.attention.sliding_window_pattern",
        &[true, true, true, false],
    ));
    assert_eq!((m.kv_full, m.kv_swa), (256, 3 * 256));
    // MLA: K only, (kv_lora_rank + rope) per layer.
    assert_eq!(read(deepseek2()).kv_full, 3 * 80);
    // The same head sizes without the _mla keys: K and V.
    let m = read(
        arch_model("deepseek2", 3, 4)
            .u32("deepseek2.attention.head_count_kv", 4)
            .u32("deepseek2.attention.key_length", 48)
            .u32("deepseek2.attention.value_length", 32),
    );
    assert_eq!(m.kv_full, 3 * 4 * 80);
    // MTP heads hold no KV in the trunk's context.
    let m = read(deepseek2().u32("deepseek2.nextn_predict_layers", 1));
    assert_eq!(m.kv_full, 2 * 80);
    // Mamba: (4 - 1) x 128 conv + 16 x 128 SSM f32 per layer; mamba2's
    // groups add B and C to the conv state.
    assert_eq!(read(mamba()).state, 3 * (384 + 2048));
    let m = read(ssm(arch_model("mamba2", 3, 0), "mamba2").u32("mamba2.ssm.group_count", 2));
    assert_eq!(m.state, 3 * (3 * (128 + 2 * 2 * 16) + 2048));
    // RWKV: 2 token shifts x 64 + 64 x 16 WKV.
    assert_eq!(read(rwkv6()).state, 3 * (128 + 1024));
    let m = read(rwkv6().u32("rwkv6.token_shift_count", 1));
    assert_eq!(m.state, 3 * (64 + 1024));
    // jamba: KV on the layers with KV heads, state on the others.
    let m = read(jamba());
    assert_eq!((m.kv_full, m.state), (2 * 2 * 32, 2 * (384 + 2048)));
    // falcon-h1: every layer both.
    let m = read(
        ssm(arch_model("falcon-h1", 2, 4), "falcon-h1")
            .u32("falcon-h1.attention.head_count_kv", 2)
            .u32("falcon-h1.ssm.group_count", 1),
    );
    assert_eq!(
        (m.kv_full, m.state),
        (2 * 2 * 32, 2 * (3 * (128 + 32) + 2048))
    );
    // A known SWA architecture without the window llama.cpp requires.
    let (_dir, path) = temp("m.gguf");
    arch_model("gpt-oss", 2, 4).write(&path);
    let err = gguf::read(&path).expect_err("no window");
    assert!(err.contains("gpt-oss.attention.sliding_window"), "{err}");
}

/// A config with one workload on a "ram" pool, `workload` being the
/// rest of its table (and its memory table, if any).
fn one_workload(workload: &str) -> String {
    format!(
        "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/x.sock\"\n[[pool]]\nname = \"ram\"\nbudget = \"24GB\"\n[[workload]]\nname = \"s\"\n{workload}\n"
    )
}

#[test]
fn llama_server_sizes_its_slots_window_and_projector() {
    let (dir, path) = temp("gemma2.gguf");
    gemma2().write(&path);
    let projector = dir.path().join("mmproj.gguf");
    let projector_bytes = Gguf::new(3)
        .string("general.architecture", "clip")
        .tensor("v.patch_embd.weight", &[14, 14, 3, 64])
        .write(&projector);
    let file = dir.path().join("c.toml");
    let server = |extra: &str| {
        let text = one_workload(&format!(
            "flavor = \"llama-server\"\nmodel = \"{}\"\nctx = 4096\n{extra}",
            path.display()
        ));
        resident_config::parse(&file, &text).expect("valid")
    };
    let mib = 1_048_576;
    // No --parallel: 4 slots over a unified cache, as gemma2 -c 4096.
    let c = server("");
    let w = &c.workloads["s"];
    assert_eq!(w.spec.demand["ram"].kv, 4 * mib + 3 * mib / 2);
    // --parallel 1: a window of 768 cells.
    let c = server("parallel = 1");
    assert_eq!(
        c.workloads["s"].spec.demand["ram"].kv,
        4 * mib + 3 * mib / 4
    );
    // --swa-full in the args: the whole context.
    let c = server("parallel = 1\nargs = [\"--swa-full\"]");
    assert_eq!(c.workloads["s"].spec.demand["ram"].kv, 8 * mib);
    // llama-cpp-python takes llama.cpp's context defaults, swa_full on;
    // so does a table without a flavor.
    let text = one_workload(&format!(
        "flavor = \"llama-cpp-python\"\nmodel = \"{}\"\nctx = 4096",
        path.display()
    ));
    let c = resident_config::parse(&file, &text).expect("valid");
    assert_eq!(c.workloads["s"].spec.demand["ram"].kv, 8 * mib);
    let text = one_workload(&format!(
        "command = [\"/bin/true\"]\n[workload.memory.ram]\nfrom_gguf = \"{}\"\nctx = 4096",
        path.display()
    ));
    let c = resident_config::parse(&file, &text).expect("valid");
    assert_eq!(c.workloads["s"].spec.demand["ram"].kv, 8 * mib);
    // The projector's tensors count with the weights, and the server
    // gets --mmproj.
    let plain = server("").workloads["s"].spec.demand["ram"].weights;
    let c = server(&format!("mmproj = \"{}\"", projector.display()));
    let w = &c.workloads["s"];
    assert_eq!(w.spec.demand["ram"].weights, plain + projector_bytes);
    let argv = &w.argv;
    let at = argv.iter().position(|a| a == "--mmproj").expect("--mmproj");
    assert_eq!(argv[at + 1], projector.display().to_string());
    // Only llama-server takes it.
    let text = one_workload(&format!(
        "flavor = \"llama-cpp-python\"\nmodel = \"{}\"\nmmproj = \"{}\"",
        path.display(),
        projector.display()
    ));
    let err = resident_config::parse(&file, &text)
        .expect_err("not its key")
        .to_string();
    assert!(
        err.contains("workload[s].mmproj: is llama-server's"),
        "{err}"
    );
}

#[test]
fn an_architecture_it_cannot_size_warns_and_never_reserves_silently() {
    let (dir, path) = temp("odd.gguf");
    let file = dir.path().join("c.toml");
    let parse = |memory: &str| {
        let text = one_workload(&format!(
            "command = [\"/bin/true\"]\n[workload.memory.ram]\nfrom_gguf = \"{}\"\nctx = 512\n{memory}",
            path.display()
        ));
        resident_config::parse(&file, &text)
    };
    // An unknown architecture with an attention geometry: a dense
    // estimate, and a warning naming the file and the architecture.
    let odd = |arch: &str| {
        Gguf::new(3)
            .string("general.architecture", arch)
            .u32(&format!("{arch}.block_count"), 4)
            .u32(&format!("{arch}.context_length"), 2048)
            .u32(&format!("{arch}.embedding_length"), 256)
            .u32(&format!("{arch}.attention.head_count"), 8)
            .u32(&format!("{arch}.attention.head_count_kv"), 2)
    };
    odd("qwen9next").write(&path);
    let m = gguf::read(&path).expect("valid");
    assert!(
        m.not_sized
            .as_deref()
            .is_some_and(|w| w.contains("qwen9next")),
        "{:?}",
        m.not_sized
    );
    let c = parse("").expect("valid, with a warning");
    assert_eq!(c.workloads["s"].spec.demand["ram"].kv, 4 * 2 * 64 * 512 * 2);
    let warning = c
        .warnings
        .iter()
        .find(|w| w.contains("qwen9next"))
        .expect("a warning about the architecture");
    assert!(
        warning.contains(&path.display().to_string())
            && warning.contains("workload[s].memory.ram.kv")
            && warning.contains("declare kv"),
        "{warning}"
    );
    // A declared kv stands, and then nothing is left to warn about.
    let c = parse("kv = \"1GB\"").expect("valid");
    assert_eq!(c.workloads["s"].spec.demand["ram"].kv, 1_000_000_000);
    assert!(
        !c.warnings.iter().any(|w| w.contains("qwen9next")),
        "{:?}",
        c.warnings
    );
    // Known keys the reader does not size (layers sharing a KV cache)
    // are treated the same.
    odd("llama")
        .u32("llama.attention.shared_kv_layers", 2)
        .write(&path);
    let c = parse("").expect("valid, with a warning");
    assert!(
        c.warnings.iter().any(|w| w.contains("shared_kv_layers")),
        "{:?}",
        c.warnings
    );
    // Nothing to estimate from (no attention heads): an error unless kv
    // is declared; never a silent 0.
    Gguf::new(3)
        .string("general.architecture", "newssm")
        .u32("newssm.block_count", 4)
        .u32("newssm.context_length", 2048)
        .u32("newssm.embedding_length", 256)
        .u32("newssm.attention.head_count", 0)
        .write(&path);
    let err = parse("").expect_err("no kv to reserve").to_string();
    assert!(
        err.contains("workload[s].memory.ram.kv")
            && err.contains("architecture 'newssm'")
            && err.contains("declare kv"),
        "{err}"
    );
    assert_eq!(
        parse("kv = \"2GB\"").expect("valid").workloads["s"]
            .spec
            .demand["ram"]
            .kv,
        2_000_000_000
    );
}

/// The vision projector of tests/llama/arch_models.py (GEOMETRY
/// "mmproj": a 4-block, 128-wide vision tower over 224-pixel images in
/// 14-pixel patches, and a two-layer MLP into 256), tensor by tensor.
fn mmproj() -> Gguf {
    let (e, ff, proj) = (128, 512, 256);
    let mut g = Gguf::new(3)
        .string("general.architecture", "clip")
        .string("clip.projector_type", "mlp")
        .tensor("v.patch_embd.weight", &[14, 14, 3, e])
        .tensor("v.class_embd", &[e])
        .tensor("v.position_embd.weight", &[e, 16 * 16 + 1])
        .tensor("v.pre_ln.weight", &[e])
        .tensor("v.pre_ln.bias", &[e]);
    for i in 0..4 {
        for x in ["attn_q", "attn_k", "attn_v", "attn_out"] {
            g = g
                .tensor(&format!("v.blk.{i}.{x}.weight"), &[e, e])
                .tensor(&format!("v.blk.{i}.{x}.bias"), &[e]);
        }
        for x in ["ln1", "ln2"] {
            g = g
                .tensor(&format!("v.blk.{i}.{x}.weight"), &[e])
                .tensor(&format!("v.blk.{i}.{x}.bias"), &[e]);
        }
        g = g
            .tensor(&format!("v.blk.{i}.ffn_up.weight"), &[e, ff])
            .tensor(&format!("v.blk.{i}.ffn_up.bias"), &[ff])
            .tensor(&format!("v.blk.{i}.ffn_down.weight"), &[ff, e])
            .tensor(&format!("v.blk.{i}.ffn_down.bias"), &[e]);
    }
    g.tensor("mm.0.weight", &[e, proj])
        .tensor("mm.0.bias", &[proj])
        .tensor("mm.2.weight", &[proj, proj])
        .tensor("mm.2.bias", &[proj])
}

#[test]
fn a_vision_projectors_tensors_match_what_llama_cpp_loads() {
    let (_dir, path) = temp("mmproj.gguf");
    let written = mmproj().write(&path);
    let bytes = gguf::tensor_bytes(&path).expect("a valid GGUF");
    assert_eq!(bytes, written);
    // llama-server -m llama.gguf -c 1024 -np 1 --mmproj mmproj.gguf
    // (tests/llama/record_sizes.sh, llama.cpp as llama-cpp-python 0.3.36
    // vendors it) printed "load_hparams: model size: 3.82 MiB" for this
    // projector (the sum of its tensors).
    assert_eq!(format!("{:.2}", bytes as f64 / 1_048_576.0), "3.82");
}

#[path = "gguf/hostile.rs"]
mod hostile;
