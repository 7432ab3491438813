//! llama.cpp's own projection of what a server will hold, before it
//! starts: `llama-fit-params --fit-print on` beside the `llama-server`
//! binary prints, per device and for the host, the model, context and
//! compute buffers in MiB (`Host 181 64 28`), in milliseconds and without
//! allocating them. Bounded in time, and cached per tool, model file
//! (path, length, modification time) and arguments, so a reload pays
//! nothing for a model it already projected.

use std::collections::HashMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

/// The projection tool, looked for beside the server binary.
pub const TOOL: &str = "llama-fit-params";

/// How long the tool may take before the projection is given up.
pub const TIMEOUT: Duration = Duration::from_secs(10);

const MIB: u64 = 1 << 20;

/// What a server's run is projected to hold, in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Projection {
    /// Model + context + compute on the host.
    pub host: u64,
    /// The model column of the host row alone. The tool's dry run counts
    /// there only what it would allocate: a model it maps is about 1 MiB,
    /// and one it would hand to an extra buffer type (AMX repacking) is 0,
    /// so the weights are sized from the GGUF file instead, and the host's
    /// context and compute are `host - host_model`.
    pub host_model: u64,
    /// The same per device (`CUDA0`, ...), in the tool's order.
    pub devices: Vec<(String, u64)>,
}

/// The arguments of one projection.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ask {
    pub model: String,
    pub ctx: Option<u64>,
    pub kv_type: Option<String>,
    pub parallel: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    tool: PathBuf,
    ask: Ask,
    len: u64,
    modified: Option<SystemTime>,
}

fn cache() -> &'static Mutex<HashMap<Key, Projection>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Projection>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

/// The tool beside `server` (a resolved path).
pub fn tool_beside(server: &Path) -> Option<PathBuf> {
    let tool = server.parent()?.join(TOOL);
    tool.is_file().then_some(tool)
}

/// Runs `tool` for `ask` (or answers from the cache). Errors say what
/// went wrong: the tool failed, timed out, or printed no host row.
pub fn project(tool: &Path, ask: &Ask) -> Result<Projection, String> {
    let meta = std::fs::metadata(&ask.model).map_err(|e| format!("{}: {e}", ask.model))?;
    let key = Key {
        tool: tool.to_path_buf(),
        ask: ask.clone(),
        len: meta.len(),
        modified: meta.modified().ok(),
    };
    let cached = cache().lock().get(&key).cloned();
    if let Some(p) = cached {
        return Ok(p);
    }
    let out = run(tool, ask)?;
    let projection = parse(&out)?;
    cache().lock().insert(key, projection.clone());
    Ok(projection)
}

/// The tool's standard output, within `TIMEOUT`.
fn run(tool: &Path, ask: &Ask) -> Result<String, String> {
    let mut cmd = Command::new(tool);
    cmd.args(["--fit-print", "on", "--model", &ask.model]);
    if let Some(ctx) = ask.ctx {
        cmd.args(["--ctx-size", &ctx.to_string()]);
    }
    if let Some(t) = &ask.kv_type {
        cmd.args(["--cache-type-k", t, "--cache-type-v", t]);
    }
    if let Some(n) = ask.parallel {
        cmd.args(["--parallel", &n.to_string()]);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{}: {e}", tool.display()))?;
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{} gave no answer within {TIMEOUT:?}",
                    tool.display()
                ));
            }
            Err(e) => return Err(format!("{}: {e}", tool.display())),
        }
    };
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        // The tool prints a few short lines, long done by now.
        let _ = stdout.read_to_string(&mut out);
    }
    if !status.success() {
        return Err(format!("{} failed ({status})", tool.display()));
    }
    Ok(out)
}

/// The tool's rows: `NAME MODEL CONTEXT COMPUTE` in MiB, one per device
/// and one `Host`.
pub fn parse(out: &str) -> Result<Projection, String> {
    let mut host = None;
    let mut host_model = 0;
    let mut devices = Vec::new();
    for line in out.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [name, rest @ ..] = fields.as_slice() else {
            continue;
        };
        let Ok(parts) = rest
            .iter()
            .map(|f| f.parse::<u64>())
            .collect::<Result<Vec<_>, _>>()
        else {
            continue;
        };
        if parts.len() != 3 {
            continue;
        }
        let bytes = parts.iter().sum::<u64>().saturating_mul(MIB);
        match *name {
            "Host" => {
                host = Some(bytes);
                host_model = parts[0].saturating_mul(MIB);
            }
            device => devices.push((device.to_string(), bytes)),
        }
    }
    let host = host.ok_or_else(|| {
        let start: String = out.chars().take(80).collect();
        format!("no Host row in its answer ({start:?})")
    })?;
    Ok(Projection {
        host,
        host_model,
        devices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_read_and_anything_else_is_refused() {
        let p = parse("CUDA0 4096 512 300\nHost 181 64 28\n").expect("rows");
        assert_eq!(p.host, (181 + 64 + 28) * MIB);
        assert_eq!(p.host_model, 181 * MIB);
        assert_eq!(p.devices, [("CUDA0".to_string(), (4096 + 512 + 300) * MIB)]);
        for garbage in ["", "error: no model\n", "Host 1 2\n", "Host a b c\n"] {
            assert!(parse(garbage).is_err(), "{garbage:?}");
        }
    }

    #[test]
    fn a_tool_that_fails_hangs_or_babbles_costs_a_bounded_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = dir.path().join("m.gguf");
        std::fs::write(&model, b"GGUF").expect("model");
        let ask = Ask {
            model: model.display().to_string(),
            ctx: Some(512),
            kv_type: None,
            parallel: None,
        };
        let tool = |name: &str, script: &str| {
            use std::os::unix::fs::PermissionsExt as _;
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{script}\n")).expect("tool");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("mode");
            path
        };
        let failing = project(&tool("fails", "exit 1"), &ask).expect_err("fails");
        assert!(failing.contains("failed"), "{failing}");
        let babbling = project(&tool("babbles", "echo hello"), &ask).expect_err("garbage");
        assert!(babbling.contains("no Host row"), "{babbling}");
        let started = Instant::now();
        let hung = project(&tool("hangs", "exec sleep 60"), &ask).expect_err("hangs");
        assert!(hung.contains("no answer within"), "{hung}");
        assert!(started.elapsed() < TIMEOUT + Duration::from_secs(5));
        let good = tool("good", "echo 'Host 5 1 6'");
        assert_eq!(project(&good, &ask).expect("answers").host, 12 * MIB);
        // Cached: the tool is not asked again for the same model.
        std::fs::write(&good, "#!/bin/sh\nexit 1\n").expect("rewrite");
        assert_eq!(project(&good, &ask).expect("cached").host, 12 * MIB);
    }
}
