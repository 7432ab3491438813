//! A configuration error that names the file, the line and the key.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// What is wrong with a configuration, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The file.
    pub file: PathBuf,
    /// The line (from 1), when known.
    pub line: Option<usize>,
    /// The key, as a dotted path (`workload[coder].memory.gpu0.weights`).
    pub key: String,
    /// What is wrong.
    pub message: String,
    /// Further errors found in the same file, by line (every one the
    /// checks could reach: a fresh node's config is fixed in one round).
    pub also: Vec<ConfigError>,
}

impl ConfigError {
    /// An error of `file` with no line: the file as a whole.
    pub fn of_file(file: &Path, key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            file: file.to_path_buf(),
            line: None,
            key: key.into(),
            message: message.into(),
            also: Vec::new(),
        }
    }

    /// `errors` (at least one) as one error: the first by line, the rest
    /// in `also`; `Ok` when there is none.
    pub fn all(errors: Vec<ConfigError>) -> Result<(), ConfigError> {
        let mut flat: Vec<ConfigError> = errors
            .into_iter()
            .flat_map(|mut e| {
                let also = std::mem::take(&mut e.also);
                std::iter::once(e).chain(also)
            })
            .collect();
        flat.sort_by_key(|e| e.line);
        let mut rest = flat.into_iter();
        match rest.next() {
            None => Ok(()),
            Some(mut first) => {
                first.also = rest.collect();
                Err(first)
            }
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if !self.key.is_empty() {
            write!(f, ": {}", self.key)?;
        }
        write!(f, ": {}", self.message)?;
        for e in &self.also {
            write!(f, "\n{e}")?;
        }
        Ok(())
    }
}

/// The source being validated, to turn spans into lines.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Source<'a> {
    pub(crate) file: &'a Path,
    pub(crate) text: &'a str,
}

impl Source<'_> {
    pub(crate) fn line_of(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end]
            .iter()
            .filter(|b| **b == b'\n')
            .count()
            + 1
    }

    /// An error at `span` about `key`.
    pub(crate) fn err(
        &self,
        span: Range<usize>,
        key: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError {
            file: self.file.to_path_buf(),
            line: Some(self.line_of(span.start)),
            key: key.into(),
            message: message.into(),
            also: Vec::new(),
        }
    }
}
