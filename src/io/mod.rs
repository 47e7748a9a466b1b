//! Output plumbing: atomic file writes, Parquet tables (written, and read back by column name)
//! and shard digests.
pub mod frame;
pub mod integrity;
pub mod parquet;

use crate::{Error, Result};
use std::path::Path;

thread_local! {
    static CONTAINED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f`, turning a panic inside it into an error built by `err` from the panic message.
/// For third-party decoders that can panic on corrupt files (the Parquet reader does); with
/// [`install_panic_filter`] the panic prints nothing, so the error stays the only line.
pub fn contain_panics<T>(
    f: impl FnOnce() -> Result<T>,
    err: impl FnOnce(&str) -> Error,
) -> Result<T> {
    let was = CONTAINED.with(|c| c.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CONTAINED.with(|c| c.set(was));
    r.unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(err(&msg))
    })
}

/// Keep panics inside [`contain_panics`] silent (they become errors); every other panic is
/// reported by the previous hook as before. Call once at start-up.
pub fn install_panic_filter() {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !CONTAINED.with(|c| c.get()) {
            prev(info)
        }
    }));
}

/// A UTC calendar time, to the second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UtcTime {
    /// Year.
    pub year: i64,
    /// Month, 1–12.
    pub month: i64,
    /// Day of the month, 1–31.
    pub day: i64,
    /// Seconds since midnight.
    pub seconds_of_day: i64,
    /// Day of the week, 0 = Sunday.
    pub weekday: i64,
}

impl UtcTime {
    /// The current time (the Unix epoch if the clock is before it).
    pub fn now() -> UtcTime {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        UtcTime::from_unix(secs)
    }

    /// Calendar time of Unix seconds (Howard Hinnant's civil_from_days).
    pub fn from_unix(secs: i64) -> UtcTime {
        let days = secs.div_euclid(86_400);
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        UtcTime {
            year: yoe + era * 400 + i64::from(month <= 2),
            month,
            day,
            seconds_of_day: secs.rem_euclid(86_400),
            // 1970-01-01 was a Thursday.
            weekday: (days + 4).rem_euclid(7),
        }
    }

    /// Unix seconds of an RFC 3339 UTC time as [`UtcTime::rfc3339`] writes it
    /// (`2026-11-29T09:21:11Z`); `None` for anything else.
    pub fn parse_unix(text: &str) -> Option<i64> {
        let b = text.as_bytes();
        let shape = b.len() == 20
            && b[19] == b'Z'
            && [4, 7].iter().all(|&i| b[i] == b'-')
            && b[10] == b'T'
            && [13, 16].iter().all(|&i| b[i] == b':');
        if !shape {
            return None;
        }
        let num = |r: std::ops::Range<usize>| -> Option<i64> {
            let s = text.get(r)?;
            s.bytes()
                .all(|c| c.is_ascii_digit())
                .then(|| s.parse().ok())?
        };
        let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        let (hh, mm, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if !(1..=12).contains(&m) || !(1..=31).contains(&d) || hh > 23 || mm > 59 || ss > 60 {
            return None;
        }
        // Howard Hinnant's days_from_civil, the inverse of `from_unix`.
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        let days = era * 146_097 + doe - 719_468;
        let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
        // A day past the month's end (`02-30`) does not round-trip; refuse it.
        (UtcTime::from_unix(secs).rfc3339() == text).then_some(secs)
    }

    /// RFC 3339, e.g. `2026-11-29T09:21:11Z`.
    pub fn rfc3339(&self) -> String {
        let t = self.seconds_of_day;
        format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            self.year,
            self.month,
            self.day,
            t / 3600,
            t / 60 % 60,
            t % 60
        )
    }
}

/// Lower-case hex of bytes (digests in records, manifests and reports).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Lower-case hex SHA-256 of some bytes.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(bytes))
}

/// Write `bytes` to `path` atomically (temporary file `.<name>.tmp-<pid>` in the same folder,
/// then rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    let written = std::fs::write(&tmp, bytes)
        .map_err(|e| Error::io(&tmp, e))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e)));
    if written.is_err() {
        // A failed write (a full disk) leaves no partial temporary file behind.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Whether `name` is a temporary file of [`write_atomic`] (`.<name>.tmp-<pid>`).
pub fn is_atomic_tmp(name: &str) -> bool {
    name.starts_with('.')
        && name
            .rsplit_once(".tmp-")
            .is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::UtcTime;

    #[test]
    fn a_failed_atomic_write_leaves_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("kvcredit-io-atomic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // The target is a non-empty folder, so the final rename fails.
        std::fs::create_dir_all(dir.join("table.parquet").join("x")).unwrap();
        assert!(super::write_atomic(&dir.join("table.parquet"), b"bytes").is_err());
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["table.parquet"]);
        assert!(super::is_atomic_tmp(".manifest.json.tmp-1234"));
        assert!(!super::is_atomic_tmp("manifest.json"));
        assert!(!super::is_atomic_tmp(".manifest.json.tmp-"));
        assert!(!super::is_atomic_tmp(".tmp-problem-00001-12"));
    }

    #[test]
    fn calendar_dates_of_known_unix_times() {
        let epoch = UtcTime::from_unix(0);
        assert_eq!(
            (epoch.year, epoch.month, epoch.day, epoch.weekday),
            (1970, 1, 1, 4)
        );
        // 2000-02-29 23:59:59 (a leap day, Tuesday), then 2000-03-01 (Wednesday).
        assert_eq!(
            UtcTime::from_unix(951_868_799).rfc3339(),
            "2000-02-29T23:59:59Z"
        );
        let t = UtcTime::from_unix(951_868_800);
        assert_eq!(
            (t.rfc3339().as_str(), t.weekday),
            ("2000-03-01T00:00:00Z", 3)
        );
    }

    #[test]
    fn rfc3339_parses_back_to_unix_seconds() {
        for secs in [0, 951_868_799, 951_868_800, 1_796_000_471] {
            let text = UtcTime::from_unix(secs).rfc3339();
            assert_eq!(UtcTime::parse_unix(&text), Some(secs), "{text}");
        }
        for bad in [
            "2000-02-30T00:00:00Z",
            "2000-13-01T00:00:00Z",
            "2000-01-01 00:00:00Z",
            "2000-01-01T00:00:00",
            "2000-01-01T00:00:00+01:00",
            "20x0-01-01T00:00:00Z",
            "",
        ] {
            assert_eq!(UtcTime::parse_unix(bad), None, "{bad}");
        }
    }
}
