//! The one table the harness prints: each row residentd's figure, the
//! floor's and supervisord's where there is one, and the ratios.

use std::time::Duration;

/// A figure in its unit.
#[derive(Debug, Clone, Copy)]
enum Value {
    Time(Duration),
    Rate(f64),
    Fraction(f64),
    Bytes(u64),
}

impl Value {
    fn number(self) -> f64 {
        match self {
            Self::Time(d) => d.as_secs_f64(),
            Self::Rate(r) | Self::Fraction(r) => r,
            Self::Bytes(b) => b as f64,
        }
    }

    fn text(self) -> String {
        match self {
            Self::Time(d) => duration(d),
            Self::Rate(r) => format!("{r:.0}/s"),
            Self::Fraction(f) => format!("{:.3}%", f * 100.0),
            Self::Bytes(b) => format!("{:.1} MB", b as f64 / 1e6),
        }
    }
}

/// A duration with a unit that suits it.
pub fn duration(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.0} µs")
    } else {
        format!("{:.2} ms", us / 1000.0)
    }
}

/// One line of the table.
#[derive(Debug)]
pub struct Row {
    name: String,
    ours: Option<Value>,
    floor: Option<Value>,
    peer: Option<Value>,
    target: String,
    note: Option<String>,
    /// A hard target this row missed (a count that must be zero): the run
    /// fails.
    missed: Option<String>,
}

impl Row {
    fn new(
        name: String,
        ours: Value,
        floor: Option<Value>,
        peer: Option<Value>,
        target: &str,
    ) -> Self {
        Self {
            name,
            ours: Some(ours),
            floor,
            peer,
            target: target.into(),
            note: None,
            missed: None,
        }
    }

    /// A count whose target is zero (restarts, failures): one above it
    /// makes the run fail, not only print.
    pub fn must_be_zero(name: String, count: u64) -> Self {
        Self {
            missed: (count > 0).then(|| format!("{name}: {count}, target 0")),
            name,
            ours: None,
            floor: None,
            peer: None,
            target: String::new(),
            note: Some(format!("{count} (target 0)")),
        }
    }

    /// A time against the floor and, where measured, supervisord.
    pub fn latency(
        name: String,
        ours: Duration,
        floor: Duration,
        peer: Option<Duration>,
        target: &str,
    ) -> Self {
        let t = Value::Time;
        Self::new(name, t(ours), Some(t(floor)), peer.map(t), target)
    }

    /// A rate against the floor.
    pub fn rate(name: String, ours: f64, floor: f64, target: &str) -> Self {
        Self::new(
            name,
            Value::Rate(ours),
            Some(Value::Rate(floor)),
            None,
            target,
        )
    }

    /// A time against supervisord only.
    pub fn peer_latency(name: &str, ours: Duration, peer: Option<Duration>, target: &str) -> Self {
        Self::new(
            name.into(),
            Value::Time(ours),
            None,
            peer.map(Value::Time),
            target,
        )
    }

    /// A fraction of a core against supervisord.
    pub fn fraction(name: String, ours: f64, peer: Option<f64>, target: &str) -> Self {
        Self::new(
            name,
            Value::Fraction(ours),
            None,
            peer.map(Value::Fraction),
            target,
        )
    }

    /// Bytes against supervisord.
    pub fn bytes(name: String, ours: u64, peer: Option<u64>, target: &str) -> Self {
        Self::new(
            name,
            Value::Bytes(ours),
            None,
            peer.map(Value::Bytes),
            target,
        )
    }

    /// A line of text.
    pub fn note(name: String, text: String) -> Self {
        Self {
            name,
            ours: None,
            floor: None,
            peer: None,
            target: String::new(),
            note: Some(text),
            missed: None,
        }
    }
}

/// Every row, in the order measured.
#[derive(Debug, Default)]
pub struct Table {
    rows: Vec<Row>,
}

/// Two decimals, or two significant digits below 0.01 (a push that waits
/// for a peer's one-second tick against one of a few hundred µs).
fn ratio(ours: Option<Value>, other: Option<Value>) -> String {
    match (ours, other) {
        (Some(a), Some(b)) if b.number() > 0.0 => {
            let r = a.number() / b.number();
            if r > 0.0 && r < 0.01 {
                let decimals = (-r.log10().floor()) as usize + 1;
                format!("{r:.decimals$}x")
            } else {
                format!("{r:.2}x")
            }
        }
        _ => String::new(),
    }
}

fn text(v: Option<Value>) -> String {
    v.map(Value::text).unwrap_or_default()
}

impl Table {
    /// Adds a row.
    pub fn push(&mut self, row: Row) {
        self.rows.push(row);
    }

    /// The hard targets that rows missed.
    pub fn missed(&self) -> Vec<&str> {
        self.rows
            .iter()
            .filter_map(|r| r.missed.as_deref())
            .collect()
    }

    /// Prints the table (Markdown, so it can go into docs/benchmarks.md).
    pub fn print(&self, quick: bool, cores: usize) {
        let kind = if quick {
            "quick smoke run (few iterations; figures mean little)"
        } else {
            "full run"
        };
        println!("residentd benchmarks, {kind}, {cores} cores, one run side by side\n");
        println!("| row | residentd | floor | vs floor | supervisord | vs supervisord | target |");
        println!("|---|---|---|---|---|---|---|");
        for r in &self.rows {
            if let Some(note) = &r.note {
                println!("| {} | {note} | | | | | |", r.name);
                continue;
            }
            println!(
                "| {} | {} | {} | {} | {} | {} | {} |",
                r.name,
                text(r.ours),
                text(r.floor),
                ratio(r.ours, r.floor),
                text(r.peer),
                ratio(r.ours, r.peer),
                r.target
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_above_its_zero_target_fails_the_run_and_zero_does_not() {
        let mut table = Table::default();
        table.push(Row::must_be_zero("restarts".into(), 0));
        table.push(Row::note("a note".into(), "1 (said, not checked)".into()));
        assert!(table.missed().is_empty());
        table.push(Row::must_be_zero("failed requests".into(), 2));
        assert_eq!(table.missed(), ["failed requests: 2, target 0"]);
    }

    #[test]
    fn a_ratio_keeps_two_significant_digits_below_one_hundredth() {
        let check = |a: f64, b: f64, want: &str| {
            let (a, b) = (Value::Rate(a), Value::Rate(b));
            assert_eq!(ratio(Some(a), Some(b)), want, "{a:?} / {b:?}");
        };
        check(261.0, 2660.0, "0.10x");
        check(3.0, 2.0, "1.50x");
        check(318.0, 1_003_050.0, "0.00032x");
        check(5.0, 1000.0, "0.0050x");
        check(0.0, 1.0, "0.00x");
        check(1.0, 0.0, "");
    }
}
