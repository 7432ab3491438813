//! A workload's memory, pool by pool (`[workload.memory.POOL]`), or on any
//! `count` of several pools (`[workload.memory.LABEL]` with `any_of`):
//! weights and KV in bytes, or sized from a GGUF file's header read
//! through `Lookups`.

use std::collections::BTreeMap;

use resident_core::{AnyOf, Demand, PoolName};
use toml::Spanned;

use super::{Result, bytes};
use crate::error::Source;
use crate::host::Lookups;
use crate::{PoolDef, gguf, raw};

/// What `memory` makes of a workload's tables.
pub(super) struct Memory {
    pub(super) fixed: BTreeMap<PoolName, Demand>,
    pub(super) any_of: Vec<AnyOf>,
    /// Per table, in label order: what it reserves and where each part
    /// came from (`--check-config` prints these).
    pub(super) notes: Vec<String>,
    /// What could not be done as it should (a projection that failed).
    pub(super) warnings: Vec<String>,
}

/// The demand of each pool in `raw`, every one a pool of the node, and
/// the any-of demands (tables with `any_of`), in label order.
pub(super) fn memory(
    src: &Source<'_>,
    raw: &BTreeMap<String, Spanned<raw::Demand>>,
    pools: &[PoolDef],
    key: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<Memory> {
    // One model file sized in two tables would reserve its weights in
    // both (a flavor fills every table that declares no weights with its
    // model): the server holds them once.
    let mut sized: BTreeMap<&str, &str> = BTreeMap::new();
    for (label, d) in raw {
        let Some(path) = &d.get_ref().from_gguf else {
            continue;
        };
        if let Some(first) = sized.insert(path.get_ref().as_str(), label.as_str()) {
            let msg = format!(
                "{:?} is sized in memory.{first} as well: its weights would be reserved twice. Size the model in one table, and give this one what it holds beside it (weights = \"0\" and its overhead, say)",
                path.get_ref()
            );
            let key = key(&format!("memory.{label}.from_gguf"));
            return Err(src.err(path.span(), key, msg));
        }
    }
    let mut fixed = BTreeMap::new();
    let mut any_of = Vec::new();
    let mut notes = Vec::new();
    let mut warnings = Vec::new();
    for (label, d) in raw {
        let k = |f: &str| key(&format!("memory.{label}.{f}"));
        let pool_named = |name: &str| pools.iter().any(|p| p.pool.name.as_str() == name);
        if let Some(candidates) = &d.get_ref().any_of {
            if pool_named(label) {
                let msg = format!(
                    "{label:?} is a pool's name: an any_of table takes a label of its own (such as \"gpu\")"
                );
                return Err(src.err(d.span(), key(&format!("memory.{label}")), msg));
            }
            let candidates = candidate_pools(src, candidates, pools, &k("any_of"))?;
            let count = match &d.get_ref().count {
                None => 1,
                Some(c) if *c.get_ref() == 0 || *c.get_ref() as usize > candidates.len() => {
                    let msg = format!(
                        "{} pools asked for, of {} candidates: give 1 to {}",
                        c.get_ref(),
                        candidates.len(),
                        candidates.len()
                    );
                    return Err(src.err(c.span(), k("count"), msg));
                }
                Some(c) => *c.get_ref() as usize,
            };
            let (demand, note, warning) = demand(src, d, &k, host)?;
            warnings.extend(warning);
            notes.push(format!(
                "{label} (any {count} of {}): {note}",
                candidates.len()
            ));
            any_of.push(AnyOf {
                label: label.clone(),
                candidates,
                count,
                demand,
            });
            continue;
        }
        if let Some(c) = &d.get_ref().count {
            return Err(src.err(c.span(), k("count"), "count goes with any_of"));
        }
        if !pool_named(label) {
            let msg = format!(
                "no pool {label:?} on this node (declare it with [[pool]], or give the table any_of = [POOLS])"
            );
            return Err(src.err(d.span(), key(&format!("memory.{label}")), msg));
        }
        if pools
            .iter()
            .any(|p| p.pool.name.as_str() == label && p.path.is_some())
        {
            let msg = format!(
                "pool {label:?} is a disk pool (path): it holds saved conversations (keep_kv), not memory"
            );
            return Err(src.err(d.span(), key(&format!("memory.{label}")), msg));
        }
        let (demand, note, warning) = demand(src, d, &k, host)?;
        warnings.extend(warning);
        notes.push(format!("{label}: {note}"));
        let pool = PoolName::new(label.as_str())
            .map_err(|e| src.err(d.span(), key("memory"), e.to_string()))?;
        fixed.insert(pool, demand);
    }
    Ok(Memory {
        fixed,
        any_of,
        notes,
        warnings,
    })
}

/// The pools of an `any_of` list: declared, distinct, at least one; in
/// name order.
fn candidate_pools(
    src: &Source<'_>,
    list: &Spanned<Vec<Spanned<String>>>,
    pools: &[PoolDef],
    key: &str,
) -> Result<Vec<PoolName>> {
    let mut out: Vec<PoolName> = Vec::new();
    for (i, c) in list.get_ref().iter().enumerate() {
        let Some(p) = pools.iter().find(|p| p.pool.name.as_str() == c.get_ref()) else {
            let msg = format!("no pool {:?} on this node", c.get_ref());
            return Err(src.err(c.span(), format!("{key}[{i}]"), msg));
        };
        if p.path.is_some() {
            let msg = format!(
                "pool {:?} is a disk pool (path): it holds saved conversations (keep_kv), not memory",
                c.get_ref()
            );
            return Err(src.err(c.span(), format!("{key}[{i}]"), msg));
        }
        if out.contains(&p.pool.name) {
            return Err(src.err(c.span(), format!("{key}[{i}]"), "listed twice"));
        }
        out.push(p.pool.name.clone());
    }
    if out.is_empty() {
        return Err(src.err(list.span(), key, "names no pool: list the candidates"));
    }
    out.sort();
    Ok(out)
}

/// Bytes as a reservation's note gives them.
fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// One pool's demand (weights and KV in bytes or sized from a GGUF file;
/// the overhead given, or the flavor's), and a note of where each part
/// came from.
pub(super) fn demand(
    src: &Source<'_>,
    d: &Spanned<raw::Demand>,
    k: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<(Demand, String, Vec<String>)> {
    let sized = weights_and_kv(src, d, k, host)?;
    let (weights, kv, compute) = (sized.weights, sized.kv, sized.compute);
    let dem = d.get_ref();
    let mut warnings: Vec<String> = sized.warning.into_iter().collect();
    let (overhead, why) = match (&dem.overhead, dem.process_overhead) {
        (Some(q), _) => (bytes(src, q, &k("overhead"))?, "declared".to_string()),
        // A flavor's server: its process, and what the server itself
        // projects beyond weights and KV; else the GGUF model's compute
        // buffer, estimated.
        (None, Some(process)) => {
            let projected = dem.projection.as_ref().map(|p| {
                host.projection(&p.program, p.path.as_deref(), &p.ask)
                    .map(|found| found.map(|f| (f.host, f.host_model, p.program.clone())))
            });
            match projected {
                Some(Ok(Some((total, model, program)))) => (
                    // Its context and compute, less the KV cache sized
                    // here: the weights come from the GGUF file, whatever
                    // the tool's dry run counted of them (a mapped model
                    // is ~1 MiB there, one for AMX repacking 0).
                    process.saturating_add(total.saturating_sub(model).saturating_sub(kv)),
                    format!(
                        "the flavor's process {} + what {}'s {} projects beyond weights and kv, of {} in all",
                        mb(process),
                        program,
                        crate::projection::TOOL,
                        mb(total)
                    ),
                ),
                other => {
                    if let Some(Err(e)) = other {
                        warnings.push(format!(
                            "{}: no projection ({e}); the compute buffer is estimated from the GGUF header",
                            k("overhead")
                        ));
                    }
                    (
                        process.saturating_add(compute).saturating_add(sized.output),
                        format!(
                            "the flavor's process {} + compute buffer {} + output buffer {} (estimated from the GGUF header)",
                            mb(process),
                            mb(compute),
                            mb(sized.output)
                        ),
                    )
                }
            }
        }
        (None, None) => (0, "none declared".to_string()),
    };
    // The server's prompt cache, in the host table: reserved when sized;
    // a declared overhead is the workload's own figure and stands.
    let (overhead, why) = match (dem.prompt_cache, &dem.overhead) {
        (Some(raw::PromptCache::Bytes(b)), None) => (
            overhead.saturating_add(b),
            format!("{why} + the prompt cache {} (--cache-ram)", mb(b)),
        ),
        (Some(raw::PromptCache::ServerDefault), None) => {
            warnings.push(format!(
                "{}: the command leaves llama-server's prompt cache at its default, up to 8 GiB of host memory beside the model, which is not reserved: pass --cache-ram 0 (off) or its size in MiB (reserved)",
                k("overhead")
            ));
            (overhead, why)
        }
        _ => (overhead, why),
    };
    // llama-server's repacked copy of the weights the CPU runs, beside the
    // mapped file.
    let (overhead, why) = match (dem.repack, &dem.overhead) {
        (Some(raw::Repack::Asked), None) if weights > 0 => (
            overhead.saturating_add(weights),
            format!(
                "{why} + a repacked copy of the weights {} (--repack)",
                mb(weights)
            ),
        ),
        (Some(raw::Repack::ServerDefault), None) if weights > 0 => {
            warnings.push(format!(
                "{}: the command leaves llama-server's weight repacking at its default (on): on a CPU with AMX, or for some quant types, it keeps a second copy of the weights ({}) beside the mapped file, which is not reserved: pass --no-repack, or --repack (reserved)",
                k("overhead"),
                mb(weights)
            ));
            (overhead, why)
        }
        _ => (overhead, why),
    };
    let source = if dem.from_gguf.is_some() {
        format!(
            "weights {} ({}) + kv {} ({})",
            mb(weights),
            sized.weights_source,
            mb(kv),
            sized.kv_source
        )
    } else {
        format!("weights {} + kv {} (declared)", mb(weights), mb(kv))
    };
    let demand = Demand {
        weights,
        kv,
        overhead,
        floor: 0,
    };
    let note = format!(
        "reserves {} = {source} + overhead {} ({why})",
        mb(demand.footprint()),
        mb(overhead)
    );
    Ok((demand, note, warnings))
}

/// One table's weights and KV in bytes, and for a GGUF model what
/// llama.cpp allocates beside them, with where each figure came from.
struct Sized {
    weights: u64,
    /// KV cache and recurrent state.
    kv: u64,
    /// The compute buffer estimate (0 for bytes).
    compute: u64,
    /// The output (logits) buffer (0 for bytes).
    output: u64,
    weights_source: String,
    kv_source: String,
    /// A figure not sized as llama.cpp would allocate it.
    warning: Option<String>,
}

impl Sized {
    fn declared(weights: u64, kv: u64) -> Self {
        Self {
            weights,
            kv,
            compute: 0,
            output: 0,
            weights_source: "declared".into(),
            kv_source: "declared".into(),
            warning: None,
        }
    }
}

/// Weights and KV of one pool, in bytes or sized from a GGUF file, and
/// the GGUF model's compute and output buffers.
fn weights_and_kv(
    src: &Source<'_>,
    d: &Spanned<raw::Demand>,
    k: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<Sized> {
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
            Ok(Sized::declared(
                bytes(src, w, &k("weights"))?,
                kv.unwrap_or(0),
            ))
        }
        (None, Some(path)) => from_gguf(src, dem, path, kv, k, host),
        _ => Err(src.err(
            d.span(),
            k("weights"),
            "give either weights (bytes) or from_gguf (a model file)",
        )),
    }
}

/// Weights, KV (and recurrent state), compute and output buffers of a
/// `from_gguf` model: its header read through `host`, the KV cache sized
/// from it unless `kv` is given. An architecture the reader cannot size
/// takes the declared `kv`; without one, a dense estimate and a warning
/// naming the file and the architecture, or an error when the header
/// has no attention geometry to estimate from.
fn from_gguf(
    src: &Source<'_>,
    dem: &raw::Demand,
    path: &Spanned<String>,
    kv: Option<u64>,
    k: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<Sized> {
    let model = host
        .gguf(path.get_ref())
        .map_err(|m| src.err(path.span(), k("from_gguf"), m))?;
    let mut weights = model.weights_bytes;
    let mut weights_source = "GGUF tensor data".to_string();
    if let Some(mmproj) = &dem.mmproj {
        let projector = host
            .gguf_tensor_bytes(mmproj.get_ref())
            .map_err(|m| src.err(mmproj.span(), k("mmproj"), m))?;
        weights = weights.saturating_add(projector);
        weights_source = format!("GGUF tensor data, with the mmproj's {}", mb(projector));
    }
    let ctx = dem
        .ctx
        .as_ref()
        .map_or(model.context_length, |c| *c.get_ref());
    let kv_type = dem.kv_type.as_ref().map_or("f16", |t| t.get_ref().as_str());
    // Without a flavor, one sequence, and sliding-window layers over the
    // whole context (llama.cpp's own default, `llama_context_default_params`,
    // and the larger figure).
    let serving = dem.serving.unwrap_or(raw::ServingAsk {
        seqs: 1,
        unified: false,
        swa_full: true,
        flash_attn: false,
    });
    let memory = model
        .context_memory(&gguf::Serving {
            ctx,
            kv_type,
            seqs: u64::from(serving.seqs.max(1)),
            unified: serving.unified,
            swa_full: serving.swa_full,
        })
        .ok_or_else(|| {
            if gguf::kv_type_size(kv_type).is_some() {
                // A known type: the header's geometry is what does not fit.
                let msg = format!(
                    "{}: its KV cache over {ctx} tokens of {kv_type} overflows 64 bits",
                    path.get_ref()
                );
                return src.err(path.span(), k("from_gguf"), msg);
            }
            let span = dem.kv_type.as_ref().map_or(path.span(), |t| t.span());
            let msg = format!(
                "{kv_type:?} is not a KV cache type (f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl)"
            );
            src.err(span, k("kv_type"), msg)
        })?;
    let ctx_note = dem.ctx.as_ref().map_or_else(
        || "its trained context".to_string(),
        |c| format!("ctx {}", c.get_ref()),
    );
    let mut parts = vec![format!("GGUF, {ctx_note}, {kv_type}")];
    if serving.seqs > 1 {
        let how = if serving.unified { ", unified" } else { "" };
        parts.push(format!("{} sequences{how}", serving.seqs));
    }
    if model.sliding_window > 0 && model.kv_swa > 0 {
        parts.push(if serving.swa_full {
            "sliding-window layers over the whole context (swa_full)".to_string()
        } else {
            format!(
                "sliding window {} over {} cells",
                model.sliding_window, memory.swa_cells
            )
        });
    }
    if memory.state > 0 {
        parts.push(format!("recurrent state {}", mb(memory.state)));
    }
    let mut warning = None;
    let (kv, kv_source) = match (kv, &model.not_sized) {
        (Some(kv), None) => (kv, "declared".to_string()),
        (Some(kv), Some(why)) => (kv, format!("declared; {why}")),
        (None, None) => (memory.kv.saturating_add(memory.state), parts.join(", ")),
        (None, Some(why)) if memory.kv > 0 => {
            warning = Some(format!(
                "{}: {}: {why}: its KV cache is estimated as if every layer cached the whole context ({}); declare kv to reserve what the server really holds",
                k("kv"),
                path.get_ref(),
                mb(memory.kv)
            ));
            (
                memory.kv,
                format!("{}; dense estimate: {why}", parts.join(", ")),
            )
        }
        (None, Some(why)) => {
            let msg = format!(
                "{}: {why}, and its header gives no attention geometry to estimate the KV cache from: declare kv",
                path.get_ref()
            );
            return Err(src.err(path.span(), k("kv"), msg));
        }
    };
    let (weights_source, kv_source) = if host.local() {
        (weights_source, kv_source)
    } else {
        // --for-another-host: the file is on the node; nothing was read.
        let there = "sized from the GGUF file on its node, not read here".to_string();
        (there.clone(), there)
    };
    Ok(Sized {
        weights,
        kv,
        compute: model.compute_bytes(memory.cells, serving.flash_attn),
        output: memory.output,
        weights_source,
        kv_source,
        warning,
    })
}
