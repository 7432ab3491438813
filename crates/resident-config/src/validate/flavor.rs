//! Flavors: `flavor = "llama-server" | "llama-cpp-python" | "vllm" |
//! "mlx-lm"` on a workload fills in what that server needs from a few keys
//! (`model`, `ctx`, `kv_type`, `parallel`, extra `args`, and `program`
//! for the executable): the argv, bound to loopback on `${PORT}`; the
//! readiness path; the stop grace; and, for GGUF models, the memory from
//! the file; llama-server's prompt cache (`--cache-ram`) off, or reserved
//! in host memory when the workload sizes it. Anything the workload sets
//! itself stands: a flavor only fills in what is missing. This runs on the
//! raw workload, before the rules every workload obeys, so a flavored
//! workload is checked like any other.

use std::ops::Range;

use toml::Spanned;

use super::{Result, spanned_str};
use crate::PoolDef;
use crate::error::Source;
use crate::raw;

/// The flavors, by name.
pub const FLAVORS: [&str; 4] = ["llama-server", "llama-cpp-python", "vllm", "mlx-lm"];

/// What a flavor fills in.
struct Defaults {
    argv: Vec<String>,
    readiness: &'static str,
    stop_grace: &'static str,
}

/// The keys a flavor reads, resolved.
struct Keys<'a> {
    model: &'a str,
    ctx: Option<u64>,
    kv_type: Option<&'a str>,
    parallel: Option<u32>,
    mmproj: Option<&'a str>,
    program: Option<&'a str>,
    /// The fraction of its GPU pool the workload declares (vLLM).
    gpu_share: Option<f64>,
}

/// The shortest sleep `idle` of a llama-server that keeps its
/// conversations (`keep_kv`), in seconds: a third of it goes before the
/// save, and the save must come well before the server's own timer ends.
pub(super) const KEEP_KV_MIN_IDLE: u64 = 6;

/// How long into `idle` seconds unused a llama-server that keeps its
/// conversations saves them: a third (the server is given the rest as
/// its `--sleep-idle-seconds`, counted again from the save).
pub(super) fn save_before_sleep(idle: u64) -> u64 {
    idle / 3
}

/// `flag value`, when there is a value.
fn opt(argv: &mut Vec<String>, flag: &str, value: Option<impl ToString>) {
    if let Some(v) = value {
        argv.extend([flag.to_string(), v.to_string()]);
    }
}

/// ggml's number for a KV cache type (`ggml.h`'s `enum ggml_type`), as
/// llama-cpp-python's `--type_k` and `--type_v` take it.
fn ggml_type(kv_type: &str) -> Option<u32> {
    Some(match kv_type {
        "f32" => 0,
        "f16" => 1,
        "q4_0" => 2,
        "q4_1" => 3,
        "q5_0" => 6,
        "q5_1" => 7,
        "q8_0" => 8,
        "iq4_nl" => 20,
        "bf16" => 30,
        _ => return None,
    })
}

