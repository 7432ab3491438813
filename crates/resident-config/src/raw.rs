//! The TOML document as written, before validation. Values that validation
//! may reject are kept with their span so errors can name the line; what
//! serde itself refuses (an unknown or missing key, a value of the wrong
//! type) is reported with its line and its key path.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_path_to_error::{Path, Segment};
use toml::Spanned;

use crate::ConfigError;
use crate::error::Source;

/// Reads the document of `src`.
pub(crate) fn document(src: &Source<'_>) -> Result<Document, ConfigError> {
    let error = |e: &toml::de::Error, key: String| ConfigError {
        file: src.file.to_path_buf(),
        line: e.span().map(|s| src.line_of(s.start)),
        key,
        message: e.message().trim().to_string(),
        also: Vec::new(),
    };
    let de = toml::Deserializer::parse(src.text).map_err(|e| error(&e, String::new()))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let key = key_path(src.text, e.path());
        error(e.inner(), key)
    })
}

/// The top-level arrays of tables whose entries the other errors name by
/// their `name` (`workload[coder].stop_grace`), as `validate` does.
const NAMED: [&str; 3] = ["pool", "group", "workload"];

/// `path` in the form of every other config error: `node.listen`,
/// `workload[coder].readiness.http` (the entry's index when it has no
/// name), `workload[coder].command[2]`.
fn key_path(text: &str, path: &Path) -> String {
    // Only for names: the text parsed as TOML, since it did.
    let table: Option<toml::Table> = toml::from_str(text).ok();
    let mut key = String::new();
    let mut top: Option<&str> = None;
    for (depth, segment) in path.iter().enumerate() {
        match segment {
            // The inside of a `Spanned` value: no key of the document.
            Segment::Map { key: k } if k.starts_with("$__serde_spanned_private_") => {}
            Segment::Map { key: k } | Segment::Enum { variant: k } => {
                if !key.is_empty() {
                    key.push('.');
                }
                key.push_str(k);
                if depth == 0 {
                    top = Some(k);
                }
            }
            Segment::Seq { index } => {
                let name = top
                    .filter(|t| NAMED.contains(t) && key == *t)
                    .and_then(|t| table.as_ref()?.get(t)?.as_array()?.get(*index)?.get("name"))
                    .and_then(|n| n.as_str());
                match name {
                    Some(name) => key.push_str(&format!("[{name}]")),
                    None => key.push_str(&format!("[{index}]")),
                }
            }
            Segment::Unknown => key.push_str(".?"),
        }
    }
    key
}

