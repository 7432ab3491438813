//! The server's own report of what it allocated. llama.cpp (llama-server,
//! llama-cpp-python) says, while it loads, one line per buffer it
//! allocates: `<where>: <DEVICE> [<kind>] buffer size = <N> MiB`, with
//! DEVICE one of `CPU`, `CPU_Mapped`, `CUDA0`, `CUDA_Host`, `Metal`, ...
//! and kind `model`, `KV`, `RS` (recurrent state), `output` or `compute`
//! (older versions say `llm_load_tensors: CUDA0 buffer size` for the
//! model). llama-server prints them at `--verbosity 4` (the flavor asks
//! for it), llama-cpp-python always. A line may carry a timestamp and a
//! level before it and colour escapes anywhere.
//!
//! [`Report::read`] sums a load's lines per device and kind (an
//! interleaved sliding-window model has two KV caches on one device); a
//! later load (a restart of the server) replaces an earlier one.

use std::collections::BTreeMap;

/// What a buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum BufferKind {
    /// Model weights.
    Model,
    /// The KV cache.
    Kv,
    /// A recurrent model's state.
    State,
    /// The logits and embeddings of a batch's outputs.
    Output,
    /// Compute scratch.
    Compute,
}

impl BufferKind {
    /// The name the API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            BufferKind::Model => "model",
            BufferKind::Kv => "kv",
            BufferKind::State => "state",
            BufferKind::Output => "output",
            BufferKind::Compute => "compute",
        }
    }
}

/// One buffer the server reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buffer {
    /// The device as the server names it (`CPU`, `CUDA0`, `CUDA_Host`).
    pub device: String,
    pub kind: BufferKind,
    pub bytes: u64,
}

/// `line` without colour escapes (`ESC [ ... letter`).
fn plain(line: &str) -> std::borrow::Cow<'_, str> {
    if !line.contains('\x1b') {
        return line.into();
    }
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            out.push(c);
            continue;
        }
        if chars.next() == Some('[') {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        }
    }
    out.into()
}

/// The buffer a line of llama.cpp's output reports, if it reports one.
pub fn buffer_line(line: &str) -> Option<Buffer> {
    let line = plain(line);
    let (head, tail) = line.split_once(" buffer size =")?;
    let (size, unit) = tail.trim().split_once(' ')?;
    let scale = match unit.trim() {
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "KiB" => 1024.0,
        _ => return None,
    };
    let mib: f64 = size.parse().ok()?;
    if !mib.is_finite() || mib < 0.0 {
        return None;
    }
    // `<where>: DEVICE [kind]`: the words after the last colon.
    let (place, what) = head.rsplit_once(':')?;
    let mut words = what.split_whitespace();
    let device = words.next()?;
    let kind = match (words.next(), words.next()) {
        (Some("model"), None) => BufferKind::Model,
        (Some("KV"), None) => BufferKind::Kv,
        (Some("RS"), None) => BufferKind::State,
        (Some("output"), None) => BufferKind::Output,
        (Some("compute"), None) => BufferKind::Compute,
        (None, _) if place.ends_with("load_tensors") => BufferKind::Model,
        _ => return None,
    };
    let device_like = device
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    device_like.then(|| Buffer {
        device: device.to_string(),
        kind,
        // Reported with two decimals of MiB: rounded to the byte.
        bytes: (mib * scale).round() as u64,
    })
}

/// What a server reported for its last load: bytes per device and kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub buffers: Vec<Buffer>,
}