fn defaults(flavor: &str, k: &Keys<'_>) -> Defaults {
    // The program and what comes before the loopback binding.
    let (program, lead, readiness, stop_grace): (&str, &[&str], _, _) = match flavor {
        "llama-server" => ("llama-server", &["--model", k.model], "/health", "30s"),
        "llama-cpp-python" => (
            "python3",
            &["-m", "llama_cpp.server", "--model", k.model],
            "/v1/models",
            "30s",
        ),
        "vllm" => ("vllm", &["serve", k.model], "/health", "30s"),
        _ => (
            "python3",
            &["-m", "mlx_lm.server", "--model", k.model],
            "/v1/models",
            "15s",
        ),
    };
    let mut argv = vec![k.program.unwrap_or(program).to_string()];
    argv.extend(lead.iter().map(|s| s.to_string()));
    argv.extend(["--host", "127.0.0.1", "--port", "${PORT}"].map(String::from));
    match flavor {
        "llama-server" => {
            opt(&mut argv, "--ctx-size", k.ctx);
            opt(&mut argv, "--parallel", k.parallel);
            opt(&mut argv, "--cache-type-k", k.kv_type);
            opt(&mut argv, "--cache-type-v", k.kv_type);
            opt(&mut argv, "--mmproj", k.mmproj);
            // Its buffer sizes (model, KV, compute per device) are said
            // at trace verbosity only: the agent reads them (`report.rs`).
            argv.extend(["--verbosity", "4"].map(String::from));
        }
        "llama-cpp-python" => {
            opt(&mut argv, "--n_ctx", k.ctx);
            // Its server takes the cache type as ggml's type number; a
            // quantized V cache needs flash attention (llama.cpp refuses
            // the context without it).
            let kv_type = k.kv_type.and_then(ggml_type);
            opt(&mut argv, "--type_k", kv_type);
            opt(&mut argv, "--type_v", kv_type);
            if kv_type.is_some_and(|t| ![0, 1, 30].contains(&t)) {
                argv.extend(["--flash_attn", "true"].map(String::from));
            }
            // Weights held once (no mapped copy beside a repacked one),
            // and a stream is never cut short by the next request. Its
            // server keeps the logits of every token of the context
            // unless told (`logits_all`, on by default: n_ctx x n_vocab
            // floats, gigabytes for a real vocabulary); they serve only
            // logprobs.
            argv.extend(
                [
                    "--use_mmap",
                    "false",
                    "--interrupt_requests",
                    "false",
                    "--logits_all",
                    "false",
                ]
                .map(String::from),
            );
        }
        "vllm" => {
            opt(&mut argv, "--max-model-len", k.ctx);
            opt(&mut argv, "--max-num-seqs", k.parallel);
            opt(&mut argv, "--kv-cache-dtype", k.kv_type);
            // vLLM takes 90% of the card unless told: held to what the
            // ledger reserved for it.
            opt(
                &mut argv,
                "--gpu-memory-utilization",
                // Rounded down: never more than the reservation.
                k.gpu_share
                    .map(|s| format!("{:.3}", (s * 1000.0).floor() / 1000.0)),
            );
        }
        _ => {}
    }
    Defaults {
        argv,
        readiness,
        stop_grace,
    }
}

/// What a flavor's server holds beside the model, its KV cache and its
/// compute buffer: the interpreter or binary, its libraries, heap and
/// threads. Measured on this kind of machine (x86_64, 2 cores, Debian
/// 12) as the resident memory of the server's process group after load
/// and one completion whose prompt fills nine tenths of the context,
/// less what llama.cpp reported for the model, the KV cache and the
/// compute buffer (docs/config.md, "Overhead"; the footprint matrix of
/// the e2e tests is the check). llama-cpp-python 0.3.36: 95.8 MB held by
/// a 6.2 MB model at ctx 512 (1.0 MiB KV, 8.0 MiB compute, 2 MiB work
/// buffer), 210.3 MB at 8192. Only GGUF-sized tables take it: a
/// declared `overhead` stands, and vLLM's share of its card already is
/// its whole footprint.
fn process_overhead(flavor: &str) -> Option<u64> {
    const MB: u64 = 1_000_000;
    match flavor {
        "llama-cpp-python" => Some(76 * MB),
        "llama-server" => Some(LLAMA_SERVER_PROCESS),
        _ => None,
    }
}

/// llama-server's process overhead (see [`process_overhead`]): beyond
/// what llama-fit-params projects, 20 to 27 MB across the footprint
/// matrix (three models, contexts 512 to 8192, f16 and q8_0 caches; for
/// example 35.9 MB held by a 6.2 MB model at ctx 512, projected at 12
/// MiB), more after a long prompt than after a short one: the largest,
/// rounded up.
pub(super) const LLAMA_SERVER_PROCESS: u64 = 27_000_000;

/// The flags that size llama-server's prompt cache, and its environment
/// variable (`common/arg.cpp`; a flag wins over the variable).
const CACHE_RAM_FLAGS: [&str; 2] = ["--cache-ram", "-cram"];
const CACHE_RAM_ENV: &str = "LLAMA_ARG_CACHE_RAM";