/// A byte quantity: `"55GB"` or a plain integer of bytes.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Quantity {
    /// Bytes.
    Bytes(u64),
    /// Text with a unit.
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Document {
    pub node: Spanned<Node>,
    #[serde(default)]
    pub pool: Vec<Spanned<Pool>>,
    #[serde(default)]
    pub group: Vec<Spanned<Group>>,
    #[serde(default)]
    pub workload: Vec<Spanned<Workload>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    pub name: Spanned<String>,
    pub listen: Spanned<Listen>,
    pub state_dir: Option<Spanned<String>>,
    pub on_full: Option<Spanned<String>>,
    pub run_as: Option<Spanned<String>>,
    pub metrics_listen: Option<Spanned<String>>,
    #[serde(default)]
    pub insecure: bool,
    pub sample_every: Option<Spanned<String>>,
    pub memory_recovery: Option<Spanned<String>>,
    pub cgroups: Option<Spanned<String>>,
    pub memory_slack: Option<Spanned<Quantity>>,
    pub socket_group: Option<Spanned<String>>,
    #[serde(default)]
    pub allow_uids: Vec<u32>,
    #[serde(default)]
    pub allow_gids: Vec<u32>,
    pub max_instances: Option<Spanned<u32>>,
    pub max_connections: Option<Spanned<u32>>,
    pub max_connections_per_peer: Option<Spanned<u32>>,
    pub keepalive_interval: Option<Spanned<String>>,
    pub keepalive_timeout: Option<Spanned<String>>,
    pub durable_answers: Option<bool>,
    pub learn_footprints: Option<bool>,
    pub instances_outlive_agent: Option<bool>,
    pub tls: Option<Spanned<Tls>>,
    pub gpu_choice: Option<Spanned<String>>,
    pub access: Option<Spanned<Access>>,
    pub on_overrun: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Access {
    #[serde(default)]
    pub viewers: Vec<Spanned<String>>,
    #[serde(default)]
    pub operators: Vec<Spanned<String>>,
    #[serde(default)]
    pub admins: Vec<Spanned<String>>,
}

/// `listen`: one address, or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Listen {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    pub cert: Spanned<String>,
    pub key: Spanned<String>,
    pub client_ca: Spanned<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    pub name: Spanned<String>,
    pub budget: Option<Spanned<Quantity>>,
    #[serde(default)]
    pub host: bool,
    pub device: Option<Spanned<String>>,
    pub index: Option<Spanned<u32>>,
    pub reserve: Option<Spanned<Quantity>>,
    /// A disk pool: the directory its bytes are stored under.
    pub path: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Group {
    pub name: Spanned<String>,
    #[serde(default)]
    pub members: Vec<Spanned<String>>,
    #[serde(default)]
    pub swap: bool,
    #[serde(default)]
    pub exclusive: bool,
    #[serde(default)]
    pub persistent: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub name: Spanned<String>,
    pub role: Option<Spanned<String>>,
    /// Required unless a flavor fills it in (`validate/flavor.rs`).
    pub command: Option<Spanned<Vec<String>>>,
    pub flavor: Option<Spanned<String>>,
    pub model: Option<Spanned<String>>,
    pub ctx: Option<Spanned<u64>>,
    pub kv_type: Option<Spanned<String>>,
    pub parallel: Option<Spanned<u32>>,
    /// A vision projector GGUF file (llama-server's `--mmproj`).
    pub mmproj: Option<Spanned<String>>,
    pub program: Option<Spanned<String>>,
    #[serde(default)]
    pub args: Vec<Spanned<String>>,
    pub expose: Option<Spanned<String>>,
    #[serde(default)]
    pub env: BTreeMap<String, Spanned<String>>,
    #[serde(default)]
    pub pass_env: Vec<String>,
    pub cwd: Option<String>,
    #[serde(default)]
    pub excludes: Vec<Spanned<String>>,
    #[serde(default)]
    pub priority: i32,
    pub stop_grace: Option<Spanned<String>>,
    pub idle_ttl: Option<Spanned<String>>,
    pub on_overrun: Option<Spanned<String>>,
    pub run_as: Option<Spanned<String>>,
    #[serde(default)]
    pub memory: BTreeMap<String, Spanned<Demand>>,
    pub readiness: Option<Spanned<Readiness>>,
    pub restart: Option<Spanned<Restart>>,
    #[serde(default)]
    pub aliases: Vec<Spanned<String>>,
    pub concurrency_limit: Option<Spanned<u32>>,
    pub sleep: Option<Spanned<Sleep>>,
    /// The disk pool (`[[pool]] path`) a llama-server workload's
    /// conversations are saved to when its server is stopped.
    pub keep_kv: Option<Spanned<String>>,
}

/// `[workload.sleep]`: how its server sleeps and wakes, and what it holds
/// asleep.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sleep {
    /// `"METHOD /path"` on the instance's port.
    pub sleep: Option<Spanned<String>>,
    pub wake: Option<Spanned<String>>,
    pub idle: Option<Spanned<String>>,
    /// How long a sleep or wake call may take.
    pub timeout: Option<Spanned<String>>,
    /// vLLM's sleep level (1: weights to host memory; 2: discarded).
    pub level: Option<Spanned<u8>>,
    /// vLLM: what its process keeps on each GPU asleep.
    pub residue: Option<Spanned<Quantity>>,
    #[serde(default)]
    pub memory: BTreeMap<String, Spanned<Demand>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Demand {
    pub weights: Option<Spanned<Quantity>>,
    pub kv: Option<Spanned<Quantity>>,
    pub overhead: Option<Spanned<Quantity>>,
    pub from_gguf: Option<Spanned<String>>,
    pub ctx: Option<Spanned<u64>>,
    pub kv_type: Option<Spanned<String>>,
    pub any_of: Option<Spanned<Vec<Spanned<String>>>>,
    pub count: Option<Spanned<u32>>,
    /// Set by a flavor, never read from the file: the server's process
    /// overhead, to which the GGUF model's compute buffer is added when
    /// `overhead` is not given.
    #[serde(skip)]
    pub process_overhead: Option<u64>,
    /// Set by a flavor whose server projects its own memory: the server
    /// program (as its command names it, and the PATH it is found on)
    /// and what to project.
    #[serde(skip)]
    pub projection: Option<ProjectionAsk>,
    /// Set by a flavor: how its server runs a `from_gguf` model (its
    /// sequences, unified KV cache, full sliding-window cache), which
    /// sizes the KV cache, state and output buffer; one sequence when
    /// unset.
    #[serde(skip)]
    pub serving: Option<ServingAsk>,
    /// Set by a flavor: the vision projector its server loads beside the
    /// model, whose tensors count with the weights.
    #[serde(skip)]
    pub mmproj: Option<Spanned<String>>,
    /// Set by a flavor on its host-memory table: the prompt cache its
    /// server keeps beside the model (llama-server's `--cache-ram`).
    #[serde(skip)]
    pub prompt_cache: Option<PromptCache>,
    /// Set by a flavor on its host-memory table: llama-server repacks the
    /// weights it runs on the CPU into a copy of its own (CPUs with AMX,
    /// and some quant types on AVX2 or ARM), beside the mapped file.
    #[serde(skip)]
    pub repack: Option<Repack>,
}

/// llama-server's weight repacking (`--repack`, on by default), as a
/// workload leaves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repack {
    /// Asked for (`--repack`, `LLAMA_ARG_REPACK`): a second copy of the
    /// weights, reserved.
    Asked,
    /// Left at the server's default (on) by a command of the workload's
    /// own: not reserved, and a config warning says so.
    ServerDefault,
}

/// The prompt cache a llama-server holds in host memory: states of
/// earlier prompts, kept so that a conversation's next turn is not
/// decoded again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptCache {
    /// Bounded to this many bytes (`--cache-ram N`, N MiB): reserved.
    Bytes(u64),
    /// Left at the server's default (8 GiB) by a command of the
    /// workload's own: not reserved, and a config warning says so.
    ServerDefault,
}

/// How a flavor's server runs its model (`gguf::Serving`, less the
/// context and KV type, which the table gives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServingAsk {
    pub seqs: u32,
    pub unified: bool,
    pub swa_full: bool,
    /// Attention runs as flash attention (no scores matrix in the
    /// compute buffer).
    pub flash_attn: bool,
}

/// A flavor's request for its server's own projection.
#[derive(Debug, Clone)]
pub struct ProjectionAsk {
    pub program: String,
    pub path: Option<String>,
    pub ask: crate::projection::Ask,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Readiness {
    pub http: Option<String>,
    pub tcp: Option<bool>,
    pub none: Option<bool>,
    pub timeout: Option<Spanned<String>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Restart {
    pub policy: Option<Spanned<String>>,
    pub max_restarts: Option<u32>,
    pub backoff: Option<Spanned<String>>,
    pub backoff_max: Option<Spanned<String>>,
    pub stable_after: Option<Spanned<String>>,
}