impl Report {
    /// Reads a server's output, oldest line first: the buffers of its
    /// last load, summed per device and kind, in device then kind order.
    /// A model buffer after any other starts a new load.
    pub fn read<'a>(lines: impl IntoIterator<Item = &'a str>) -> Report {
        let mut load: BTreeMap<(String, BufferKind), u64> = BTreeMap::new();
        let mut past_model = false;
        for b in lines.into_iter().filter_map(buffer_line) {
            if b.kind == BufferKind::Model && past_model {
                load.clear();
                past_model = false;
            }
            past_model |= b.kind != BufferKind::Model;
            *load.entry((b.device, b.kind)).or_insert(0) += b.bytes;
        }
        Report {
            buffers: load
                .into_iter()
                .map(|((device, kind), bytes)| Buffer {
                    device,
                    kind,
                    bytes,
                })
                .collect(),
        }
    }

    /// Bytes over every buffer.
    pub fn total(&self) -> u64 {
        self.buffers.iter().map(|b| b.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: f64 = 1024.0 * 1024.0;

    fn mib(x: f64) -> u64 {
        (x * MIB).round() as u64
    }

    /// What llama-server 0.3.36's vendored llama.cpp printed here at
    /// `--verbosity 4` for the tests' 6 MB model at ctx 512 (timestamp
    /// and level before each line).
    const CPU_RUN: &str = "\
0.00.031.272 I common_params_fit_impl: projected to use 13 MiB of host memory vs. 24105 MiB of total host memory
0.00.032.470 I load_tensors:   CPU_Mapped model buffer size =     5.96 MiB
0.00.032.772 I llama_context:        CPU  output buffer size =     0.01 MiB
0.00.032.809 I llama_kv_cache:        CPU KV buffer size =     1.00 MiB
0.00.034.478 I sched_reserve:        CPU compute buffer size =     6.64 MiB
";

    #[test]
    fn a_cpu_run_of_this_llama_cpp() {
        let r = Report::read(CPU_RUN.lines());
        let got: Vec<(&str, &str, u64)> = r
            .buffers
            .iter()
            .map(|b| (b.device.as_str(), b.kind.as_str(), b.bytes))
            .collect();
        assert_eq!(
            got,
            [
                ("CPU", "kv", mib(1.0)),
                ("CPU", "output", mib(0.01)),
                ("CPU", "compute", mib(6.64)),
                ("CPU_Mapped", "model", mib(5.96)),
            ]
        );
        assert_eq!(r.total(), mib(5.96) + mib(0.01) + mib(1.0) + mib(6.64));
    }

    /// A CUDA run over two cards, in the form llama.cpp prints it, with the
    /// figures of public reports: the compute buffers of GLM 4.5 on two
    /// cards (llama.cpp PR #14939: CUDA0 789.62, CUDA1 460.00, CUDA_Host
    /// 12.01 MiB), and a colour-escaped, timestamped log of a sliding-window
    /// model's KV cache and output buffer (llama.cpp issue #27680:
    /// CUDA_Host output 0.49 MiB, CUDA0 KV 182.75 MiB). The model buffers
    /// and the second KV cache are made up in the same form; the second KV
    /// cache on CUDA0 (the non-SWA one of an iSWA model) adds to the first.
    const CUDA_RUN: &str = "\
load_tensors: offloaded 47/47 layers to GPU
load_tensors:   CPU_Mapped model buffer size =   333.00 MiB
load_tensors:        CUDA0 model buffer size =  9001.50 MiB
load_tensors:        CUDA1 model buffer size =  8200.25 MiB
\x1b[34m1.14.608.918\x1b[0m \x1b[32mI \x1b[0mllama_context:  CUDA_Host  output buffer size =     0.49 MiB
\x1b[34m1.14.610.021\x1b[0m \x1b[32mI \x1b[0mllama_kv_cache:      CUDA0 KV buffer size =   182.75 MiB
\x1b[34m1.14.611.000\x1b[0m \x1b[32mI \x1b[0mllama_kv_cache:      CUDA0 KV buffer size =    64.00 MiB
llama_context:      CUDA0 compute buffer size =   789.62 MiB
llama_context:      CUDA1 compute buffer size =   460.00 MiB
llama_context:  CUDA_Host compute buffer size =    12.01 MiB
llama_context: graph nodes  = 3376
";

    #[test]
    fn a_recorded_cuda_run_over_two_cards() {
        let r = Report::read(CUDA_RUN.lines());
        let of = |device: &str, kind: BufferKind| {
            r.buffers
                .iter()
                .find(|b| b.device == device && b.kind == kind)
                .map(|b| b.bytes)
        };
        assert_eq!(of("CUDA0", BufferKind::Model), Some(mib(9001.50)));
        assert_eq!(of("CUDA1", BufferKind::Model), Some(mib(8200.25)));
        assert_eq!(of("CUDA0", BufferKind::Kv), Some(mib(182.75) + mib(64.0)));
        assert_eq!(of("CUDA0", BufferKind::Compute), Some(mib(789.62)));
        assert_eq!(of("CUDA1", BufferKind::Compute), Some(mib(460.0)));
        assert_eq!(of("CUDA_Host", BufferKind::Compute), Some(mib(12.01)));
        assert_eq!(of("CUDA_Host", BufferKind::Output), Some(mib(0.49)));
        assert_eq!(of("CPU_Mapped", BufferKind::Model), Some(mib(333.0)));
        assert_eq!(r.buffers.len(), 8);
    }

    #[test]
    fn older_forms_recurrent_state_and_what_is_not_a_buffer() {
        let old = buffer_line("llm_load_tensors:      CUDA1 buffer size = 13989.53 MiB");
        assert_eq!(
            old,
            Some(Buffer {
                device: "CUDA1".into(),
                kind: BufferKind::Model,
                bytes: mib(13989.53),
            })
        );
        let rs = buffer_line("llama_memory_recurrent:        CPU RS buffer size =     0.34 MiB");
        assert_eq!(rs.map(|b| b.kind), Some(BufferKind::State));
        for not in [
            "llama_context: n_ctx = 512",
            "the buffer size = 12 MiB is fine",
            "x: CUDA0 weird thing buffer size = 1.00 MiB",
            "x: CUDA0 KV buffer size = lots MiB",
            "x: CUDA0 KV buffer size = 1.00 bananas",
            "x: CUDA0 KV buffer size = -1.00 MiB",
        ] {
            assert_eq!(buffer_line(not), None, "{not}");
        }
    }

    #[test]
    fn a_second_load_replaces_the_first() {
        let twice = format!("{CUDA_RUN}{CPU_RUN}");
        assert_eq!(Report::read(twice.lines()), Report::read(CPU_RUN.lines()));
        assert_eq!(Report::read(["nothing here"]), Report::default());
    }
}