/// The prompt cache a llama-server workload asks for, in MiB
/// (`--cache-ram N` in its args or command, else `LLAMA_ARG_CACHE_RAM`),
/// or `None` when nothing sets it (the server's default: 8192 MiB). The
/// server keeps up to that much of earlier prompts' states in host
/// memory; -1 lifts the bound, which no reservation can hold.
fn cache_ram(
    src: &Source<'_>,
    w: &raw::Workload,
    key: &dyn Fn(&str) -> String,
) -> Result<Option<u64>> {
    // (value, where it was written, the key that names it)
    let mut found: Option<(String, Range<usize>, String)> = None;
    // `--cache-ram=N`, which the server refuses ("invalid argument").
    let mut joined: Option<(Range<usize>, String, String)> = None;
    let mut scan = |argv: &[(&str, Range<usize>)], at: &str| {
        for (i, (a, span)) in argv.iter().enumerate() {
            // The server reads `_` as `-` in a long flag (`--cache_ram`).
            let a = if a.starts_with("--") {
                a.replace('_', "-")
            } else {
                a.to_string()
            };
            if CACHE_RAM_FLAGS.contains(&a.as_str()) {
                if let Some((v, _)) = argv.get(i + 1) {
                    found = Some((v.to_string(), span.clone(), key(at)));
                }
            } else if CACHE_RAM_FLAGS
                .iter()
                .any(|f| a.strip_prefix(f).is_some_and(|r| r.starts_with('=')))
            {
                joined.get_or_insert((span.clone(), key(at), a));
            }
        }
    };
    if let Some(c) = &w.command {
        let argv: Vec<_> = c.get_ref().iter().map(|a| (a.as_str(), c.span())).collect();
        scan(&argv, "command");
    }
    let argv: Vec<_> = w
        .args
        .iter()
        .map(|a| (a.get_ref().as_str(), a.span()))
        .collect();
    scan(&argv, "args");
    if let Some((span, at, arg)) = joined {
        let flag = arg.split_once('=').map_or(arg.as_str(), |(f, _)| f);
        return Err(src.err(
            span,
            at,
            format!("llama-server refuses {arg:?} (invalid argument): write it as two arguments, \"{flag}\", then the size in MiB"),
        ));
    }
    let (value, span, at) = match (found, w.env.get(CACHE_RAM_ENV)) {
        (Some(f), _) => f,
        (None, Some(v)) => (
            v.get_ref().clone(),
            v.span(),
            key(&format!("env.{CACHE_RAM_ENV}")),
        ),
        (None, None) => return Ok(None),
    };
    match value.trim().parse::<i64>() {
        Ok(mib) if mib >= 0 => Ok(Some(mib as u64)),
        Ok(-1) => Err(src.err(
            span,
            at,
            "llama-server's prompt cache without a bound (--cache-ram -1) cannot be reserved: give its size in MiB, or 0 to turn it off",
        )),
        _ => Err(src.err(
            span,
            at,
            format!("--cache-ram takes the prompt cache's size in MiB (0: off), not {value:?}"),
        )),
    }
}

/// The flags that turn llama-server's weight repacking on and off, and
/// its environment variable (`common/arg.cpp`).
const REPACK_ON: &str = "--repack";
const REPACK_OFF: [&str; 2] = ["-nr", "--no-repack"];
const REPACK_ENV: &str = "LLAMA_ARG_REPACK";

/// Whether a llama-server workload repacks its weights: `Some(true)` asked
/// (`--repack`, or `LLAMA_ARG_REPACK` set to a true value), `Some(false)`
/// turned off (`--no-repack`, `-nr`, or the variable false), `None` when
/// nothing says (the server's default: on). Repacking copies the weights
/// the CPU runs into a layout of its own (AMX on recent Xeons, some quant
/// types on AVX2 or ARM) and keeps the mapped file too: twice the model
/// in host memory.
fn repack(w: &raw::Workload) -> Option<bool> {
    let command = w.command.iter().flat_map(|c| c.get_ref().iter().cloned());
    let args = w.args.iter().map(|a| a.get_ref().clone());
    let mut said = None;
    for a in command.chain(args) {
        let a = if a.starts_with("--") {
            a.replace('_', "-")
        } else {
            a
        };
        if a == REPACK_ON {
            said = Some(true);
        } else if REPACK_OFF.contains(&a.as_str()) {
            said = Some(false);
        }
    }
    said.or_else(|| {
        let v = w.env.get(REPACK_ENV)?.get_ref().trim().to_ascii_lowercase();
        Some(matches!(v.as_str(), "1" | "true" | "on" | "enabled"))
    })
}

