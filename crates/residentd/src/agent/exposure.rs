//! The exposure guard: an instance of a workload with `expose =
//! "loopback"` (the default of flavors) whose processes listen on any
//! address beyond loopback is stopped, its message and events saying
//! EXPOSED and the address; an adopted one is reported (message, event,
//! metric), never stopped. Checked once a second, from the agent's tick,
//! for READY instances, on a blocking thread: the listening TCP sockets of
//! `/proc/net/tcp` and `tcp6` are read, and only when a listener beyond
//! loopback or a guarded run is new since the last look (`Seen`) are the
//! process groups' sockets (`/proc/PID/fd`) matched against them. The same
//! matching finds the port of a server being adopted.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use parking_lot::Mutex;

use super::books::Guarded;

/// The TCP state LISTEN in /proc/net/tcp.
const LISTEN: &str = "0A";

/// Listening sockets of one /proc/net/tcp or tcp6 table: inode to address.
fn parse_table(text: &str, out: &mut HashMap<u64, SocketAddr>) {
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(state), Some(inode)) = (fields.get(1), fields.get(3), fields.get(9))
        else {
            continue;
        };
        if *state != LISTEN {
            continue;
        }
        if let (Some(addr), Ok(inode)) = (address(local), inode.parse()) {
            out.insert(inode, addr);
        }
    }
}

/// `0100007F:1F90` or 32 hex digits and a port: the kernel prints each
/// 32-bit word of the address in this machine's byte order.
fn address(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        let w = u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16).ok()?;
        Some(w.to_ne_bytes())
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Every listening TCP socket of this network namespace.
#[allow(clippy::disallowed_methods)] // on a blocking thread (`Seen::look`, `look_at`)
fn listening() -> HashMap<u64, SocketAddr> {
    let mut out = HashMap::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(table) {
            parse_table(&text, &mut out);
        }
    }
    out
}

/// The socket inodes open in each of `groups` (process group ids).
#[allow(clippy::disallowed_methods)] // on a blocking thread (`Seen::look`, `look_at`)
fn group_sockets(groups: &HashSet<i32>) -> HashMap<i32, HashSet<u64>> {
    let mut out: HashMap<i32, HashSet<u64>> = HashMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // pgrp is the 3rd field after the command's closing parenthesis.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let pgrp = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(2))
            .and_then(|g| g.parse::<i32>().ok());
        let Some(pgrp) = pgrp.filter(|g| groups.contains(g)) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        let sockets = out.entry(pgrp).or_default();
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let inode = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse().ok());
            if let Some(inode) = inode {
                sockets.insert(inode);
            }
        }
    }
    out
}

/// The addresses process `pid` (with its whole group, when it leads one)
/// listens on over TCP, in port order.
#[allow(clippy::disallowed_methods)] // on a blocking thread (`Seen::look`, `look_at`)
pub(super) fn listeners_of(pid: i32) -> Vec<SocketAddr> {
    let group = resident_supervisor::procfs::stat(pid).map_or(pid, |s| s.pgrp);
    // A process that does not lead its group is looked at alone: its group
    // may hold unrelated processes (a shell's job).
    let sockets = if group == pid {
        group_sockets(&HashSet::from([pid])).remove(&pid)
    } else {
        process_sockets(pid)
    };
    let listening = listening();
    let mut out: Vec<SocketAddr> = sockets
        .unwrap_or_default()
        .iter()
        .filter_map(|i| listening.get(i).copied())
        .collect();
    out.sort_by_key(|a| (a.port(), a.ip()));
    out.dedup();
    out
}

/// The socket inodes open in process `pid`.
#[allow(clippy::disallowed_methods)] // on a blocking thread (`Seen::look`, `look_at`)
fn process_sockets(pid: i32) -> Option<HashSet<u64>> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    let inodes = fds
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|t| {
            t.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect();
    Some(inodes)
}

/// What the guard saw at its last look (a room of its own: only the
/// guard reads or writes it): the listeners beyond loopback and the runs
/// it checked. While neither changes there is nothing new to find, so a
/// node whose only such listeners are foreign (sshd on 0.0.0.0:22) reads
/// the two TCP tables a second and walks /proc only when a listener
/// beyond loopback, or a guarded run, appears.
#[derive(Debug, Default)]
pub(super) struct Seen {
    beyond: HashSet<u64>,
    runs: HashSet<(String, u64)>,
}

/// One exposure found: the run, and the address it listens on.
#[derive(Debug)]
pub(super) struct Exposed {
    /// The run.
    pub guarded: Guarded,
    /// Where it listens beyond loopback.
    pub addr: SocketAddr,
}

