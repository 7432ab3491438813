//! Any bytes (up to 1 MiB) as a GGUF model file: the reader gives a model
//! or an error, never a panic, an abort or an unbounded allocation, and a
//! model read has at most `gguf::MAX_LAYERS` layers; a config whose
//! workload sizes its memory from a model read loads, or fails naming the
//! config file, its `from_gguf` line and the model file. The first byte
//! picks whether the GGUF magic and version 3 come first (as in every
//! model, so the fuzzer starts at the metadata) or the bytes stand alone.
#![no_main]

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use resident_config::gguf;

/// Larger inputs are cut here: the bounds under test are relative to the
/// file's size, and a bigger file only slows each run.
const MAX_INPUT: usize = 1 << 20;

/// This process's model file (the reader takes a path), and a config
/// whose workload sizes its memory from it.
struct Files {
    file: File,
    model: PathBuf,
    config: String,
}

fn files() -> &'static Files {
    static FILES: OnceLock<Files> = OnceLock::new();
    FILES.get_or_init(|| {
        let named = std::env::temp_dir().join(format!("resident-fuzz-{}.gguf", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&named)
            .expect("create the model file");
        // Nothing is left behind when libFuzzer exits: the reader opens
        // the unlinked file through this process's descriptor.
        std::fs::remove_file(&named).expect("unlink the model file");
        let model = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let config = format!(
            "[node]\nname = \"n\"\nlisten = \"unix:///tmp/fuzz.sock\"\n[[pool]]\nname = \"ram\"\nbudget = \"24GB\"\n[[workload]]\nname = \"m\"\ncommand = [\"/bin/true\"]\n[workload.memory.ram]\nfrom_gguf = \"{}\"\n",
            model.display()
        );
        Files { file, model, config }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((first, rest)) = data.split_first() else {
        return;
    };
    let rest = &rest[..rest.len().min(MAX_INPUT)];
    let mut bytes = Vec::with_capacity(8 + rest.len());
    if first & 1 == 1 {
        bytes.extend(b"GGUF");
        bytes.extend(3u32.to_le_bytes());
    }
    bytes.extend(rest);
    let Files {
        file,
        model,
        config,
    } = files();
    file.set_len(0).expect("truncate the model file");
    file.write_all_at(&bytes, 0).expect("write the model file");
    let _ = gguf::tensor_bytes(model);
    let Ok(m) = gguf::read(model) else {
        return;
    };
    assert!(m.layers <= gguf::MAX_LAYERS, "{} layers", m.layers);
    // Sizing the model for a workload: the KV cache, compute and output
    // buffers over its context, from what the header says.
    if let Err(e) = resident_config::parse(Path::new("fuzz.toml"), config) {
        let e = e.to_string();
        assert!(e.starts_with("fuzz.toml:11: "), "{e}");
        assert!(e.contains(&model.display().to_string()), "{e}");
    }
});
