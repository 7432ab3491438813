//! The walls between the agent's rooms, checked on the source: no file
//! under `agent/` but `mod.rs` names the coordinator type `Agent`, and
//! the rooms' uses of each other (`super::room`, or `super::super::room`
//! from a room's own folder) form no circle, and a room built on the
//! parts (`Room::new(&Parts, ..)`) keeps its fields to itself. So too,
//! no circle, for the modules of every crate of the workspace
//! (`crate::module`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, with the room it belongs to (its stem,
/// or its folder's name).
#[allow(
    clippy::disallowed_methods,
    reason = "a test reading the source, not the runtime"
)]
fn files(dir: &Path, room: Option<&str>, out: &mut Vec<(String, PathBuf)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read agent/")
        .map(|e| e.expect("an entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let stem = path.file_stem().map(|s| s.to_string_lossy().to_string());
        let stem = stem.expect("a file name");
        if path.is_dir() {
            files(&path, Some(room.unwrap_or(&stem)), out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push((room.unwrap_or(&stem).to_string(), path));
        }
    }
}

/// The code of a file: each line cut at its comment (`//`).
#[allow(
    clippy::disallowed_methods,
    reason = "a test reading the source, not the runtime"
)]
fn code(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("read a source file");
    text.lines()
        .map(|l| l.split("//").next().unwrap_or("").to_string())
        .collect()
}

/// Whether `line` holds `word` as a whole identifier.
fn names(line: &str, word: &str) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    line.match_indices(word).any(|(at, _)| {
        let before = line[..at].chars().next_back();
        let after = line[at + word.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

/// The rooms each room uses: `from -> {to}`, where a use is `prefix`
/// and the room's name (`crate::` for a crate's modules), or, with no
/// prefix, `super::` from a file of `top` and `super::super::` from a
/// file in a room's own folder.
fn uses(
    all: &[(String, PathBuf)],
    rooms: &BTreeSet<String>,
    top: &Path,
    prefix: Option<&str>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (room, path) in all {
        let nested = path.parent() != Some(top);
        let prefix = match prefix {
            Some(p) => p,
            None if nested => "super::super::",
            None => "super::",
        };
        for line in code(path) {
            for (at, _) in line.match_indices(prefix) {
                let rest = &line[at + prefix.len()..];
                let to: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let roots = ["mod", "lib", "main"];
                if rooms.contains(&to) && &to != room && !roots.contains(&room.as_str()) {
                    graph.entry(room.clone()).or_default().insert(to);
                }
            }
        }
    }
    graph
}

/// A circle in `graph`, if there is one.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        at: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == at) {
            let mut found = path[i..].to_vec();
            found.push(at.to_string());
            return Some(found);
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.to_string());
        for next in graph.get(at).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(at.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|room| visit(room, graph, &mut Vec::new(), &mut done))
}

fn agent_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/agent")
}

fn agent_files() -> Vec<(String, PathBuf)> {
    let mut all = Vec::new();
    files(&agent_dir(), None, &mut all);
    assert!(all.len() >= 20, "agent/ read: {} files", all.len());
    all
}

#[test]
fn no_room_names_the_coordinator() {
    let mut named = Vec::new();
    for (room, path) in agent_files() {
        // The coordinator itself, and this check, which names it.
        if room == "mod" || room == "walls" {
            continue;
        }
        for (n, line) in code(&path).iter().enumerate() {
            if names(line, "Agent") {
                named.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        named.is_empty(),
        "rooms that name the coordinator:\n{}",
        named.join("\n")
    );
}

/// The rooms built on the parts, each with the fields of its struct
/// that others could reach (`pub` of any kind).
fn open_fields(all: &[(String, PathBuf)]) -> Vec<(String, Vec<String>)> {
    let mut rooms = Vec::new();
    for (room, path) in all {
        if room == "walls" {
            continue;
        }
        let lines = code(path);
        let text = lines.join("\n");
        let on_parts = |i: &usize| text[i + 7..].trim_start().starts_with("p: &Parts");
        let Some(at) = text.match_indices("fn new(").map(|(i, _)| i).find(on_parts) else {
            continue;
        };
        let name = text[..at]
            .rfind("impl ")
            .map(|i| &text[i + 5..])
            .and_then(|t| t.split_whitespace().next())
            .expect("the impl of a new(&Parts)")
            .to_string();
        let open = format!("struct {name} {{");
        let start = lines
            .iter()
            .position(|l| l.contains(&open))
            .unwrap_or_else(|| panic!("{}: no {open}", path.display()));
        let fields: Vec<String> = lines[start + 1..]
            .iter()
            .take_while(|l| l.trim() != "}")
            .filter(|l| l.trim_start().starts_with("pub"))
            .map(|l| l.trim().to_string())
            .collect();
        rooms.push((name, fields));
    }
    rooms
}

#[test]
fn a_room_keeps_its_fields_to_itself() {
    let rooms = open_fields(&agent_files());
    // The check sees the rooms: the teller, the stopper, the admissions.
    let names: Vec<&str> = rooms.iter().map(|(n, _)| n.as_str()).collect();
    for room in ["Teller", "Stopper", "Admissions"] {
        assert!(names.contains(&room), "{names:?}");
    }
    let open: Vec<_> = rooms.iter().filter(|(_, f)| !f.is_empty()).collect();
    assert!(open.is_empty(), "fields others can reach: {open:?}");
}

#[test]
fn the_rooms_use_each_other_one_way() {
    let all = agent_files();
    let rooms: BTreeSet<String> = all.iter().map(|(r, _)| r.clone()).collect();
    let graph = uses(&all, &rooms, &agent_dir(), None);
    // The check sees the rooms' uses: the admissions use the stopper.
    assert!(
        graph.get("admission").is_some_and(|u| u.contains("stop")),
        "{graph:?}"
    );
    assert_eq!(circle(&graph), None, "the rooms' uses: {graph:?}");
}

#[test]
#[allow(
    clippy::disallowed_methods,
    reason = "a test reading the source, not the runtime"
)]
fn no_crate_s_modules_use_each_other_in_a_circle() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut seen = 0;
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)
        .expect("read crates/")
        .map(|e| e.expect("an entry").path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for src in dirs {
        let mut all = Vec::new();
        files(&src, None, &mut all);
        let modules: BTreeSet<String> = all.iter().map(|(r, _)| r.clone()).collect();
        let graph = uses(&all, &modules, &src, Some("crate::"));
        seen += graph.values().map(BTreeSet::len).sum::<usize>();
        assert_eq!(circle(&graph), None, "{}: {graph:?}", src.display());
    }
    // The check sees the uses: residentd's, the supervisor's, the core's.
    assert!(seen >= 50, "{seen} uses between modules");
}

#[test]
fn a_circle_is_found() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    let found = circle(&graph).expect("a circle");
    assert_eq!(found.first(), found.last());
    assert_eq!(found.len(), 4);
    let mut line = graph.clone();
    line.get_mut("c").expect("c").clear();
    assert_eq!(circle(&line), None);
}
