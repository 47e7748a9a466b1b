//! Content hashes of the files a run writes and of the model files it reads.
//!
//! A finished run's manifest records the sha256 of each table it wrote (`files_sha256`, file
//! name → hex digest); a shard folder records its tables' digests in [`SHARD_HASHES`]. Readers
//! ([`verify_run`], [`verify_shard_file`]) compare before they parse, so a changed byte is
//! reported as one line naming the file instead of being read as data. Model files are hashed
//! once and the digest cached by path, size and modification time ([`cached_sha256`]).
use crate::io::write_atomic;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// File name → lowercase-hex sha256 of its bytes.
pub type FileHashes = BTreeMap<String, String>;

/// The digests of a shard folder's tables, written beside them.
pub const SHARD_HASHES: &str = "sha256.json";

/// The manifest key that holds a finished run's [`FileHashes`].
pub const MANIFEST_KEY: &str = "files_sha256";

/// sha256 of a file's bytes, lowercase hex (read in 1 MiB chunks).
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let k = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
    }
    Ok(crate::io::hex(&h.finalize()))
}

/// The digests of `names` inside `dir`.
pub fn hash_files<S: AsRef<str>>(dir: &Path, names: &[S]) -> Result<FileHashes> {
    names
        .iter()
        .map(|n| {
            let n = n.as_ref();
            Ok((n.to_string(), sha256_file(&dir.join(n))?))
        })
        .collect()
}

/// Compare each file of `hashes` inside `dir` with its recorded digest; `source` names where
/// the digests were recorded (for the error). The first mismatch or missing file is an
/// [`Error::Integrity`] naming it.
pub fn verify_files(dir: &Path, hashes: &FileHashes, source: &str) -> Result<()> {
    for (name, want) in hashes {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(Error::Integrity(format!(
                "{} is missing ({source} records its sha256)",
                path.display()
            )));
        }
        let got = sha256_file(&path)?;
        if !got.eq_ignore_ascii_case(want) {
            return Err(Error::Integrity(format!(
                "{}: sha256 {}… is not the {}… that {source} records (the file changed after it was written)",
                path.display(),
                &got[..12],
                want.get(..12).unwrap_or(want)
            )));
        }
    }
    Ok(())
}

/// Verify the tables of the run folder `dir` against the digests its `manifest.json` records;
/// returns how many files were verified (0 for a run that records none: unfinished, written
/// before digests were recorded, or without a manifest, which the reader then reports).
pub fn verify_run(dir: &Path) -> Result<usize> {
    let path = dir.join("manifest.json");
    if !path.is_file() {
        return Ok(0);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Output(format!("{}: {e}", path.display())))?;
    let hashes: FileHashes = match value.get(MANIFEST_KEY) {
        None | Some(serde_json::Value::Null) => return Ok(0),
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|e| Error::Integrity(format!("{}: `{MANIFEST_KEY}`: {e}", path.display())))?,
    };
    verify_files(dir, &hashes, &path.display().to_string())?;
    Ok(hashes.len())
}

/// Write the digests of `names` (inside `dir`) to `dir/`[`SHARD_HASHES`].
pub fn record_shard(dir: &Path, names: &[String]) -> Result<()> {
    let hashes = hash_files(dir, names)?;
    let text = serde_json::to_string_pretty(&hashes).map_err(|e| Error::Output(e.to_string()))?;
    write_atomic(&dir.join(SHARD_HASHES), text.as_bytes())
}