/// How a flavor's server runs a GGUF model, as far as its memory goes.
/// llama-server (tools/server/server.cpp): without `--parallel`, 4
/// slots over one unified KV cache; with it, that many, each with its
/// share of the context, unless the args ask for `--kv-unified`
/// (`-kvu`); `--swa-full` makes sliding-window layers cache it all
/// (common.h's default: off). llama-cpp-python's server decodes one
/// sequence, and takes llama.cpp's context defaults
/// (`llama_context_default_params`), where `swa_full` is on.
fn serving(flavor: &str, w: &raw::Workload) -> Option<raw::ServingAsk> {
    let has = |flags: &[&str]| {
        w.args.iter().any(|a| flags.contains(&a.get_ref().as_str()))
            || w.command
                .as_ref()
                .is_some_and(|c| c.get_ref().iter().any(|a| flags.contains(&a.as_str())))
    };
    // `flag value`, in the args or the command.
    let has_pair = |flags: &[&str], value: &str| {
        let args: Vec<&str> = w.args.iter().map(|a| a.get_ref().as_str()).collect();
        let command: Vec<&str> = w
            .command
            .as_ref()
            .map(|c| c.get_ref().iter().map(String::as_str).collect())
            .unwrap_or_default();
        [args, command]
            .iter()
            .any(|v| v.windows(2).any(|p| flags.contains(&p[0]) && p[1] == value))
    };
    match flavor {
        "llama-server" => {
            let parallel = w.parallel.as_ref().map(|p| *p.get_ref());
            Some(raw::ServingAsk {
                seqs: parallel.unwrap_or(4),
                unified: (parallel.is_none() && !has(&["--no-kv-unified", "-no-kvu"]))
                    || has(&["--kv-unified", "-kvu"]),
                swa_full: has(&["--swa-full"]),
                // Its default (`auto`) turns it on wherever the backend
                // has it, the CPU's included.
                flash_attn: !has_pair(&["-fa", "--flash-attn"], "off"),
            })
        }
        "llama-cpp-python" => Some(raw::ServingAsk {
            seqs: 1,
            unified: false,
            swa_full: true,
            // The flavor turns it on for a quantized cache (below).
            flash_attn: w
                .kv_type
                .as_ref()
                .and_then(|t| ggml_type(t.get_ref()))
                .is_some_and(|t| ![0, 1, 30].contains(&t)),
        }),
        _ => None,
    }
}

/// Asks, for each GGUF-sized table of `w` (a llama-server workload, its
/// command known), the server's own projection (`projection.rs`).
fn ask_projection(w: &mut raw::Workload, parallel: Option<u32>) {
    let Some(program) = w
        .command
        .as_ref()
        .and_then(|c| c.get_ref().first().cloned())
    else {
        return;
    };
    let path = w.env.get("PATH").map(|p| p.get_ref().clone());
    for demand in w.memory.values_mut() {
        let d = demand.get_mut();
        let Some(model) = &d.from_gguf else {
            continue;
        };
        d.projection = Some(raw::ProjectionAsk {
            program: program.clone(),
            path: path.clone(),
            ask: crate::projection::Ask {
                model: model.get_ref().clone(),
                ctx: d.ctx.as_ref().map(|c| *c.get_ref()),
                kv_type: d.kv_type.as_ref().map(|t| t.get_ref().clone()),
                parallel,
            },
        });
    }
}

fn spanned<T>(span: &Range<usize>, value: T) -> Spanned<T> {
    Spanned::new(span.clone(), value)
}

