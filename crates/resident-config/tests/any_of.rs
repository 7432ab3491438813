//! `[workload.memory.LABEL]` with `any_of`, `[node] gpu_choice`, a pool's
//! device `index`, and `${DEVICE}`: what they parse into, what a launch
//! hands the child, and every mistake named with its key.

use std::path::Path;

use resident_config::parse;
use resident_core::{GB, GpuChoice, PoolName};

/// Two GPUs (`nvml:0`, and a file-fed one with index 3), host memory, and
/// `workload` after them; `node` adds keys to `[node]`.
fn config(node: &str, workload: &str) -> String {
    format!(
        "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/r.sock\"\n{node}\n\
         [[pool]]\nname = \"gpu0\"\nbudget = \"24GB\"\ndevice = \"nvml:0\"\n\n\
         [[pool]]\nname = \"gpu1\"\nbudget = \"24GB\"\ndevice = \"file:/run/gpu1\"\nindex = 3\n\n\
         [[pool]]\nname = \"ram\"\nbudget = \"64GB\"\nhost = true\n\n\
         [[workload]]\nname = \"w\"\n{workload}"
    )
}

const ANY: &str = "command = [\"/bin/server\", \"--device\", \"${DEVICE}\"]\n\
                   [workload.memory.gpu]\nany_of = [\"gpu1\", \"gpu0\"]\nweights = \"8GB\"\nkv = \"2GB\"\n\
                   [workload.memory.ram]\nweights = \"1GB\"\n";

fn pools(names: &[&str]) -> Vec<PoolName> {
    names
        .iter()
        .map(|n| PoolName::new(*n).expect("valid"))
        .collect()
}

#[test]
fn an_any_of_table_parses_into_candidates_count_and_demand() {
    let c = parse(Path::new("r.toml"), &config("", ANY)).expect("valid");
    assert_eq!(c.node.gpu_choice, GpuChoice::Binpack, "the default");
    let w = &c.workloads["w"];
    assert_eq!(w.spec.demand.len(), 1, "ram is a fixed demand");
    assert_eq!(w.spec.footprint("ram"), GB);
    let [a] = w.spec.any_of.as_slice() else {
        panic!("one any-of demand: {:?}", w.spec.any_of);
    };
    assert_eq!(a.label, "gpu");
    assert_eq!(a.candidates, pools(&["gpu0", "gpu1"]), "in name order");
    assert_eq!(a.count, 1);
    assert_eq!(a.demand.footprint(), 10 * GB);
    // Device indexes: N of nvml:N, or the pool's index.
    assert_eq!(c.devices(&[pools(&["gpu0"])]), [0]);
    assert_eq!(c.devices(&[pools(&["gpu1"])]), [3]);
    assert_eq!(c.devices(&[pools(&["gpu0", "gpu1"])]), [0, 3]);
    assert!(
        c.devices(&[pools(&["ram"])]).is_empty(),
        "host memory has none"
    );

    let spread = config("gpu_choice = \"spread\"", ANY);
    let c = parse(Path::new("r.toml"), &spread).expect("valid");
    assert_eq!(c.node.gpu_choice, GpuChoice::Spread);
    let n_of = ANY.replace("weights = \"8GB\"", "count = 2\nweights = \"8GB\"");
    let c = parse(Path::new("r.toml"), &config("", &n_of)).expect("valid");
    assert_eq!(c.workloads["w"].spec.any_of[0].count, 2);
}

#[test]
fn a_launch_fills_in_device_and_cuda_visible_devices() {
    let text = config(
        "",
        &ANY.replace(
            "[workload.memory.gpu]",
            "env = { TAG = \"d${DEVICE}\" }\n[workload.memory.gpu]",
        ),
    );
    let c = parse(Path::new("r.toml"), &text).expect("valid");
    let w = &c.workloads["w"];
    let spec = w.launch("i", 1, &c.node, &[0, 3]);
    assert_eq!(spec.argv, ["/bin/server", "--device", "0,3"]);
    assert_eq!(spec.env["CUDA_VISIBLE_DEVICES"], "0,3");
    assert_eq!(spec.env["TAG"], "d0,3");
    // No devices (no any-of choice made): nothing is set.
    let spec = w.launch("i", 1, &c.node, &[]);
    assert!(!spec.env.contains_key("CUDA_VISIBLE_DEVICES"));
    // The workload's own CUDA_VISIBLE_DEVICES stands.
    let own = config(
        "",
        &ANY.replace(
            "[workload.memory.gpu]",
            "env = { CUDA_VISIBLE_DEVICES = \"1\" }\n[workload.memory.gpu]",
        ),
    );
    let c = parse(Path::new("r.toml"), &own).expect("valid");
    let spec = c.workloads["w"].launch("i", 1, &c.node, &[3]);
    assert_eq!(spec.env["CUDA_VISIBLE_DEVICES"], "1");
}

