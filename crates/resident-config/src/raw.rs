//! The TOML document as written, before validation. Values that validation
//! may reject are kept with their span so errors can name the line.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

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
    pub listen: Spanned<String>,
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
    pub tls: Option<Spanned<Tls>>,
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
    pub reserve: Option<Spanned<Quantity>>,
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub name: Spanned<String>,
    pub role: Option<Spanned<String>>,
    pub command: Spanned<Vec<String>>,
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
    pub run_as: Option<Spanned<String>>,
    #[serde(default)]
    pub memory: BTreeMap<String, Spanned<Demand>>,
    pub readiness: Option<Spanned<Readiness>>,
    pub restart: Option<Spanned<Restart>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Demand {
    pub weights: Option<Spanned<Quantity>>,
    pub kv: Option<Spanned<Quantity>>,
    pub from_gguf: Option<Spanned<String>>,
    pub ctx: Option<Spanned<u64>>,
    pub kv_type: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Readiness {
    pub http: Option<String>,
    pub tcp: Option<bool>,
    pub none: Option<bool>,
    pub timeout: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Restart {
    pub policy: Option<Spanned<String>>,
    pub max_restarts: Option<u32>,
    pub backoff: Option<Spanned<String>>,
    pub backoff_max: Option<Spanned<String>>,
    pub stable_after: Option<Spanned<String>>,
}
