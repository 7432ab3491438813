//! GGUF files made to hurt (issue #43): each is refused with an error
//! that says what is wrong, and the config loader names the config file,
//! line and key and the GGUF file; never a signal or a panic, and nothing
//! allocated for what the file only claims.

use std::path::Path;

use resident_config::gguf;

use super::{Gguf, llama, put_str, temp};

/// `g` with an entry `key` of GGUF type `ty` whose value is `value`, byte
/// for byte.
fn raw(mut g: Gguf, key: &str, ty: u32, value: &[u8]) -> Gguf {
    put_str(&mut g.meta, key);
    g.meta.extend(ty.to_le_bytes());
    g.meta.extend(value);
    g.meta_count += 1;
    g
}

/// The bytes of an array: its item type, its length, its items.
fn array(item: u32, len: u64, items: &[u8]) -> Vec<u8> {
    let mut out = item.to_le_bytes().to_vec();
    out.extend(len.to_le_bytes());
    out.extend(items);
    out
}

/// A llama header whose `block_count` is `layers` (a u64).
fn llama_with_layers(layers: u64) -> Gguf {
    raw(
        Gguf::new(3).string("general.architecture", "llama"),
        "llama.block_count",
        10,
        &layers.to_le_bytes(),
    )
    .u32("llama.context_length", 2048)
    .u32("llama.embedding_length", 256)
    .u32("llama.attention.head_count", 8)
    .u32("llama.attention.head_count_kv", 2)
    .tensor("token_embd.weight", &[256, 4])
}

/// Where a hostile file goes wrong: in the header itself, which no
/// reader gets past (a vision projector's tensor count included), or in
/// the model it describes.
#[derive(Clone, Copy, PartialEq)]
enum Bad {
    Header,
    Model,
}

/// Writes a file with `write`; reading it as a model must fail saying
/// `want` (and reading its tensor bytes too, when its header is `bad`),
/// and a config whose workload sizes its memory from it must fail at the
/// `from_gguf` line, naming the GGUF file and saying the same.
fn check(bad: Bad, write: impl FnOnce(&Path), want: &str) {
    let (dir, path) = temp("hostile.gguf");
    write(&path);
    let err = gguf::read(&path).expect_err(want);
    assert!(err.contains(want), "{err:?} should say {want:?}");
    match gguf::tensor_bytes(&path) {
        Err(err) => assert!(
            bad == Bad::Header && err.contains(want),
            "{err:?} should say {want:?}"
        ),
        Ok(_) => assert!(bad == Bad::Model, "tensor_bytes read past {want:?}"),
    }
    refused_by_config(dir.path(), &path, want);
}

/// A config in `dir` whose workload sizes its memory from the GGUF file
/// at `path` fails at the `from_gguf` line, naming the file and saying
/// `want`.
fn refused_by_config(dir: &Path, path: &Path, want: &str) {
    let file = dir.join("c.toml");
    let text = format!(
        "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/x.sock\"\n[[pool]]\nname = \"gpu0\"\nbudget = \"24GB\"\n[[workload]]\nname = \"tiny\"\ncommand = [\"/bin/true\"]\n[workload.memory.gpu0]\nfrom_gguf = \"{}\"\n",
        path.display()
    );
    let err = resident_config::parse(&file, &text)
        .expect_err(want)
        .to_string();
    let at = format!(
        "{}:11: workload[tiny].memory.gpu0.from_gguf: {}: ",
        file.display(),
        path.display()
    );
    assert!(err.starts_with(&at) && err.contains(want), "{err}");
}

/// The bytes of `depth` arrays, each the one item of the one before,
/// the innermost empty.
fn nested(depth: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(depth * 12);
    for _ in 1..depth {
        out.extend(array(9, 1, &[]));
    }
    out.extend(array(4, 0, &[]));
    out
}

#[test]
fn arrays_nested_300_000_deep_are_refused_past_a_depth_bound() {
    let g = raw(llama(), "general.nested", 9, &nested(300_000));
    check(
        Bad::Header,
        |p| _ = g.write(p),
        "metadata \"general.nested\": arrays nested deeper than 64",
    );
    // 65 deep is past the bound; 64 deep is read (and not kept).
    let g = raw(llama(), "general.nested", 9, &nested(65));
    check(
        Bad::Header,
        |p| _ = g.write(p),
        "arrays nested deeper than 64",
    );
    let (_dir, path) = temp("nested.gguf");
    raw(llama(), "general.nested", 9, &nested(64)).write(&path);
    assert_eq!(gguf::read(&path).expect("64 deep").layers, 4);
}

#[test]
fn a_layer_count_no_model_has_is_refused() {
    for (layers, want) in [
        (1u64 << 40, "llama.block_count is 1099511627776"),
        (65_537, "llama.block_count is 65537"),
        (u64::MAX, "llama.block_count is 18446744073709551615"),
    ] {
        check(Bad::Model, |p| _ = llama_with_layers(layers).write(p), want);
    }
    // The bound itself is a model.
    let (_dir, path) = temp("deep.gguf");
    llama_with_layers(65_536).write(&path);
    let m = gguf::read(&path).expect("65,536 layers");
    assert_eq!((m.layers, m.kv_full), (65_536, 65_536 * 2 * 64));
}