#[test]
fn mistakes_are_named_with_their_key() {
    let check = |node: &str, workload: &str, want: &str| {
        let err = parse(Path::new("r.toml"), &config(node, workload))
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "want {want:?} in: {err}");
        assert!(err.starts_with("r.toml:"), "{err}");
    };
    let any = |table: &str| {
        format!("command = [\"/bin/server\"]\n[workload.memory.gpu]\n{table}\nweights = \"8GB\"\n")
    };
    check(
        "",
        &any("any_of = [\"gpu0\", \"gpu9\"]"),
        "workload[w].memory.gpu.any_of[1]: no pool \"gpu9\" on this node",
    );
    check(
        "",
        &any("any_of = [\"gpu0\", \"gpu0\"]"),
        "workload[w].memory.gpu.any_of[1]: listed twice",
    );
    check(
        "",
        &any("any_of = []"),
        "workload[w].memory.gpu.any_of: names no pool",
    );
    check(
        "",
        &any("any_of = [\"gpu0\", \"gpu1\"]\ncount = 3"),
        "workload[w].memory.gpu.count: 3 pools asked for, of 2 candidates",
    );
    check(
        "",
        &any("any_of = [\"gpu0\", \"gpu1\"]\ncount = 0"),
        "workload[w].memory.gpu.count",
    );
    check(
        "",
        &any(""),
        "workload[w].memory.gpu: no pool \"gpu\" on this node (declare it with [[pool]], or give the table any_of",
    );
    check(
        "",
        "command = [\"/bin/server\"]\n[workload.memory.gpu0]\nany_of = [\"gpu1\"]\nweights = \"8GB\"\n",
        "workload[w].memory.gpu0: \"gpu0\" is a pool's name",
    );
    check(
        "",
        "command = [\"/bin/server\"]\n[workload.memory.gpu0]\ncount = 2\nweights = \"8GB\"\n",
        "workload[w].memory.gpu0.count: count goes with any_of",
    );
    check(
        "gpu_choice = \"fast\"",
        &any("any_of = [\"gpu0\"]"),
        "node.gpu_choice: \"fast\" is not a choice",
    );
    // ${DEVICE} needs an any-of demand over pools with device indexes.
    check(
        "",
        "command = [\"/bin/server\", \"${DEVICE}\"]\n[workload.memory.gpu0]\nweights = \"8GB\"\n",
        "workload[w].command: ${DEVICE} names the devices an any_of demand chose",
    );
    check(
        "",
        "command = [\"/bin/server\", \"${DEVICE}\"]\n[workload.memory.mem]\nany_of = [\"gpu0\", \"ram\"]\nweights = \"8GB\"\n",
        "workload[w].command: ${DEVICE}: pool 'ram' of memory.mem.any_of has no device index",
    );
    // A pool's index agrees with its device, and host memory has none.
    let text = config("", &any("any_of = [\"gpu0\"]"))
        .replace("device = \"nvml:0\"\n", "device = \"nvml:0\"\nindex = 2\n");
    let err = parse(Path::new("r.toml"), &text)
        .expect_err("index differs")
        .to_string();
    assert!(
        err.contains("pool[gpu0].index: 2 differs from the device's index 0"),
        "{err}"
    );
    let text = config("", &any("any_of = [\"gpu0\"]"))
        .replace("host = true\n", "host = true\nindex = 1\n");
    let err = parse(Path::new("r.toml"), &text)
        .expect_err("index on host")
        .to_string();
    assert!(
        err.contains("pool[ram].index: a pool of host memory has no device index"),
        "{err}"
    );
}
