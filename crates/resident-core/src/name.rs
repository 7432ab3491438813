//! Validated identifiers: roles, pools, workloads, groups and instance ids.
//! Each is a plain token of `[A-Za-z0-9._-]` with a length bound, so that
//! it is safe in a log line, a file name under `state_dir` and a metric label.

use std::borrow::Borrow;
use std::fmt;

/// Why a name was refused. Carries what kind of name and the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Zero characters.
    #[error("{kind} must not be empty")]
    Empty {
        /// Which name ("role", "instance id", ...).
        kind: &'static str,
    },
    /// More characters than the kind allows.
    #[error("{kind} {input} is longer than {max} characters")]
    TooLong {
        /// Which name.
        kind: &'static str,
        /// The input, shortened.
        input: Excerpt,
        /// Its limit.
        max: usize,
    },
    /// A character outside `[A-Za-z0-9._-]`.
    #[error("{kind} {input} may only hold letters, digits, '.', '_' and '-' (found {bad:?})")]
    BadChar {
        /// Which name.
        kind: &'static str,
        /// The input, shortened.
        input: Excerpt,
        /// The first offending character.
        bad: char,
    },
}

/// How a value someone else supplied is quoted in a message: in full
/// when short, else its first [`Excerpt::HEAD`] characters and its length,
/// so that no error, log line or event repeats an unbounded input (a
/// 10,000-character id would overflow a client's metadata limit). Quoted
/// with escapes, so control characters cannot forge a log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Excerpt {
    head: String,
    /// The whole input's length in bytes, when `head` is a part of it.
    cut_from: Option<usize>,
}

impl Excerpt {
    /// Characters kept of a long value.
    pub const HEAD: usize = 32;

    /// The excerpt of `input`.
    pub fn of(input: &str) -> Self {
        match input.char_indices().nth(Self::HEAD) {
            None => Self {
                head: input.to_string(),
                cut_from: None,
            },
            Some((end, _)) => Self {
                head: input[..end].to_string(),
                cut_from: Some(input.len()),
            },
        }
    }
}

impl fmt::Display for Excerpt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.cut_from {
            None => write!(f, "{:?}", self.head),
            Some(len) => {
                let quoted = format!("{:?}", self.head);
                let open = &quoted[..quoted.len() - 1];
                write!(f, "{open}...\" ({len} bytes)")
            }
        }
    }
}

fn validate(kind: &'static str, input: &str, max: usize) -> Result<(), NameError> {
    if input.is_empty() {
        return Err(NameError::Empty { kind });
    }
    if input.chars().count() > max {
        return Err(NameError::TooLong {
            kind,
            input: Excerpt::of(input),
            max,
        });
    }
    if let Some(bad) = input
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(NameError::BadChar {
            kind,
            input: Excerpt::of(input),
            bad,
        });
    }
    Ok(())
}

macro_rules! token {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $max:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            /// The longest accepted value, in characters.
            pub const MAX_LEN: usize = $max;

            /// Validates `s` as this kind of name.
            pub fn new(s: impl Into<String>) -> Result<Self, NameError> {
                let s = s.into();
                validate($kind, &s, $max)?;
                Ok(Self(s))
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<&str> for $name {
            type Error = NameError;
            fn try_from(s: &str) -> Result<Self, NameError> {
                Self::new(s)
            }
        }
    };
}

token!(
    /// What a workload does ("coder-daily", "planner"); exclusions match it.
    Role, "role", 64
);
token!(
    /// A memory pool ("unified", "ram", "gpu0").
    PoolName, "pool name", 64
);
token!(
    /// A workload in the roster.
    WorkloadName, "workload name", 64
);
token!(
    /// A group of workloads.
    GroupName, "group name", 64
);
token!(
    /// One running copy of a workload, client-chosen or generated.
    InstanceId, "instance id", 128
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_tokens_and_names_what_it_refuses() {
        assert!(Role::new("coder-daily").is_ok());
        assert!(InstanceId::new("a".repeat(128)).is_ok());
        let cases: [(Result<InstanceId, NameError>, &str); 4] = [
            (InstanceId::new(""), "instance id must not be empty"),
            (InstanceId::new("x".repeat(129)), "longer than 128"),
            (InstanceId::new("a b"), "found ' '"),
            (InstanceId::new("../etc"), "found '/'"),
        ];
        for (got, want) in cases {
            let text = got.expect_err(want).to_string();
            assert!(text.contains(want), "{text} lacks {want}");
        }
        let long = InstanceId::new("y".repeat(10_000))
            .expect_err("too long")
            .to_string();
        let head = "y".repeat(Excerpt::HEAD);
        assert_eq!(
            long,
            format!("instance id \"{head}...\" (10000 bytes) is longer than 128 characters")
        );
        let bad = InstanceId::new(format!("a\n{}", "z".repeat(5000))).expect_err("bad char");
        assert!(bad.to_string().len() < 200, "{bad}");
        assert!(bad.to_string().contains("\"a\\nzzz"), "escaped: {bad}");
        let role = Role::new("é").expect_err("non-ascii").to_string();
        assert!(role.starts_with("role \"é\""), "{role}");
        assert!(Role::new("r".repeat(65)).is_err());
    }
}