#[test]
fn lengths_beyond_the_file_are_refused_at_once() {
    let with = |key: &str, ty: u32, value: Vec<u8>| {
        let g = raw(llama(), key, ty, &value);
        move |p: &Path| _ = g.write(p)
    };
    check(
        Bad::Header,
        with("tokenizer.ggml.scores", 9, array(6, u64::MAX, &[])),
        "metadata \"tokenizer.ggml.scores\": an array of 18446744073709551615 items",
    );
    // An array of arrays each claiming more than the file holds.
    check(
        Bad::Header,
        with("general.nested", 9, array(9, 1, &array(12, 1 << 40, &[]))),
        "metadata \"general.nested\": an array of 1099511627776 items",
    );
    // A string of 16 MiB in a file of a few hundred KiB.
    let mut long = ((1u64 << 24) - 1).to_le_bytes().to_vec();
    long.extend(b"short");
    check(
        Bad::Header,
        with("tokenizer.chat_template", 8, long.clone()),
        "metadata \"tokenizer.chat_template\": a string of 16777215 bytes",
    );
    // The same in an array of strings, and as a key.
    check(
        Bad::Header,
        with("tokenizer.ggml.merges", 9, array(8, 1, &long)),
        "metadata \"tokenizer.ggml.merges\": a string of 16777215 bytes",
    );
    check(
        Bad::Header,
        |p| {
            let mut g = llama();
            g.meta.extend(&long);
            g.meta_count += 1;
            g.write(p);
        },
        "metadata key 10 of 10: a string of 16777215 bytes",
    );
}

#[test]
fn what_the_reader_keeps_is_bounded_whatever_the_file_holds() {
    // 129 arrays of 65,536 booleans: 8.5 MB of file, but 8 bytes kept
    // per item (the per-layer values the sizing reads) would be 66 MiB.
    let flags = array(7, 1 << 16, &[1; 1 << 16]);
    let mut g = llama();
    for i in 0..129 {
        g = raw(g, &format!("general.flags.{i}"), 9, &flags);
    }
    check(
        Bad::Header,
        |p| _ = g.write(p),
        "metadata \"general.flags.127\": more than 64 MiB of metadata to keep",
    );
}

/// `llama()` written to `path` with the u64 at `at` (8: the tensor
/// count, 16: the metadata count) set to `value`.
fn patched(at: usize, value: u64) -> impl FnOnce(&Path) {
    move |path| {
        llama().write(path);
        let mut bytes = std::fs::read(path).expect("read");
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        std::fs::write(path, bytes).expect("write");
    }
}

#[test]
fn counts_beyond_the_file_are_refused_at_once() {
    check(
        Bad::Header,
        patched(8, 1 << 60),
        "the header claims 1152921504606846976 tensors",
    );
    check(
        Bad::Header,
        patched(16, 1 << 60),
        "the header claims 1152921504606846976 metadata entries",
    );
    check(
        Bad::Header,
        patched(8, u64::MAX),
        "the header claims 18446744073709551615 tensors",
    );
}

/// `llama()` with `key` set to the u64 `value` (a later entry wins).
fn llama_with(key: &str, value: u64) -> impl FnOnce(&Path) {
    let g = raw(llama(), key, 10, &value.to_le_bytes());
    move |p| _ = g.write(p)
}

#[test]
fn sizes_that_overflow_64_bits_are_refused() {
    let geometry = "the KV geometry in the header (llama.attention.head_count_kv, key and value lengths) overflows 64 bits";
    check(
        Bad::Model,
        llama_with("llama.attention.key_length", u64::MAX),
        geometry,
    );
    check(
        Bad::Model,
        llama_with("llama.attention.head_count_kv", 1 << 62),
        geometry,
    );
    let huge = |g: Gguf, key: &str| {
        let g = raw(g, key, 10, &(1u64 << 62).to_le_bytes());
        move |p: &Path| _ = g.write(p)
    };
    check(
        Bad::Model,
        huge(super::mamba(), "mamba.ssm.inner_size"),
        "the mamba.ssm sizes in the header overflow 64 bits",
    );
    check(
        Bad::Model,
        huge(super::rwkv6(), "rwkv6.wkv.head_size"),
        "the rwkv6.wkv sizes in the header overflow 64 bits",
    );
}

#[test]
fn a_kv_cache_beyond_64_bits_is_said_to_be_one() {
    // Each layer's geometry fits; the cache over 2048 cells does not.
    let (dir, path) = temp("wide.gguf");
    llama_with("llama.attention.key_length", 1 << 50)(&path);
    let m = gguf::read(&path).expect("each layer fits");
    assert_eq!(m.kv_full, 4 * 2 * (2 << 50));
    refused_by_config(
        dir.path(),
        &path,
        "its KV cache over 2048 tokens of f16 overflows 64 bits",
    );
}
