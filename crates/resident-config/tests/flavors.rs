//! Flavors: each resolves to the argv, readiness, stop grace and memory
//! its server needs; what the workload sets itself stands; mistakes are
//! refused with file, line and key.

use std::path::Path;
use std::time::Duration;

use resident_config::{Config, Host, parse_with};
use resident_supervisor::Readiness;

const NODE: &str = "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/n.sock\"\n\n";

fn parse(rest: &str) -> Result<Config, String> {
    let text = format!("{NODE}{rest}");
    // Elsewhere: the model files and programs are on the node, not here.
    parse_with(Path::new("flavors.toml"), &text, Host::Elsewhere).map_err(|e| e.to_string())
}

fn one_pool(workload: &str) -> Config {
    parse(&format!(
        "[[pool]]\nname = \"ram\"\nbudget = \"64GB\"\n\n[[workload]]\n{workload}"
    ))
    .unwrap_or_else(|e| panic!("{e}"))
}

fn http(path: &str) -> Readiness {
    Readiness::Http { path: path.into() }
}

#[test]
fn each_flavor_resolves_to_its_servers_command_line_and_probe() {
    let c = one_pool(
        "name = \"a\"\nflavor = \"llama-server\"\nmodel = \"/m/a.gguf\"\nctx = 4096\nkv_type = \"q8_0\"\nparallel = 4\nargs = [\"--threads\", \"8\"]\n",
    );
    let a = &c.workloads["a"];
    assert!(a.reports_buffers);
    assert_eq!(
        a.argv,
        [
            "llama-server",
            "--model",
            "/m/a.gguf",
            "--host",
            "127.0.0.1",
            "--port",
            "${PORT}",
            "--ctx-size",
            "4096",
            "--parallel",
            "4",
            "--cache-type-k",
            "q8_0",
            "--cache-type-v",
            "q8_0",
            "--verbosity",
            "4",
            "--cache-ram",
            "0",
            "--no-repack",
            "--threads",
            "8"
        ]
    );
    assert_eq!(a.readiness, http("/health"));
    assert_eq!(a.stop_grace, Duration::from_secs(30));
    assert_eq!(
        a.spec.demand.keys().map(|p| p.as_str()).collect::<Vec<_>>(),
        ["ram"]
    );

    let c = one_pool(
        "name = \"b\"\nflavor = \"llama-cpp-python\"\nmodel = \"/m/b.gguf\"\nctx = 2048\nprogram = \"/opt/llama/bin/python\"\n",
    );
    let b = &c.workloads["b"];
    // Both llama.cpp servers report their buffers; the others do not.
    assert!(b.reports_buffers);
    assert_eq!(
        b.argv,
        [
            "/opt/llama/bin/python",
            "-m",
            "llama_cpp.server",
            "--model",
            "/m/b.gguf",
            "--host",
            "127.0.0.1",
            "--port",
            "${PORT}",
            "--n_ctx",
            "2048",
            "--use_mmap",
            "false",
            "--interrupt_requests",
            "false",
            "--logits_all",
            "false"
        ]
    );
    assert_eq!(b.readiness, http("/v1/models"));
    // The KV cache type the memory is sized for is the one it runs with,
    // as ggml's type number (q8_0 = 8).
    let c = one_pool(
        "name = \"q\"\nflavor = \"llama-cpp-python\"\nmodel = \"/m/b.gguf\"\nkv_type = \"q8_0\"\n",
    );
    let argv = &c.workloads["q"].argv;
    let at = |flag: &str| {
        argv.iter()
            .position(|a| a == flag)
            .map(|i| argv[i + 1].as_str())
    };
    assert_eq!(
        (at("--type_k"), at("--type_v")),
        (Some("8"), Some("8")),
        "{argv:?}"
    );
    assert_eq!(
        at("--flash_attn"),
        Some("true"),
        "a quantized V cache needs it"
    );

    let c = one_pool("name = \"m\"\nflavor = \"mlx-lm\"\nmodel = \"/m/m.gguf\"\n");
    let m = &c.workloads["m"];
    assert!(!m.reports_buffers);
    assert_eq!(
        &m.argv[..5],
        ["python3", "-m", "mlx_lm.server", "--model", "/m/m.gguf"]
    );
    assert_eq!(m.readiness, http("/v1/models"));
    assert_eq!(m.stop_grace, Duration::from_secs(15));
}

