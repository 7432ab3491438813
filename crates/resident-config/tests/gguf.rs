//! GGUF sizing on small GGUF files the test writes itself.

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
            "[node]\nname = \"n\"\nlisten = \"unix:///tmp/x.sock\"\n[[pool]]\nname = \"gpu0\"\nbudget = \"24GB\"\n[[workload]]\nname = \"tiny\"\ncommand = [\"/bin/true\"]\n[workload.memory.gpu0]\n{memory}\n"
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

#[test]
fn the_compute_buffer_estimate_matches_what_llama_cpp_reports() {
    let (_dir, path) = temp("small.gguf");
    small_test_model().write(&path);
    let m = gguf::read(&path).expect("a valid GGUF");
    assert_eq!(
        (m.heads, m.embedding, m.feed_forward, m.vocab),
        (4, 256, 704, 335)
    );
    // llama.cpp 0.3.36 (llama-cpp-python's server, CPU) printed
    // "CPU compute buffer size = 8.01 MiB" at ctx 512 and 43.01 MiB at
    // 4096 for this geometry.
    let mib = |b: u64| b as f64 / 1_048_576.0;
    for (ctx, reported) in [(512, 8.01), (4096, 43.01)] {
        let estimate = mib(m.compute_bytes(ctx));
        assert!(
            (estimate - reported).abs() < 0.25,
            "ctx {ctx}: {estimate:.2} MiB against {reported} MiB"
        );
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
            "[node]\nname = \"n\"\nlisten = \"unix:///tmp/x.sock\"\n[[pool]]\nname = \"ram\"\nbudget = \"24GB\"\n[[workload]]\nname = \"s\"\nflavor = \"{flavor}\"\nmodel = \"{}\"\nctx = 512\n{memory}\n",
            path.display()
        )
    };
    let file = dir.path().join("c.toml");
    let demand = |text: String| {
        let c = resident_config::parse(&file, &text).expect("valid");
        c.workloads["s"].spec.demand["ram"]
    };
    let py = demand(config("llama-cpp-python", ""));
    assert_eq!(py.overhead, 76_000_000 + m.compute_bytes(512));
    assert_eq!(py.kv, m.kv_bytes(512, "f16").expect("f16"));
    assert_eq!(py.footprint(), py.weights + py.kv + py.overhead);
    let server = demand(config("llama-server", ""));
    assert!(server.overhead > m.compute_bytes(512) && server.overhead < py.overhead);
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
