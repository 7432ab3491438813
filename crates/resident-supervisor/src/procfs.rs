//! Reading `/proc`: which processes belong to a process group, and how many
//! resident bytes a group holds. One scan answers for every group at once.
//! Also the clock-tick arithmetic by which a child's start time is known
//! without reading `/proc/PID` (see `child.rs`).

use std::collections::HashMap;
use std::fs;

/// One process as `/proc/PID/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Process id.
    pub pid: i32,
    /// Parent process.
    pub ppid: i32,
    /// Process group.
    pub pgrp: i32,
    /// Single-letter state (`R`, `S`, `Z`, ...).
    pub state: char,
    /// Resident set, in pages.
    pub rss_pages: u64,
    /// Start time after boot, in clock ticks (guards against pid reuse).
    pub start_ticks: u64,
}

/// Parses the text of `/proc/PID/stat`. The command name may contain
/// spaces and parentheses, so fields are counted after the last `)`.
pub fn parse_stat(pid: i32, text: &str) -> Option<ProcStat> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state(0) ppid(1) pgrp(2) ... starttime(19) vsize(20) rss(21)
    Some(ProcStat {
        pid,
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        pgrp: fields.get(2)?.parse().ok()?,
        start_ticks: fields.get(19)?.parse().ok()?,
        rss_pages: fields.get(21)?.parse().ok()?,
    })
}

/// One process, if it exists.
pub fn stat(pid: i32) -> Option<ProcStat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(pid, &text)
}

/// Every live (not zombie) process on the machine.
pub fn scan() -> Vec<ProcStat> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|entry| {
        let pid: i32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        stat(pid)
    })
    .filter(|s| s.state != 'Z' && s.state != 'X')
    .collect()
}

/// Live members of process group `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    scan()
        .into_iter()
        .filter(|s| s.pgrp == pgid)
        .map(|s| s.pid)
        .collect()
}

/// Clock ticks per second (`USER_HZ`), the unit of `/proc`'s times.
pub fn clock_ticks_per_second() -> Option<u64> {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|v| u64::try_from(v).ok())
        .filter(|&hz| hz > 0)
}

/// `ns` of `CLOCK_BOOTTIME` in clock ticks, rounded down as the kernel
/// rounds a process's start time for `/proc/PID/stat`; `None` where a
/// tick is not a whole number of nanoseconds (the kernel rounds those
/// otherwise).
pub fn boottime_ticks(ns: u64) -> Option<u64> {
    let hz = clock_ticks_per_second()?;
    (1_000_000_000 % hz == 0).then(|| ns / (1_000_000_000 / hz))
}

/// The wall-clock time of `ticks` clock ticks after boot (a process's
/// start time, as `/proc/PID/stat` and the journal give it): now, less
/// the time gone by since then on the boot clock. `None` where the clocks
/// cannot be read, or a tick is not a whole number of nanoseconds.
pub fn wall_time_of_ticks(ticks: u64) -> Option<std::time::SystemTime> {
    let hz = clock_ticks_per_second()?;
    let per_tick = (1_000_000_000 % hz == 0).then(|| 1_000_000_000 / hz)?;
    let boot = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME).ok()?;
    let now =
        u64::try_from(boot.tv_sec()).ok()? * 1_000_000_000 + u64::try_from(boot.tv_nsec()).ok()?;
    let since = now.checked_sub(ticks.checked_mul(per_tick)?)?;
    std::time::SystemTime::now().checked_sub(std::time::Duration::from_nanos(since))
}

/// This process's own OOM score adjustment (`oom_score_adj`), if `/proc`
/// says.
pub fn own_oom_score_adj() -> Option<i32> {
    fs::read_to_string("/proc/self/oom_score_adj")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Bytes of a page.
pub fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|v| u64::try_from(v).ok())
        .unwrap_or(4096)
}