/// Verify file `name` of shard folder `dir` against its [`SHARD_HASHES`] entry. A shard
/// written before digests were recorded (no [`SHARD_HASHES`]) passes; one whose digest file
/// exists but does not list `name` does not.
pub fn verify_shard_file(dir: &Path, name: &str) -> Result<()> {
    let path = dir.join(SHARD_HASHES);
    if !path.exists() {
        return Ok(());
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let hashes: FileHashes = serde_json::from_str(&text)
        .map_err(|e| Error::Integrity(format!("{}: {e}", path.display())))?;
    let Some(want) = hashes.get(name) else {
        return Err(Error::Integrity(format!(
            "{}: no sha256 for {name}",
            path.display()
        )));
    };
    let one = FileHashes::from([(name.to_string(), want.clone())]);
    verify_files(dir, &one, &path.display().to_string())
}

/// A model file's digest as cached: valid while the file keeps its path, size and mtime.
#[derive(Debug, Serialize, Deserialize)]
struct CachedHash {
    path: PathBuf,
    size: u64,
    mtime_ns: u128,
    sha256: String,
}

/// sha256 of the file at `path`, cached in `cache_dir` (one small JSON file per path) and
/// recomputed whenever the file's size or modification time differs from the cached entry's.
/// Without a cache folder (or when it cannot be written) the file is hashed every time.
pub fn cached_sha256(path: &Path, cache_dir: Option<&Path>) -> Result<String> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    let mtime_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let entry = cache_dir.map(|d| cache_entry(path, d));
    if let Some(e) = &entry
        && let Ok(text) = std::fs::read_to_string(e)
        && let Ok(c) = serde_json::from_str::<CachedHash>(&text)
        && c.path == abs
        && c.size == meta.len()
        && c.mtime_ns == mtime_ns
    {
        return Ok(c.sha256);
    }
    let sha256 = sha256_file(path)?;
    if let Some(e) = &entry {
        let c = CachedHash {
            path: abs,
            size: meta.len(),
            mtime_ns,
            sha256: sha256.clone(),
        };
        if let Ok(text) = serde_json::to_string(&c) {
            // A cache that cannot be written only costs a re-hash next time.
            let _ = write_atomic(e, text.as_bytes());
        }
    }
    Ok(sha256)
}

/// Drop the cached digest of `path` (so the next [`cached_sha256`] hashes the bytes).
pub fn forget_cached(path: &Path, cache_dir: &Path) -> Result<()> {
    let entry = cache_entry(path, cache_dir);
    match std::fs::remove_file(&entry) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(&entry, e)),
        _ => Ok(()),
    }
}

fn cache_entry(path: &Path, cache_dir: &Path) -> PathBuf {
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let key = crate::io::hex(&Sha256::digest(abs.to_string_lossy().as_bytes()));
    cache_dir.join(format!("{}.json", &key[..32]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("kvcredit-integrity-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_changed_byte_fails_verification_naming_the_file() {
        let d = scratch("files");
        std::fs::write(d.join("a.parquet"), b"abcdef").unwrap();
        let hashes = hash_files(&d, &["a.parquet"]).unwrap();
        assert_eq!(
            hashes["a.parquet"],
            "bef57ec7f53a6d40beb640a780a639c83bc29ac8a9816f1fc6c5c6dcd93c4721"
        );
        verify_files(&d, &hashes, "m").unwrap();
        std::fs::write(d.join("a.parquet"), b"abcdeF").unwrap();
        let e = verify_files(&d, &hashes, "m").unwrap_err().to_string();
        assert!(
            e.starts_with("integrity: ") && e.contains("a.parquet"),
            "{e}"
        );
        std::fs::remove_file(d.join("a.parquet")).unwrap();
        let e = verify_files(&d, &hashes, "m").unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
    }

    #[test]
    fn shard_digests_are_checked_when_recorded() {
        let d = scratch("shard");
        std::fs::write(d.join("t.parquet"), b"123").unwrap();
        // No digest file: an older shard, read as before.
        verify_shard_file(&d, "t.parquet").unwrap();
        record_shard(&d, &["t.parquet".to_string()]).unwrap();
        verify_shard_file(&d, "t.parquet").unwrap();
        assert!(verify_shard_file(&d, "other.parquet").is_err());
        std::fs::write(d.join("t.parquet"), b"124").unwrap();
        assert!(verify_shard_file(&d, "t.parquet").is_err());
    }

    #[test]
    fn the_cached_digest_follows_size_and_mtime() {
        let d = scratch("cache");
        let f = d.join("m.gguf");
        std::fs::write(&f, b"weights").unwrap();
        let cache = d.join("cache");
        let first = cached_sha256(&f, Some(&cache)).unwrap();
        assert_eq!(first, sha256_file(&f).unwrap());
        assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);
        // Same size, new mtime: the cache entry is stale and the new bytes are hashed.
        std::fs::write(&f, b"weightz").unwrap();
        let t = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(t)
            .unwrap();
        let second = cached_sha256(&f, Some(&cache)).unwrap();
        assert_ne!(first, second);
        assert_eq!(second, sha256_file(&f).unwrap());
        // A planted entry with the file's size and mtime is what the cache returns (so the
        // cache is read, not bypassed).
        let entry = std::fs::read_dir(&cache)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let text = std::fs::read_to_string(&entry).unwrap();
        std::fs::write(&entry, text.replace(&second, &"0".repeat(64))).unwrap();
        assert_eq!(cached_sha256(&f, Some(&cache)).unwrap(), "0".repeat(64));
    }
}