impl Seen {
    /// The guarded runs (each with its process group's leader) that
    /// listen beyond loopback; nothing when nothing changed since the last
    /// look. Reads /proc: runs on a blocking thread.
    #[allow(clippy::disallowed_methods)]
    fn look(&mut self, guarded: Vec<(Guarded, i32)>) -> Vec<Exposed> {
        let listening = listening();
        let beyond: HashSet<u64> = listening
            .iter()
            .filter(|(_, a)| !is_loopback(a.ip()))
            .map(|(i, _)| *i)
            .collect();
        let runs: HashSet<(String, u64)> = guarded
            .iter()
            .map(|(g, _)| (g.id.clone(), g.generation))
            .collect();
        let new_listener = !beyond.is_subset(&self.beyond);
        let new_run = !runs.is_subset(&self.runs);
        self.beyond = beyond.clone();
        self.runs = runs;
        if beyond.is_empty() || !(new_listener || new_run) {
            return Vec::new();
        }
        let groups: HashSet<i32> = guarded.iter().map(|(_, g)| *g).collect();
        let sockets = group_sockets(&groups);
        let mut out = Vec::new();
        for (g, pid) in guarded {
            let inodes = match sockets.get(&pid) {
                Some(inodes) => Some(inodes.clone()),
                // An adopted process that does not lead its group.
                None if g.adopted => process_sockets(pid),
                None => None,
            };
            let exposed = inodes.and_then(|inodes| {
                inodes
                    .iter()
                    .filter(|i| beyond.contains(i))
                    .find_map(|i| listening.get(i).copied())
            });
            if let Some(addr) = exposed {
                // One being stopped is looked at again until it is gone;
                // an adopted one is reported once.
                if !g.adopted {
                    self.runs.remove(&(g.id.clone(), g.generation));
                }
                out.push(Exposed { guarded: g, addr });
            }
        }
        out
    }
}

/// The guard: what it saw at its last look, and the look itself.
#[derive(Debug, Default)]
pub(super) struct Guard {
    seen: Arc<Mutex<Seen>>,
}

impl Guard {
    /// Which of the `guarded` runs (READY, under `expose = "loopback"`,
    /// each with its process group's leader) listen beyond loopback. The
    /// look at /proc runs on a blocking thread, and only when a listener
    /// beyond loopback or a guarded run is new (`Seen`). A run being
    /// stopped is found again at the next look until it is gone; an
    /// adopted one once per run.
    pub async fn look(&self, guarded: Vec<(Guarded, i32)>) -> Vec<Exposed> {
        if guarded.is_empty() {
            return Vec::new();
        }
        let seen = self.seen.clone();
        tokio::task::spawn_blocking(move || seen.lock().look(guarded))
            .await
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_tables_are_read_in_this_machines_byte_order() {
        let v4 = u32::from_ne_bytes([127, 0, 0, 1]);
        let any = u32::from_ne_bytes([0, 0, 0, 0]);
        let text = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: {v4:08X}:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1\n   1: {any:08X}:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1\n   2: {v4:08X}:0051 0100007F:9999 01 00000000:00000000 00:00000000 00000000     0        0 333 1\n"
        );
        let mut out = HashMap::new();
        parse_table(&text, &mut out);
        assert_eq!(out.len(), 2, "only LISTEN sockets");
        assert_eq!(out[&111], "127.0.0.1:8080".parse().expect("addr"));
        assert_eq!(out[&222], "0.0.0.0:80".parse().expect("addr"));
        assert!(is_loopback(out[&111].ip()) && !is_loopback(out[&222].ip()));
        let words = [0u32, 0, 0, 1].map(|w| u32::from_ne_bytes(w.to_be_bytes()));
        let v6 = format!(
            "{:08X}{:08X}{:08X}{:08X}:0050",
            words[0], words[1], words[2], words[3]
        );
        assert_eq!(address(&v6), Some("[::1]:80".parse().expect("addr")));
        let mapped: Ipv6Addr = "::ffff:127.0.0.1".parse().expect("addr");
        assert!(is_loopback(IpAddr::V6(mapped)));
    }

    #[test]
    fn a_listener_of_this_process_is_found_by_its_group() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let group = nix::unistd::getpgrp().as_raw();
        let sockets = group_sockets(&HashSet::from([group]));
        let listening = listening();
        let ours: Vec<&SocketAddr> = sockets[&group]
            .iter()
            .filter_map(|i| listening.get(i))
            .collect();
        assert!(
            ours.iter().any(|a| a.port() == port && is_loopback(a.ip())),
            "{ours:?}"
        );
    }
}