/// Resident bytes per process group, summed over each group's members, for
/// the groups asked about. Shared pages count once per process.
pub fn group_rss(pgids: &[i32]) -> HashMap<i32, u64> {
    let page = page_size();
    let mut sums: HashMap<i32, u64> = pgids.iter().map(|p| (*p, 0)).collect();
    for s in scan() {
        if let Some(sum) = sums.get_mut(&s.pgrp) {
            *sum = sum.saturating_add(s.rss_pages.saturating_mul(page));
        }
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_awkward_command_names() {
        let text = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 5555 1000000 250 18446744073709551615";
        let s = parse_stat(4242, text).expect("parses");
        assert_eq!(
            (s.state, s.ppid, s.pgrp, s.start_ticks, s.rss_pages),
            ('S', 1, 4242, 5555, 250)
        );
        assert!(parse_stat(1, "garbage").is_none());
    }

    #[test]
    fn a_start_time_in_ticks_reads_as_the_wall_clock_time_of_the_start() {
        let before = std::time::SystemTime::now();
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("spawn sleep");
        let after = std::time::SystemTime::now();
        let ticks = stat(child.id() as i32).expect("its stat").start_ticks;
        let _ = child.kill();
        let _ = child.wait();
        let started = wall_time_of_ticks(ticks).expect("the clocks read");
        // Within a tick (10 ms at USER_HZ 100) and some slack of the
        // spawn's window.
        let slack = std::time::Duration::from_millis(50);
        assert!(
            started + slack >= before && started <= after + slack,
            "{started:?} not within {before:?}..{after:?}"
        );
    }

    #[test]
    fn finds_itself() {
        let me = std::process::id() as i32;
        let s = stat(me).expect("own stat");
        assert!(s.rss_pages > 0);
        assert!(group_members(s.pgrp).contains(&me));
        assert!(group_rss(&[s.pgrp])[&s.pgrp] >= s.rss_pages * page_size());
    }
}

/// The real and effective uid of `pid` (`Uid:` of `/proc/PID/status`).
pub fn uids(pid: i32) -> Option<(u32, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_uids(&text)
}

/// The real and effective uid in the text of a `/proc/PID/status`.
pub fn parse_uids(text: &str) -> Option<(u32, u32)> {
    let line = text.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let mut ids = line.split_whitespace().map(|n| n.parse::<u32>().ok());
    Some((ids.next()??, ids.next()??))
}

/// A TCP socket listening on a port (`/proc/net/tcp` and `tcp6`): its
/// inode and the uid that opened it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listener {
    pub inode: u64,
    pub uid: u32,
}

/// The TCP sockets listening on `port`, on any local address.
pub fn listening_on(port: u16) -> Vec<Listener> {
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(table) {
            out.extend(parse_listening(&text, port));
        }
    }
    out
}

/// The sockets of a `/proc/net/tcp`-format `text` listening on `port`.
pub fn parse_listening(text: &str, port: u16) -> Vec<Listener> {
    const LISTEN: &str = "0A";
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f.get(1)?.rsplit_once(':')?.1;
            let at = u16::from_str_radix(local_port, 16).ok()?;
            (at == port && *f.get(3)? == LISTEN).then_some(())?;
            Some(Listener {
                uid: f.get(7)?.parse().ok()?,
                inode: f.get(9)?.parse().ok()?,
            })
        })
        .collect()
}

/// Whether one of `pids` holds one of `listeners` among its descriptors.
/// Where a process's descriptors cannot be read (an agent without
/// CAP_SYS_PTRACE looking at a child of another user), a listener opened
/// by that process's uid counts as its: weaker, but another user's
/// listener is still told apart.
pub fn holds_listener(pids: &[i32], listeners: &[Listener]) -> bool {
    pids.iter().any(|pid| {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return uids(*pid).is_some_and(|(real, _)| listeners.iter().any(|l| l.uid == real));
        };
        fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).ok().is_some_and(|target| {
                let inode = target
                    .to_str()
                    .and_then(|t| t.strip_prefix("socket:["))
                    .and_then(|t| t.strip_suffix(']'))
                    .and_then(|t| t.parse::<u64>().ok());
                inode.is_some_and(|i| listeners.iter().any(|l| l.inode == i))
            })
        })
    })
}
