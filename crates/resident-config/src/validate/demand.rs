//! A workload's memory, pool by pool (`[workload.memory.POOL]`): weights
//! and KV in bytes, or sized from a GGUF file's header read through
//! `Lookups`.

use std::collections::BTreeMap;

use resident_core::{Demand, PoolName};
use toml::Spanned;

use super::{Result, bytes};
use crate::error::Source;
use crate::host::Lookups;
use crate::{PoolDef, raw};

/// The demand of each pool in `raw`, every one a pool of the node.
pub(super) fn memory(
    src: &Source<'_>,
    raw: &BTreeMap<String, Spanned<raw::Demand>>,
    pools: &[PoolDef],
    key: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<BTreeMap<PoolName, Demand>> {
    let mut out = BTreeMap::new();
    for (pool, d) in raw {
        let k = |f: &str| key(&format!("memory.{pool}.{f}"));
        if !pools.iter().any(|p| p.pool.name.as_str() == pool) {
            let msg = format!("no pool {pool:?} on this node (declare it with [[pool]])");
            return Err(src.err(d.span(), key(&format!("memory.{pool}")), msg));
        }
        let (weights, kv) = demand(src, d, &k, host)?;
        let pool = PoolName::new(pool.as_str())
            .map_err(|e| src.err(d.span(), key("memory"), e.to_string()))?;
        out.insert(pool, Demand { weights, kv });
    }
    Ok(out)
}

/// Weights and KV of one pool: in bytes, or sized from a GGUF file.
fn demand(
    src: &Source<'_>,
    d: &Spanned<raw::Demand>,
    k: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<(u64, u64)> {
    let dem = d.get_ref();
    let kv = dem
        .kv
        .as_ref()
        .map(|q| bytes(src, q, &k("kv")))
        .transpose()?;
    match (&dem.weights, &dem.from_gguf) {
        (Some(w), None) => {
            if let Some(c) = &dem.ctx {
                return Err(src.err(
                    c.span(),
                    k("ctx"),
                    "ctx sizes the KV cache of a from_gguf model only",
                ));
            }
            Ok((bytes(src, w, &k("weights"))?, kv.unwrap_or(0)))
        }
        (None, Some(path)) => from_gguf(src, dem, path, kv, k, host),
        _ => Err(src.err(
            d.span(),
            k("weights"),
            "give either weights (bytes) or from_gguf (a model file)",
        )),
    }
}

/// Weights and KV of a `from_gguf` model: its header read through `host`,
/// the KV cache sized from it unless `kv` is given.
fn from_gguf(
    src: &Source<'_>,
    dem: &raw::Demand,
    path: &Spanned<String>,
    kv: Option<u64>,
    k: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<(u64, u64)> {
    let model = host
        .gguf(path.get_ref())
        .map_err(|m| src.err(path.span(), k("from_gguf"), m))?;
    let ctx = dem
        .ctx
        .as_ref()
        .map_or(model.context_length, |c| *c.get_ref());
    let kv_type = dem.kv_type.as_ref().map_or("f16", |t| t.get_ref().as_str());
    let kv = match kv {
        Some(kv) => kv,
        None => model.kv_bytes(ctx, kv_type).ok_or_else(|| {
            let span = dem.kv_type.as_ref().map_or(path.span(), |t| t.span());
            let msg = format!(
                "{kv_type:?} is not a KV cache type (f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl)"
            );
            src.err(span, k("kv_type"), msg)
        })?,
    };
    Ok((model.weights_bytes, kv))
}
