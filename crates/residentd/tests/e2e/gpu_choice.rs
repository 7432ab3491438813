//! Any-of demands through the agent, on two device pools fed from files:
//! where "any GPU" lands under each `gpu_choice`, what its processes see
//! (`CUDA_VISIBLE_DEVICES`, `${DEVICE}`), and a start that fits nowhere,
//! refused with both pools' reasons.

use crate::support::*;
use resident_api::pb;
use tonic::Code;

/// An agent with two 24 GB device pools, `gpu0` (device index 4) and
/// `gpu1` (index 7), their readings kept in files, and a workload `any`
/// asking 10 GB of either; `big` asks 16 GB of either.
async fn two_gpus(choice: &str) -> Daemon {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut pools = String::new();
    for (name, index) in [("gpu0", 4), ("gpu1", 7)] {
        let reading = dir.path().join(format!("{name}.available"));
        std::fs::write(&reading, "24000000000\n").expect("reading");
        pools += &format!(
            "[[pool]]\nname = \"{name}\"\nbudget = \"24GB\"\ndevice = \"file:{}\"\nindex = {index}\n\n",
            reading.display()
        );
    }
    let any = |name: &str, gb: u64| {
        format!(
            "[[workload]]\nname = \"{name}\"\ncommand = [\"/bin/sh\", \"-c\", \"echo device=${{DEVICE}}; sleep 3600\"]\nstop_grace = \"2s\"\n[workload.memory.gpu]\nany_of = [\"gpu0\", \"gpu1\"]\nweights = \"{gb}GB\"\n\n"
        )
    };
    let config = format!(
        "gpu_choice = \"{choice}\"\n{pools}{}{}",
        any("any", 10),
        any("big", 16)
    );
    write_config(dir.path(), &config);
    Daemon::start_in(dir).await
}

/// The pools an instance holds memory in.
fn pools_of(i: &pb::Instance) -> Vec<String> {
    i.demand.iter().map(|d| d.pool.clone()).collect()
}

/// A variable of a live process's environment.
fn env_of(pid: u32, var: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ
        .split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok())
        .find_map(|kv| kv.strip_prefix(&format!("{var}=")).map(String::from))
}

/// A process's argv, its arguments joined by spaces.
fn cmdline(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let args: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    args.join(" ")
}

#[tokio::test]
async fn spread_puts_two_on_two_devices_and_the_children_see_theirs() {
    let mut d = two_gpus("spread").await;
    // The roster shows the any-of demand.
    let roster = d
        .client
        .workloads(pb::WorkloadsRequest {})
        .await
        .expect("workloads")
        .into_inner();
    let any = roster
        .workloads
        .iter()
        .find(|w| w.name == "any")
        .expect("any");
    assert!(any.demand.is_empty(), "no fixed pool");
    assert_eq!(any.any_of.len(), 1);
    assert_eq!(any.any_of[0].candidates, ["gpu0", "gpu1"]);
    assert_eq!(any.any_of[0].count, 1);
    // Place says where a start would land, and with what.
    let place = pb::PlaceRequest {
        workload: "any".into(),
        on_full: 0,
        ..Default::default()
    };
    let p = d
        .client
        .place(place.clone())
        .await
        .expect("place")
        .into_inner();
    assert!(p.admitted);
    assert_eq!(p.demand.len(), 1);
    assert_eq!(p.demand[0].pool, "gpu0", "both alike: the first by name");
    assert_eq!(p.demand[0].weights_bytes, 10_000_000_000);

    let a = d.started("any", "a").await;
    assert_eq!(pools_of(&a), ["gpu0"]);
    assert_eq!(a.devices, "4");
    let b = d.started("any", "b").await;
    assert_eq!(pools_of(&b), ["gpu1"], "spread: the emptier device");
    assert_eq!(b.devices, "7");
    for (i, want) in [(&a, "4"), (&b, "7")] {
        assert_eq!(env_of(i.pid, "CUDA_VISIBLE_DEVICES").as_deref(), Some(want));
        assert!(
            cmdline(i.pid).contains(&format!("echo device={want};")),
            "${{DEVICE}} expanded: {}",
            cmdline(i.pid)
        );
    }
    let node = d.node().await;
    let used: Vec<(String, u64)> = node
        .pools
        .iter()
        .map(|p| (p.name.clone(), p.used_bytes))
        .collect();
    assert_eq!(
        used,
        [
            ("gpu0".into(), 10_000_000_000),
            ("gpu1".into(), 10_000_000_000)
        ]
    );

    // 16 GB fits on neither (14 GB left on each): refused, with both
    // pools' reasons, and nothing changed.
    let e = d
        .client
        .start(start_req("big", "c"))
        .await
        .expect_err("fits nowhere");
    assert_eq!(e.code(), Code::ResourceExhausted);
    let (info, placement) = refusal_details(&e);
    assert_eq!(info.reason, "OVER_BUDGET");
    // Each pool is short of its budget and, read live (the files show the
    // memory of a and b as not yet touched), of its ceiling too.
    let reasons: Vec<String> = placement
        .refusals
        .iter()
        .map(|r| match &r.reason {
            Some(pb::refusal::Reason::OverBudget(o)) => format!("OVER_BUDGET@{}", o.pool),
            Some(pb::refusal::Reason::HostMemory(h)) => format!("HOST_MEMORY@{}", h.pool),
            other => panic!("a memory reason, not {other:?}"),
        })
        .collect();
    assert_eq!(
        reasons,
        [
            "OVER_BUDGET@gpu0",
            "HOST_MEMORY@gpu0",
            "OVER_BUDGET@gpu1",
            "HOST_MEMORY@gpu1"
        ],
        "every candidate's reasons, pool by pool"
    );
    assert!(e.message().contains("'gpu0'"), "{}", e.message());
    assert_eq!(d.ids().await, ["a", "b"]);
    assert!(alive(a.pid as i32) && alive(b.pid as i32));

    // Stopped, its device is free again and the next start may take it.
    d.stopped("b").await;
    let c = d.started("big", "c").await;
    assert_eq!(pools_of(&c), ["gpu1"]);
    assert_eq!(c.devices, "7");
}