#[test]
fn vllm_is_held_to_the_share_of_the_card_it_declares() {
    let c = parse(
        "[[pool]]\nname = \"gpu0\"\nbudget = \"80GB\"\ndevice = \"file:/dev/null\"\n\n[[workload]]\nname = \"v\"\nflavor = \"vllm\"\nmodel = \"Qwen/Qwen2.5-7B-Instruct\"\nctx = 8192\nparallel = 16\n[workload.memory.gpu0]\nweights = \"15GB\"\nkv = \"20GB\"\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let v = &c.workloads["v"];
    assert!(!v.reports_buffers);
    assert_eq!(
        v.argv,
        [
            "vllm",
            "serve",
            "Qwen/Qwen2.5-7B-Instruct",
            "--host",
            "127.0.0.1",
            "--port",
            "${PORT}",
            "--max-model-len",
            "8192",
            "--max-num-seqs",
            "16",
            "--gpu-memory-utilization",
            // 35 of 80 GB is 0.4375: rounded down, never past the
            // reservation.
            "0.437"
        ]
    );
    assert_eq!(v.readiness, http("/health"));
    // On any of several cards of one size, the share of one card.
    let c = parse(
        "[[pool]]\nname = \"gpu0\"\nbudget = \"80GB\"\ndevice = \"nvml:0\"\n\n[[pool]]\nname = \"gpu1\"\nbudget = \"80GB\"\ndevice = \"nvml:1\"\n\n[[workload]]\nname = \"v\"\nflavor = \"vllm\"\nmodel = \"m\"\n[workload.memory.gpu]\nany_of = [\"gpu0\", \"gpu1\"]\ncount = 2\nweights = \"60GB\"\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let argv = &c.workloads["v"].argv;
    assert_eq!(
        argv[argv.len() - 2..],
        ["--gpu-memory-utilization", "0.750"]
    );
}

#[test]
fn what_the_workload_sets_itself_stands() {
    let c = one_pool(
        "name = \"a\"\nflavor = \"llama-server\"\nmodel = \"/m/a.gguf\"\nstop_grace = \"5s\"\ncommand = [\"/usr/local/bin/llama-server\", \"-m\", \"/m/a.gguf\", \"--port\", \"${PORT}\"]\n[workload.readiness]\nhttp = \"/v1/models\"\n[workload.memory.ram]\nweights = \"5GB\"\n",
    );
    let a = &c.workloads["a"];
    assert_eq!(a.argv[0], "/usr/local/bin/llama-server");
    assert_eq!(a.readiness, http("/v1/models"));
    assert_eq!(a.stop_grace, Duration::from_secs(5));
    assert_eq!(a.spec.footprint("ram"), 5_000_000_000);
}

#[test]
fn mistakes_are_named_with_file_line_and_key() {
    let pool = "[[pool]]\nname = \"ram\"\nbudget = \"64GB\"\n\n";
    let cases = [
        (
            "name = \"a\"\nflavor = \"ollama\"\nmodel = \"/m/a.gguf\"\n",
            "workload[a].flavor",
            "known: llama-server, llama-cpp-python, vllm, mlx-lm",
        ),
        (
            "name = \"a\"\nflavor = \"vllm\"\n",
            "workload[a].model",
            "needs the model",
        ),
        (
            "name = \"a\"\ncommand = [\"/bin/true\"]\nmodel = \"/m/a.gguf\"\n",
            "workload[a].model",
            "set flavor too",
        ),
        (
            "name = \"a\"\n",
            "workload[a].command",
            "a command or a flavor",
        ),
        (
            "name = \"a\"\nflavor = \"vllm\"\nmodel = \"org/model\"\n",
            "workload[a].memory",
            "not a GGUF file",
        ),
        (
            "name = \"a\"\nflavor = \"llama-server\"\nmodel = \"/m/a.gguf\"\ncommand = [\"/bin/true\"]\nargs = [\"-v\"]\n",
            "workload[a].args",
            "put them in command",
        ),
    ];
    for (workload, key, says) in cases {
        let e = parse(&format!("{pool}[[workload]]\n{workload}")).expect_err(workload);
        assert!(e.starts_with("flavors.toml:"), "{e}");
        assert!(e.contains(key) && e.contains(says), "{workload}\n=> {e}");
    }
    let two =
        "[[pool]]\nname = \"a\"\nbudget = \"1GB\"\n\n[[pool]]\nname = \"b\"\nbudget = \"1GB\"\n\n";
    let e = parse(&format!(
        "{two}[[workload]]\nname = \"w\"\nflavor = \"llama-server\"\nmodel = \"/m/a.gguf\"\n"
    ))
    .expect_err("which pool");
    assert!(
        e.contains("workload[w].memory") && e.contains("several pools"),
        "{e}"
    );
}

/// A GPU pool and a host pool, then `workload`.
fn gpu_and_host(workload: &str) -> Result<Config, String> {
    parse(&format!(
        "[[pool]]\nname = \"gpu0\"\nbudget = \"80GB\"\ndevice = \"file:/dev/null\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"128GB\"\nhost = true\n\n[[workload]]\n{workload}"
    ))
}

/// A model sized from its GGUF file in two tables (a flavor fills every
/// table without weights with its model) would be reserved twice: refused,
/// naming the second table; the way out the message gives is taken.
#[test]
fn a_model_file_sized_in_two_tables_is_refused() {
    let head = "name = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\nargs = [\"--cache-ram\", \"512\"]\n[workload.memory.gpu0]\n";
    let twice = gpu_and_host(&format!(
        "{head}[workload.memory.ram]\noverhead = \"100MB\"\n"
    ))
    .expect_err("the model counted in both tables");
    assert!(
        twice.contains("workload[l].memory.ram.from_gguf"),
        "{twice}"
    );
    assert!(twice.contains("reserved twice"), "{twice}");
    assert!(twice.contains("flavors.toml:"), "{twice}");
    let written = gpu_and_host(&format!(
        "{head}from_gguf = \"/m/l.gguf\"\n[workload.memory.ram]\nfrom_gguf = \"/m/l.gguf\"\n"
    ))
    .expect_err("written twice");
    assert!(written.contains("memory.ram.from_gguf"), "{written}");
    let once = gpu_and_host(&format!(
        "{head}[workload.memory.ram]\nweights = \"0\"\noverhead = \"100MB\"\n"
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let ram = &once.workloads["l"].spec.demand[&resident_core::PoolName::new("ram").expect("name")];
    assert_eq!(ram.weights, 0);
    assert_eq!(
        ram.overhead, 100_000_000,
        "a declared overhead stands whole"
    );
}

#[test]
fn vllm_sleeps_at_level_1_with_its_weights_in_the_host_pool() {
    let c = gpu_and_host(
        "name = \"v\"\nflavor = \"vllm\"\nmodel = \"m\"\n[workload.memory.gpu0]\nweights = \"15GB\"\nkv = \"20GB\"\n[workload.sleep]\nidle = \"10m\"\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let v = &c.workloads["v"];
    assert!(
        v.argv.contains(&"--enable-sleep-mode".to_string()),
        "{:?}",
        v.argv
    );
    assert_eq!(v.env["VLLM_SERVER_DEV_MODE"], "1");
    let s = v.sleep.as_ref().expect("it sleeps");
    assert_eq!(
        s.sleep.as_ref().map(ToString::to_string).as_deref(),
        Some("POST /sleep?level=1")
    );
    assert_eq!(
        s.wake.as_ref().map(ToString::to_string).as_deref(),
        Some("POST /wake_up")
    );
    assert_eq!(s.idle, Some(Duration::from_secs(600)));
    // Asleep: its weights in the host pool, a residue on the card.
    assert_eq!(v.spec.asleep_footprint("ram"), 15_000_000_000);
    assert_eq!(v.spec.asleep_footprint("gpu0"), 1_000_000_000);
    // Level 2 discards the weights; the residue is configurable.
    let c = gpu_and_host(
        "name = \"v\"\nflavor = \"vllm\"\nmodel = \"m\"\n[workload.memory.gpu0]\nweights = \"15GB\"\n[workload.sleep]\nlevel = 2\nresidue = \"0.5GB\"\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let v = &c.workloads["v"];
    assert_eq!(
        v.sleep
            .as_ref()
            .and_then(|s| s.sleep.as_ref())
            .expect("sleeps")
            .path,
        "/sleep?level=2"
    );
    assert_eq!(v.spec.asleep_footprint("ram"), 0);
    assert_eq!(v.spec.asleep_footprint("gpu0"), 500_000_000);
}

#[test]
fn a_sleep_table_is_checked_key_by_key() {
    let generic = "name = \"g\"\ncommand = [\"/bin/server\"]\n[workload.memory.gpu0]\nweights = \"1GB\"\n[workload.sleep]\n";
    let cases = [
        (
            format!("{generic}sleep = \"POST /sleep\"\n"),
            "workload[g].sleep.wake",
            "missing",
        ),
        (
            format!("{generic}sleep = \"/sleep\"\nwake = \"POST /wake\"\n"),
            "workload[g].sleep.sleep",
            "give the method and the path",
        ),
        (
            format!("{generic}sleep = \"POST /s\"\nwake = \"POST /w\"\nlevel = 1\n"),
            "workload[g].sleep.level",
            "is vLLM's",
        ),
        (
            format!(
                "{generic}sleep = \"POST /s\"\nwake = \"POST /w\"\n[workload.sleep.memory.disk]\noverhead = \"1GB\"\n"
            ),
            "workload[g].sleep.memory.disk",
            "no pool \"disk\"",
        ),
    ];
    for (workload, key, why) in cases {
        let e = gpu_and_host(&workload).expect_err("refused");
        assert!(e.contains(key) && e.contains(why), "{workload}: {e}");
    }
    // A generic server's asleep tables: a pool's residue alone.
    let c = gpu_and_host(&format!(
        "{generic}sleep = \"POST /s\"\nwake = \"POST /w\"\n[workload.sleep.memory.gpu0]\noverhead = \"0.2GB\"\n"
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.workloads["g"].spec.asleep_footprint("gpu0"), 200_000_000);
}

#[test]
fn llama_servers_prompt_cache_is_off_or_reserved_in_host_memory() {
    const MIB: u64 = 1 << 20;
    let pools = "[[pool]]\nname = \"ram\"\nbudget = \"64GB\"\n\n[[pool]]\nname = \"gpu0\"\nbudget = \"80GB\"\nindex = 0\n\n";
    let tables =
        "[workload.memory.gpu0]\nweights = \"4GB\"\n[workload.memory.ram]\nweights = \"1GB\"\n";
    let config = |rest: &str| {
        parse(&format!(
            "{pools}[[workload]]\nname = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\n{rest}{tables}"
        ))
    };
    let ok = |rest: &str| config(rest).unwrap_or_else(|e| panic!("{rest}: {e}"));
    let cram = |c: &Config| {
        let argv = &c.workloads["l"].argv;
        let n = argv.iter().position(|a| a == "--cache-ram")?;
        Some(argv[n + 1].clone())
    };

    // Nothing asks for it: off, and nothing beyond the tables reserved.
    let c = ok("");
    assert_eq!(cram(&c).as_deref(), Some("0"));
    assert_eq!(c.workloads["l"].spec.footprint("ram"), 1_000_000_000);
    assert_eq!(c.workloads["l"].spec.footprint("gpu0"), 4_000_000_000);

    // Sized in args, in either spelling, or by the server's variable: that
    // much reserved in the host pool, never on the device, and the flag
    // not written twice.
    for (rest, mib) in [
        ("args = [\"--cache-ram\", \"512\"]\n", 512),
        ("args = [\"-cram\", \"256\"]\n", 256),
        ("args = [\"--cache_ram\", \"128\"]\n", 128),
        ("env = { LLAMA_ARG_CACHE_RAM = \"64\" }\n", 64),
    ] {
        let c = ok(rest);
        let l = &c.workloads["l"];
        assert_eq!(l.spec.footprint("ram"), 1_000_000_000 + mib * MIB, "{rest}");
        assert_eq!(l.spec.footprint("gpu0"), 4_000_000_000, "{rest}");
        assert_eq!(
            l.argv
                .iter()
                .filter(|a| a.contains("cache-ram") || a.contains("cache_ram") || *a == "-cram")
                .count(),
            usize::from(!rest.starts_with("env")),
            "{rest}: {:?}",
            l.argv
        );
        assert!(
            l.reservation.iter().any(|n| n.contains("prompt cache")),
            "{rest}: {:?}",
            l.reservation
        );
    }

    // Asleep, the cache stays in the books beside the process.
    let c = ok("args = [\"--cache-ram\", \"512\"]\n[workload.sleep]\nidle = \"90s\"\n");
    let l = &c.workloads["l"];
    assert_eq!(l.spec.asleep_footprint("ram"), 27_000_000 + 512 * MIB);
    assert_eq!(l.spec.asleep_footprint("gpu0"), 27_000_000);
    // A declared overhead stands as the whole figure, asleep as awake.
    let c = parse(&format!(
        "{pools}[[workload]]\nname = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\nargs = [\"--cache-ram\", \"512\"]\n[workload.memory.gpu0]\nweights = \"4GB\"\n[workload.memory.ram]\nweights = \"1GB\"\noverhead = \"100MB\"\n[workload.sleep]\nidle = \"90s\"\n"
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let l = &c.workloads["l"];
    assert_eq!(l.spec.footprint("ram"), 1_100_000_000);
    assert_eq!(l.spec.asleep_footprint("ram"), 27_000_000);

    // A command of the workload's own that leaves the server's default:
    // not reserved, and said.
    let c =
        ok("command = [\"/opt/llama-server\", \"-m\", \"/m/l.gguf\", \"--port\", \"${PORT}\"]\n");
    assert_eq!(c.workloads["l"].spec.footprint("ram"), 1_000_000_000);
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("workload[l].memory.ram.overhead") && w.contains("--cache-ram")),
        "{:?}",
        c.warnings
    );
    let c = ok(
        "command = [\"/opt/llama-server\", \"-m\", \"/m/l.gguf\", \"--port\", \"${PORT}\", \"--cache-ram\", \"100\"]\n",
    );
    assert_eq!(
        c.workloads["l"].spec.footprint("ram"),
        1_000_000_000 + 100 * MIB
    );
    assert!(
        !c.warnings.iter().any(|w| w.contains("--cache-ram")),
        "{:?}",
        c.warnings
    );

    // Sized, with no table in the node's host-memory pool to hold it:
    // refused, naming the workload's memory.
    let e = parse(&format!(
        "{pools}[[workload]]\nname = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\nargs = [\"--cache-ram\", \"512\"]\n[workload.memory.gpu0]\nweights = \"4GB\"\n"
    ))
    .expect_err("no host table");
    assert!(
        e.contains("workload[l].memory") && e.contains("--cache-ram"),
        "{e}"
    );

    // No bound, or not a number: refused, naming where it was written.
    for (rest, key) in [
        ("args = [\"--cache-ram\", \"-1\"]\n", "workload[l].args"),
        ("args = [\"-cram\", \"lots\"]\n", "workload[l].args"),
        // The server refuses the joined form ("invalid argument").
        ("args = [\"--cache-ram=128\"]\n", "workload[l].args"),
        (
            "env = { LLAMA_ARG_CACHE_RAM = \"-1\" }\n",
            "workload[l].env.LLAMA_ARG_CACHE_RAM",
        ),
    ] {
        let e = config(rest).expect_err(rest);
        assert!(
            e.contains(key) && e.contains("--cache-ram") && e.starts_with("flavors.toml:"),
            "{rest}: {e}"
        );
    }
}

#[test]
fn llama_server_sleeps_by_itself_after_its_idle_time() {
    let c = one_pool(
        "name = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.sleep]\nidle = \"90s\"\n",
    );
    let l = &c.workloads["l"];
    let n = l
        .argv
        .iter()
        .position(|a| a == "--sleep-idle-seconds")
        .expect("passed");
    assert_eq!(l.argv[n + 1], "90");
    let s = l.sleep.as_ref().expect("it sleeps");
    assert_eq!(
        (s.sleep.as_ref(), s.wake.as_ref()),
        (None, None),
        "by itself"
    );
    assert_eq!(s.follow.as_deref(), Some("/props"));
    let asleep = l.spec.asleep.as_ref().expect("an asleep demand");
    assert!(asleep.by_itself);
    assert_eq!(l.spec.asleep_footprint("ram"), 27_000_000, "its process");
    for (sleep, key, why) in [
        ("", "workload[l].sleep.idle", "missing"),
        (
            "idle = \"9s\"\nwake = \"POST /w\"\n",
            "workload[l].sleep.wake",
            "by itself",
        ),
    ] {
        let e = parse(&format!(
            "[[pool]]\nname = \"ram\"\nbudget = \"64GB\"\n\n[[workload]]\nname = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.sleep]\n{sleep}"
        ))
        .expect_err("refused");
        assert!(e.contains(key) && e.contains(why), "{sleep}: {e}");
    }
}

/// llama-server repacks the weights the CPU runs into a copy of its own
/// (a CPU with AMX: 180 MiB beside a 181 MiB mapped model, measured on
/// this kind of machine): off (`--no-repack`) unless the workload asks,
/// and then the copy is reserved; a command of its own that leaves the
/// default is warned about.
#[test]
fn llama_servers_repacked_weights_are_off_or_reserved() {
    let ok = |extra: &str| {
        parse(&format!(
            "[[pool]]\nname = \"ram\"\nbudget = \"64GB\"\n\n[[workload]]\nname = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\nctx = 512\nparallel = 1\n{extra}[workload.memory.ram]\nweights = \"1GB\"\n"
        ))
        .unwrap_or_else(|e| panic!("{extra}: {e}"))
    };
    // Nothing asked: off.
    let c = ok("");
    let l = &c.workloads["l"];
    assert!(l.argv.iter().any(|a| a == "--no-repack"), "{:?}", l.argv);
    let plain = l.spec.footprint("ram");
    // Asked for, by flag or variable: the copy reserved, the flag kept.
    for extra in [
        "args = [\"--repack\"]\n",
        "env = { LLAMA_ARG_REPACK = \"1\" }\n",
    ] {
        let c = ok(extra);
        let l = &c.workloads["l"];
        assert!(
            !l.argv.iter().any(|a| a == "--no-repack"),
            "{extra}: {:?}",
            l.argv
        );
        assert_eq!(l.spec.footprint("ram"), plain + 1_000_000_000, "{extra}");
        assert!(
            l.reservation.iter().any(|r| r.contains("repacked copy")),
            "{extra}: {:?}",
            l.reservation
        );
    }
    // Turned off by the workload: as by the flavor.
    let c = ok("args = [\"-nr\"]\n");
    assert_eq!(c.workloads["l"].spec.footprint("ram"), plain);
    // A command of its own that leaves the default: not reserved, said.
    let c = ok(
        "command = [\"/opt/llama-server\", \"-m\", \"/m/l.gguf\", \"--port\", \"${PORT}\", \"--cache-ram\", \"0\"]\n",
    );
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("workload[l].memory.ram.overhead") && w.contains("--no-repack")),
        "{:?}",
        c.warnings
    );
}

/// `keep_kv = "POOL"`: a llama-server's conversations saved to a disk pool
/// (`[[pool]] path`): the flavor passes `--slot-save-path` (the pool's
/// directory and the workload's name); a disk pool holds no memory, needs
/// a budget and an absolute path; keep_kv names a disk pool, on
/// llama-server.
#[test]
fn keep_kv_saves_slots_to_a_disk_pool() {
    let node = "[[pool]]\nname = \"ram\"\nbudget = \"64GB\"\n\n[[pool]]\nname = \"kv\"\nbudget = \"10GB\"\npath = \"/var/lib/residentd/kv\"\n\n";
    let c = parse(&format!(
        "{node}[[workload]]\nname = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\nctx = 512\nparallel = 1\nkeep_kv = \"kv\"\n[workload.memory.ram]\nweights = \"1GB\"\n"
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let l = &c.workloads["l"];
    let at = l
        .argv
        .iter()
        .position(|a| a == "--slot-save-path")
        .expect("--slot-save-path");
    assert_eq!(l.argv[at + 1], "/var/lib/residentd/kv/l");
    let keep = l.keep_kv.as_ref().expect("keeps its conversations");
    assert_eq!(
        (keep.pool.as_str(), keep.dir.as_path()),
        ("kv", std::path::Path::new("/var/lib/residentd/kv/l"))
    );
    assert_eq!(l.spec.footprint("kv"), 0, "no memory in a disk pool");
    let disk = c
        .pools
        .iter()
        .find(|p| p.pool.name.as_str() == "kv")
        .expect("kv");
    assert!(!disk.device_free(), "never a host table");

    let refused = |text: &str, want: &str| {
        let e = parse(text).expect_err(want);
        assert!(e.contains(want), "want {want:?} in: {e}");
    };
    let flavored = |extra: &str| {
        format!(
            "{node}[[workload]]\nname = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\n{extra}\n[workload.memory.ram]\nweights = \"1GB\"\n"
        )
    };
    refused(
        &flavored("keep_kv = \"ram\""),
        "workload[l].keep_kv: no disk pool \"ram\"",
    );
    refused(
        &format!(
            "{node}[[workload]]\nname = \"p\"\nflavor = \"llama-cpp-python\"\nmodel = \"/m/l.gguf\"\nkeep_kv = \"kv\"\n[workload.memory.ram]\nweights = \"1GB\"\n"
        ),
        "workload[p].keep_kv: keep_kv saves llama-server's slots",
    );
    refused(
        &format!(
            "{node}[[workload]]\nname = \"w\"\ncommand = [\"/bin/sleep\", \"1\"]\n[workload.memory.kv]\nweights = \"1GB\"\n"
        ),
        "workload[w].memory.kv: pool \"kv\" is a disk pool",
    );
    refused(
        "[[pool]]\nname = \"kv\"\npath = \"/var/lib/kv\"\n",
        "pool[kv].budget: a disk pool needs a budget",
    );
    refused(
        "[[pool]]\nname = \"kv\"\nbudget = \"1GB\"\npath = \"kv\"\n",
        "pool[kv].path: \"kv\": a disk pool's directory must be absolute",
    );
    refused(
        "[[pool]]\nname = \"kv\"\nbudget = \"1GB\"\nhost = true\npath = \"/kv\"\n",
        "pool[kv].path: a disk pool (path) holds saved conversations",
    );

    // A server that sleeps by itself saves its conversations a third of
    // the way into its idle time: it is given the rest, and --metrics.
    let sleeper = |idle: &str, keep: bool| {
        let keep = if keep { "keep_kv = \"kv\"\n" } else { "" };
        format!(
            "{node}[[workload]]\nname = \"l\"\nflavor = \"llama-server\"\nmodel = \"/m/l.gguf\"\n{keep}[workload.memory.ram]\nweights = \"1GB\"\n[workload.sleep]\nidle = \"{idle}\"\n"
        )
    };
    let idle_arg = |w: &resident_config::Workload| {
        let at = w.argv.iter().position(|a| a == "--sleep-idle-seconds");
        at.map(|at| w.argv[at + 1].clone())
    };
    let c = parse(&sleeper("30s", true)).unwrap_or_else(|e| panic!("{e}"));
    let l = &c.workloads["l"];
    assert_eq!(idle_arg(l).as_deref(), Some("20"));
    assert!(l.argv.iter().any(|a| a == "--metrics"));
    assert_eq!(
        l.keep_kv.as_ref().and_then(|k| k.save_quiet),
        Some(std::time::Duration::from_secs(10))
    );
    let c = parse(&sleeper("30s", false)).unwrap_or_else(|e| panic!("{e}"));
    let l = &c.workloads["l"];
    assert_eq!(
        idle_arg(l).as_deref(),
        Some("30"),
        "nothing kept: its own idle"
    );
    assert!(!l.argv.iter().any(|a| a == "--metrics"));
    refused(
        &sleeper("5s", true),
        "workload[l].sleep.idle: with keep_kv at least 6s",
    );
    let c = parse(&flavored("keep_kv = \"kv\"")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        c.workloads["l"].keep_kv.as_ref().and_then(|k| k.save_quiet),
        None,
        "no sleep: saved only before a stop"
    );
}
