//! An instance that outgrows its declared memory is held to it by its
//! cgroup (declared host footprint plus `memory_slack`): the kernel kills
//! it, and the agent reports the OOM kill over the API and frees its
//! reservation.

use crate::support::*;
use resident_api::pb;

#[tokio::test]
async fn an_instance_over_its_declared_memory_is_oom_killed_and_reported() {
    let hog = "[\"python3\", \"-c\", \"import time; b = bytearray(400 << 20); time.sleep(60)\"]";
    let text = format!(
        "memory_slack = \"50MB\"\n[[pool]]\nname = \"ram\"\nbudget = \"10GB\"\n\n[[workload]]\nname = \"hog\"\ncommand = {hog}\n[workload.memory.ram]\nweights = \"100MB\"\n[workload.restart]\npolicy = \"never\"\n"
    );
    let mut d = Daemon::start(&text).await;
    let log = d.log();
    let limits = log.contains("cgroup v1 memory at") || log.contains("with memory.max");
    if !limits {
        return skip("no cgroup memory controller the agent can write to");
    }
    d.started("hog", "h1").await;
    let failed = d.wait_state("h1", pb::State::Failed).await;
    assert!(failed.oom_killed, "{failed:?}");
    assert_eq!(failed.exit_signal, 9, "{failed:?}");
    assert!(
        failed
            .message
            .contains("OOM-killed at its memory limit of 150000000 bytes"),
        "{failed:?}"
    );
    assert_eq!(
        d.node().await.pools[0].used_bytes,
        0,
        "its reservation is released"
    );
}