#[tokio::test]
async fn binpack_fills_one_device_before_the_next() {
    let mut d = two_gpus("binpack").await;
    let a = d.started("any", "a").await;
    let b = d.started("any", "b").await;
    assert_eq!(pools_of(&a), ["gpu0"]);
    assert_eq!(
        pools_of(&b),
        ["gpu0"],
        "binpack: the same device while it fits"
    );
    assert_eq!(env_of(b.pid, "CUDA_VISIBLE_DEVICES").as_deref(), Some("4"));
    // Numbered as NVML numbers them, not fastest first.
    assert_eq!(
        env_of(b.pid, "CUDA_DEVICE_ORDER").as_deref(),
        Some("PCI_BUS_ID")
    );
    // 4 GB are left on gpu0: the third goes to gpu1.
    let c = d.started("any", "c").await;
    assert_eq!(pools_of(&c), ["gpu1"]);
    assert_eq!(env_of(c.pid, "CUDA_VISIBLE_DEVICES").as_deref(), Some("7"));
    // The list and Get say the same as the start did.
    let got = d.get("b").await;
    assert_eq!(
        (pools_of(&got), got.devices.as_str()),
        (vec!["gpu0".to_string()], "4")
    );
}

#[tokio::test]
async fn a_run_taken_over_after_kill_9_keeps_the_device_it_was_given() {
    let mut d = two_gpus("spread").await;
    d.started("any", "a").await;
    d.started("any", "b").await;
    // Keep the one on gpu1: with both devices empty, a new choice would
    // take gpu0.
    let (gone, kept) = if pools_of(&d.get("a").await) == ["gpu0"] {
        ("a", "b")
    } else {
        ("b", "a")
    };
    d.stopped(gone).await;
    let before = d.get(kept).await;
    assert_eq!(pools_of(&before), ["gpu1"], "{before:?}");
    let journaled = eventually(async || {
        d.journaled()
            .iter()
            .any(|e| e.instance == kept && e.pgid == before.pid as i32 && e.chosen == [["gpu1"]])
    })
    .await;
    assert!(
        journaled,
        "the journal records the choice: {:?}",
        d.journaled()
    );
    d.kill();
    let mut d = d.restart().await;
    let after = d.wait_state(kept, pb::State::Ready).await;
    assert_eq!(after.pid, before.pid, "taken over");
    assert_eq!(
        pools_of(&after),
        ["gpu1"],
        "the device it runs on, not a new pick"
    );
    assert_eq!(after.devices, before.devices);
    let pools = d.node().await.pools;
    let used = |name: &str| pools.iter().find(|p| p.name == name).map(|p| p.used_bytes);
    assert_eq!(
        (used("gpu0"), used("gpu1")),
        (Some(0), Some(10_000_000_000))
    );
}
