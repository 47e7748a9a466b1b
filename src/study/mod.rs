//! The runtime the studies (credit campaigns, divergence studies, SpectrumKV grids) run on:
//! spec loading ([`spec`]), JSON manifests headed by one
//! [`RunHeader`](header::RunHeader), atomic per-unit shards, resume, merge,
//! progress ([`progress`]) and device synchronization.
//!
//! A run folder holds `manifest.json` and `shards/<unit>/` folders; a shard is written in a
//! temporary folder and renamed into place, so a shard that exists is complete, and a rerun
//! skips it; its tables' digests ([`crate::io::integrity::SHARD_HASHES`]) are verified before
//! they are merged. Leftover temporary folders of an interrupted run are removed on the next start.
pub mod bounds;
pub mod header;
pub mod progress;
pub mod spec;

use crate::io::integrity::{FileHashes, hash_files, record_shard, verify_shard_file};
use crate::io::parquet::{Table, concat_files};
use crate::io::write_atomic;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// UTC now as RFC 3339 (seconds).
pub fn now_rfc3339() -> String {
    crate::io::UtcTime::now().rfc3339()
}

/// Write `value` as pretty JSON, atomically.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Output(e.to_string()))?;
    write_atomic(path, text.as_bytes())
}

/// Read a JSON file written by [`write_json`].
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Output(format!("{}: {e}", path.display())))
}

pub use crate::runtime::sync;

/// The lock file of a run folder.
pub const LOCK: &str = ".kvcredit.lock";

/// Exclusive use of a run folder by this process, held until dropped (or the process ends:
/// the operating system releases the lock of a killed process, so a stale lock file is taken
/// over).
#[derive(Debug)]
pub struct RunLock {
    _file: std::fs::File,
}

/// Lock the run folder `out` (created if missing) for this process; refused, naming the
/// holder's pid, while another process holds it. Once locked, temporary files that an
/// interrupted write left in `out` (`.<name>.tmp-<pid>`) are removed.
pub fn lock_run(out: &Path) -> Result<RunLock> {
    use std::io::{Read, Seek, Write};
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let path = out.join(LOCK);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io(&path, e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(Error::Spec(format!(
                "{} is in use by another kvcredit process (pid {}); wait for it to finish or use another --out",
                out.display(),
                if holder.is_empty() { "unknown" } else { holder }
            )));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(Error::io(&path, e)),
    }
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()))
        .map_err(|e| Error::io(&path, e))?;
    for entry in std::fs::read_dir(out)
        .map_err(|e| Error::io(out, e))?
        .flatten()
    {
        if crate::io::is_atomic_tmp(&entry.file_name().to_string_lossy()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(RunLock { _file: file })
}

/// The `shards/` folder of a run, created if missing, with leftovers of interrupted shard
/// writes (`.tmp-*`) removed.
pub fn prepare_shards(out: &Path) -> Result<PathBuf> {
    prepare_dir(&out.join("shards"))
}

/// A folder of shards, created if missing, with leftovers of interrupted shard writes
/// (`.tmp-*`) removed.
pub fn prepare_dir(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    for entry in std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .flatten()
    {
        if entry.file_name().to_string_lossy().starts_with(".tmp-") {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    Ok(dir.to_path_buf())
}

/// Write `tables` (as `<name>.parquet`), their digests (as
/// [`crate::io::integrity::SHARD_HASHES`]) and `info` (as
/// `shard.json`) into `dir` atomically: into a temporary sibling first, then one rename.
pub fn commit_shard<T: Serialize>(dir: &Path, tables: &[(&str, &Table)], info: &T) -> Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = parent.join(format!(".tmp-{name}-{}", std::process::id()));
    let written = std::fs::create_dir_all(&tmp)
        .map_err(|e| Error::io(&tmp, e))
        .and_then(|()| {
            let mut files = Vec::with_capacity(tables.len());
            for (table_name, table) in tables {
                let file = format!("{table_name}.parquet");
                table.write(&tmp.join(&file))?;
                files.push(file);
            }
            record_shard(&tmp, &files)?;
            write_json(&tmp.join("shard.json"), info)?;
            std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))
        });
    if written.is_err() {
        // An abandoned shard leaves nothing behind; finished shards and the manifest stay.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}

/// Merge table `name` of the given shard folders (in order) into `out/<name>.parquet`, each
/// shard's file verified against its recorded digest first.
pub fn merge_table(shards: &[PathBuf], name: &str, out: &Path) -> Result<()> {
    let file = format!("{name}.parquet");
    for d in shards {
        verify_shard_file(d, &file)?;
    }
    let files: Vec<PathBuf> = shards.iter().map(|d| d.join(&file)).collect();
    concat_files(&files, &out.join(file))
}

/// The digests of the tables `names` (file stems) in the run folder `out`, for its manifest.
pub fn table_hashes(out: &Path, names: &[&str]) -> Result<FileHashes> {
    let files: Vec<String> = names.iter().map(|n| format!("{n}.parquet")).collect();
    hash_files(out, &files)
}