/// `w` with what its flavor fills in; `w` as it is without one. Errors
/// name the workload's key.
pub(super) fn apply(
    src: &Source<'_>,
    w: &raw::Workload,
    pools: &[PoolDef],
) -> Result<raw::Workload> {
    let name = w.name.get_ref();
    let key = |k: &str| format!("workload[{name}].{k}");
    let mut out = w.clone();
    let Some(flavor) = &w.flavor else {
        for (k, set) in [
            ("model", w.model.is_some()),
            ("ctx", w.ctx.is_some()),
            ("kv_type", w.kv_type.is_some()),
            ("parallel", w.parallel.is_some()),
            ("mmproj", w.mmproj.is_some()),
            ("program", w.program.is_some()),
            ("args", !w.args.is_empty()),
        ] {
            if set {
                return Err(src.err(
                    w.name.span(),
                    key(k),
                    "is a flavor's key: set flavor too, or drop it",
                ));
            }
        }
        if w.command.is_none() {
            return Err(src.err(
                w.name.span(),
                key("command"),
                "missing: a workload needs a command or a flavor",
            ));
        }
        return Ok(out);
    };
    let span = flavor.span();
    let f = flavor.get_ref().as_str();
    if !FLAVORS.contains(&f) {
        return Err(src.err(
            span,
            key("flavor"),
            format!("unknown flavor '{f}' (known: {})", FLAVORS.join(", ")),
        ));
    }
    let Some(model) = &w.model else {
        return Err(src.err(
            span,
            key("model"),
            format!("missing: flavor '{f}' needs the model to serve"),
        ));
    };
    if let Some(p) = &w.parallel
        && *p.get_ref() == 0
    {
        return Err(src.err(p.span(), key("parallel"), "must be at least 1"));
    }
    if let Some(m) = &w.mmproj
        && f != "llama-server"
    {
        return Err(src.err(
            m.span(),
            key("mmproj"),
            format!("is llama-server's (--mmproj); flavor '{f}' takes none: pass it in args"),
        ));
    }
    let gguf = model.get_ref().ends_with(".gguf");
    // The memory: a pool table without weights or from_gguf takes the
    // model's GGUF file; no table at all means the node's only memory
    // pool (a disk pool holds no memory).
    if out.memory.is_empty() {
        let memory: Vec<&PoolDef> = pools.iter().filter(|p| p.path.is_none()).collect();
        match memory.as_slice() {
            [only] if gguf => {
                let d = raw::Demand::default();
                out.memory
                    .insert(only.pool.name.to_string(), spanned(&span, d));
            }
            _ => {
                let why = if gguf {
                    "missing: this node has several pools; add [workload.memory.POOL] (its keys default to the model's GGUF file, ctx and kv_type)"
                } else {
                    "missing: the model is not a GGUF file, so its memory must be declared (weights, kv)"
                };
                return Err(src.err(span, key("memory"), why));
            }
        }
    }
    for demand in out.memory.values_mut() {
        let span = demand.span();
        let d = demand.get_mut();
        if d.weights.is_none() && d.from_gguf.is_none() {
            if !gguf {
                return Err(src.err(
                    span,
                    key("memory"),
                    "the model is not a GGUF file: declare weights (and kv)",
                ));
            }
            d.from_gguf = Some(spanned(&span, model.get_ref().clone()));
            d.ctx = d.ctx.clone().or_else(|| w.ctx.clone());
            d.kv_type = d.kv_type.clone().or_else(|| w.kv_type.clone());
        }
        if d.from_gguf.is_some() {
            d.process_overhead = process_overhead(f);
            d.serving = serving(f, w);
            d.mmproj.clone_from(&w.mmproj);
        }
    }
    let gpu_share = gpu_share(&out, pools);
    let keys = Keys {
        model: model.get_ref(),
        ctx: w.ctx.as_ref().map(|c| *c.get_ref()),
        kv_type: w.kv_type.as_ref().map(|t| t.get_ref().as_str()),
        parallel: w.parallel.as_ref().map(|p| *p.get_ref()),
        mmproj: w.mmproj.as_ref().map(|m| m.get_ref().as_str()),
        program: w.program.as_ref().map(|p| p.get_ref().as_str()),
        gpu_share,
    };
    let d = defaults(f, &keys);
    let sleeps = f == "vllm" && w.sleep.is_some();
    if sleeps {
        // vLLM's sleep endpoints are served only in its dev mode.
        out.env
            .entry("VLLM_SERVER_DEV_MODE".to_string())
            .or_insert_with(|| spanned(&span, "1".to_string()));
    }
    // llama-server sleeps by itself after `idle` unused.
    let idle_seconds = match w.sleep.as_ref().map(|t| (t, &t.get_ref().idle)) {
        Some((_, Some(idle))) if f == "llama-server" => {
            let d = crate::duration::parse_duration(idle.get_ref())
                .map_err(|e| src.err(idle.span(), key("sleep.idle"), e))?;
            Some(d.as_secs() + u64::from(d.subsec_nanos() > 0))
        }
        Some((t, None)) if f == "llama-server" => {
            let msg = "missing: llama-server sleeps by itself after this long unused (--sleep-idle-seconds)";
            return Err(src.err(t.span(), key("sleep.idle"), msg));
        }
        _ => None,
    };
    // A server that keeps its conversations saves them before it sleeps:
    // the agent has it save them a third of the way into its idle time
    // (`--metrics` tells the agent it is quiet without waking its idle
    // timer), and the save restarts the timer, so the server sleeps the
    // rest of the idle time after it.
    let keeps = f == "llama-server" && w.keep_kv.is_some();
    let idle_seconds = match (idle_seconds, &w.sleep) {
        (Some(n), Some(t)) if keeps && n > 0 => {
            if n < KEEP_KV_MIN_IDLE {
                let at = t.get_ref().idle.as_ref().map_or(t.span(), |i| i.span());
                let msg = format!(
                    "with keep_kv at least {KEEP_KV_MIN_IDLE}s: its conversations are saved a third of the way into its idle time, and the server sleeps the rest after the save"
                );
                return Err(src.err(at, key("sleep.idle"), msg));
            }
            Some(n - save_before_sleep(n))
        }
        (n, _) => n,
    };
    // llama-server's prompt cache lives in host memory beside the model:
    // reserved when the workload sizes it, off when the flavor writes the
    // command and nothing asks for it (8 GiB by default, never measured
    // until it has grown).
    let cache = if f == "llama-server" {
        cache_ram(src, w, &key)?
    } else {
        None
    };
    let prompt_cache = match cache {
        Some(0) => None,
        Some(mib) => Some(raw::PromptCache::Bytes(mib.saturating_mul(1 << 20))),
        None if f == "llama-server" && out.command.is_some() => {
            Some(raw::PromptCache::ServerDefault)
        }
        None => None,
    };
    // llama-server's repacked copy of the weights, beside the mapped file:
    // off when the flavor writes the command and nothing asks for it,
    // reserved when asked for.
    let repacks = if f == "llama-server" {
        repack(w)
    } else {
        Some(false)
    };
    let repacked = match repacks {
        Some(true) => Some(raw::Repack::Asked),
        None if out.command.is_some() => Some(raw::Repack::ServerDefault),
        _ => None,
    };
    if let Some(r) = repacked
        && let Some(table) = host_table(&out, pools)
        && let Some(d) = out.memory.get_mut(&table)
    {
        d.get_mut().repack = Some(r);
    }
    let host_pool = pools.iter().any(PoolDef::device_free);
    match prompt_cache.map(|c| (c, host_table(&out, pools))) {
        Some((c, Some(table))) => {
            if let Some(d) = out.memory.get_mut(&table) {
                d.get_mut().prompt_cache = Some(c);
            }
        }
        // A sized cache on a node that budgets host memory, with no table
        // there to reserve it in, would grow outside the books.
        Some((raw::PromptCache::Bytes(_), None)) if host_pool => {
            return Err(src.err(
                span,
                key("memory"),
                "llama-server's prompt cache (--cache-ram) lives in host memory, and this workload has no table for a pool bound to no device to reserve it in: add one, or pass --cache-ram 0",
            ));
        }
        _ => {}
    }
    if out.command.is_none() {
        let mut argv = d.argv;
        if f == "llama-server" && cache.is_none() {
            argv.extend(["--cache-ram", "0"].map(String::from));
        }
        if f == "llama-server" && repacks.is_none() {
            argv.push("--no-repack".to_string());
        }
        // Its conversations saved to the disk pool keep_kv names, in a
        // directory of the workload's own.
        if f == "llama-server"
            && let Some(pool) = &w.keep_kv
            && let Some(dir) = pools
                .iter()
                .find(|p| p.pool.name.as_str() == pool.get_ref())
                .and_then(|p| p.path.as_ref())
        {
            let dir = dir.join(spanned_str(&w.name));
            argv.extend(["--slot-save-path".to_string(), dir.display().to_string()]);
        }
        if sleeps {
            argv.push("--enable-sleep-mode".to_string());
        }
        if let Some(n) = idle_seconds.filter(|n| *n > 0) {
            argv.extend(["--sleep-idle-seconds".to_string(), n.to_string()]);
            if keeps {
                argv.push("--metrics".to_string());
            }
        }
        argv.extend(w.args.iter().map(|a| a.get_ref().clone()));
        out.command = Some(spanned(&span, argv));
    } else if !w.args.is_empty() {
        return Err(src.err(
            span,
            key("args"),
            "with command set, args has nothing to add to: put them in command",
        ));
    }
    if f == "llama-server" {
        ask_projection(&mut out, w.parallel.as_ref().map(|p| *p.get_ref()));
    }
    if out.readiness.is_none() {
        out.readiness = Some(spanned(
            &span,
            raw::Readiness {
                http: Some(d.readiness.into()),
                timeout: Some(spanned(&span, "600s".into())),
                ..Default::default()
            },
        ));
    }
    if out.stop_grace.is_none() {
        out.stop_grace = Some(spanned(&span, d.stop_grace.into()));
    }
    Ok(out)
}

