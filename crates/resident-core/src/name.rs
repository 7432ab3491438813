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
    #[error("{kind} {input:?} is longer than {max} characters")]
    TooLong {
        /// Which name.
        kind: &'static str,
        /// The input.
        input: String,
        /// Its limit.
        max: usize,
    },
    /// A character outside `[A-Za-z0-9._-]`.
    #[error("{kind} {input:?} may only hold letters, digits, '.', '_' and '-' (found {bad:?})")]
    BadChar {
        /// Which name.
        kind: &'static str,
        /// The input.
        input: String,
        /// The first offending character.
        bad: char,
    },
}

fn validate(kind: &'static str, input: &str, max: usize) -> Result<(), NameError> {
    if input.is_empty() {
        return Err(NameError::Empty { kind });
    }
    if input.chars().count() > max {
        return Err(NameError::TooLong {
            kind,
            input: input.to_string(),
            max,
        });
    }
    if let Some(bad) = input
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(NameError::BadChar {
            kind,
            input: input.to_string(),
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
        let role = Role::new("é").expect_err("non-ascii").to_string();
        assert!(role.starts_with("role \"é\""), "{role}");
        assert!(Role::new("r".repeat(65)).is_err());
    }
}
