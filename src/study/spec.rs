//! Loading a study's spec file: read it, parse its TOML (every study's spec denies unknown
//! keys), validate it, and hash its bytes — all before the study writes anything.
use crate::{Error, Result};
use serde::de::DeserializeOwned;
use std::path::Path;

/// A study's spec as read from a TOML file.
pub trait StudySpec: DeserializeOwned {
    /// Resolve paths the spec names relative to the spec file's folder `dir`.
    fn resolve_paths(&mut self, _dir: &Path) {}

    /// Every check the spec must pass before a run starts; `text` is the file as read (for
    /// checks on which keys were written out).
    fn validate_loaded(&self, text: &str) -> Result<()>;

    /// The error of a file that does not parse, `message` naming the file and line.
    fn parse_error(message: String) -> Error {
        Error::Spec(message)
    }
}

/// The spec at `path`, validated, and the SHA-256 of its bytes (the `spec_sha256` of the
/// run's manifest). A parse error is one line naming the file.
pub fn load_spec<S: StudySpec>(path: &Path) -> Result<(S, String)> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut spec: S = toml::from_str(&text).map_err(|e| {
        let line = e
            .span()
            .map(|s| format!("line {}: ", text[..s.start].matches('\n').count() + 1))
            .unwrap_or_default();
        S::parse_error(format!(
            "{}: {line}{}",
            path.display(),
            e.message().trim().replace('\n', " ")
        ))
    })?;
    if let Some(dir) = path.parent() {
        spec.resolve_paths(dir);
    }
    spec.validate_loaded(&text)?;
    Ok((spec, crate::io::sha256_hex(text.as_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Tiny {
        n: usize,
    }

    impl StudySpec for Tiny {
        fn validate_loaded(&self, _: &str) -> Result<()> {
            if self.n == 0 {
                return Err(Error::Spec("n must be positive".into()));
            }
            Ok(())
        }
    }

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kvcredit-study-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn loads_validates_and_hashes_the_bytes() {
        let (s, sha) = load_spec::<Tiny>(&write("ok.toml", "n = 3\n")).unwrap();
        assert_eq!(s.n, 3);
        assert_eq!(sha, crate::io::sha256_hex(b"n = 3\n"));
        let (_, other) = load_spec::<Tiny>(&write("ok2.toml", "n = 3 \n")).unwrap();
        assert_ne!(sha, other, "the hash is of the bytes, not the parsed value");
    }

    #[test]
    fn refuses_unknown_keys_bad_toml_and_invalid_specs_in_one_line() {
        for (name, text, needle) in [
            ("unknown.toml", "n = 3\nm = 4\n", "unknown field `m`"),
            ("broken.toml", "n = \n", "broken.toml"),
            ("zero.toml", "n = 0\n", "n must be positive"),
        ] {
            let e = load_spec::<Tiny>(&write(name, text))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle) && !e.contains('\n'), "{name}: {e}");
        }
    }
}