/// The workload's table of host memory: the first that names a pool
/// bound to no device.
fn host_table(w: &raw::Workload, pools: &[PoolDef]) -> Option<String> {
    w.memory
        .iter()
        .find(|(name, d)| {
            d.get_ref().any_of.is_none()
                && pools
                    .iter()
                    .any(|p| p.pool.name.as_str() == name.as_str() && p.device_free())
        })
        .map(|(name, _)| name.clone())
}

/// The share of its device pool's budget a workload declares, when it
/// declares memory in exactly one device pool with a budget, or in any of
/// several device pools that all have the same budget.
fn gpu_share(w: &raw::Workload, pools: &[PoolDef]) -> Option<f64> {
    let device_budget = |name: &str| {
        let pool = pools
            .iter()
            .find(|p| p.pool.name.as_str() == name && p.device.is_some())?;
        pool.pool.budget
    };
    let mut device = w.memory.iter().filter_map(|(name, d)| {
        let d = d.get_ref();
        let budget = match &d.any_of {
            None => device_budget(name)?,
            Some(list) => {
                let mut budgets = list.get_ref().iter().map(|c| device_budget(c.get_ref()));
                let first = budgets.next()??;
                budgets.all(|b| b == Some(first)).then_some(first)?
            }
        } as f64;
        let bytes = |q: &Option<Spanned<raw::Quantity>>| match q.as_ref().map(Spanned::get_ref) {
            Some(raw::Quantity::Bytes(b)) => Some(*b),
            Some(raw::Quantity::Text(t)) => resident_core::parse_bytes(t).ok(),
            None => None,
        };
        let declared = bytes(&d.weights).unwrap_or(0)
            + bytes(&d.kv).unwrap_or(0)
            + bytes(&d.overhead).unwrap_or(0);
        (declared > 0).then(|| (declared as f64 / budget).min(1.0))
    });
    let share = device.next()?;
    device.next().is_none().then_some(share)
}
