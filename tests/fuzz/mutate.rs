//! Mutators: raw bytes (flips, interesting values, truncation, splices), fields at known
//! offsets (length and count fields set to huge values), JSON and TOML values, and text with
//! a dictionary of format tokens.
use super::harness::Rng;

/// Integers that break size arithmetic.
pub const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    16,
    31,
    32,
    255,
    256,
    4096,
    65535,
    65536,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 48,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

/// A value from [`INTERESTING`], or one near `near` (e.g. the input length).
pub fn interesting(rng: &mut Rng, near: u64) -> u64 {
    match rng.below(4) {
        0 => near.wrapping_add(rng.below(3) as u64).wrapping_sub(1),
        1 => rng.u64(),
        _ => *rng.pick(INTERESTING),
    }
}

/// A position, half of the time inside `focus` (e.g. the header) when given.
fn pos(rng: &mut Rng, len: usize, focus: Option<std::ops::Range<usize>>) -> usize {
    match focus {
        Some(r) if !r.is_empty() && r.end <= len && rng.below(2) == 0 => {
            r.start + rng.below(r.len())
        }
        _ => rng.below(len.max(1)),
    }
}

/// One to four byte-level mutations of `input`; `pool` supplies splice material.
pub fn bytes(
    rng: &mut Rng,
    input: &[u8],
    pool: &[Vec<u8>],
    focus: Option<std::ops::Range<usize>>,
) -> Vec<u8> {
    let mut b = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        if b.is_empty() {
            b.push(rng.u64() as u8);
            continue;
        }
        let len = b.len();
        match rng.below(9) {
            0 => {
                let p = pos(rng, len, focus.clone());
                b[p] ^= 1 << rng.below(8);
            }
            1 => {
                let p = pos(rng, len, focus.clone());
                b[p] = *rng.pick(&[0u8, 1, 0x7f, 0x80, 0xfe, 0xff, b'"', b'{', b'\\']);
            }
            2 => b.truncate(rng.below(len)),
            3 | 4 => {
                let w = if rng.below(2) == 0 { 4 } else { 8 };
                let p = pos(rng, len, focus.clone());
                let v = interesting(rng, len as u64).to_le_bytes();
                for (i, x) in v.iter().take(w).enumerate() {
                    if p + i < b.len() {
                        b[p + i] = *x;
                    }
                }
            }
            5 => {
                // Splice a chunk of another (or the same) input over this one.
                let src = rng.pick(pool);
                if !src.is_empty() {
                    let s = rng.below(src.len());
                    let n = 1 + rng.below((src.len() - s).min(64));
                    let p = pos(rng, len, focus.clone());
                    for i in 0..n {
                        if p + i < b.len() {
                            b[p + i] = src[s + i];
                        }
                    }
                }
            }
            6 => {
                let p = pos(rng, len, focus.clone());
                let n = 1 + rng.below((len - p).min(64));
                b.drain(p..p + n);
            }
            7 => {
                let p = pos(rng, len, focus.clone());
                let n = 1 + rng.below((len - p).min(64));
                let chunk = b[p..p + n].to_vec();
                let at = rng.below(len);
                b.splice(at..at, chunk);
            }
            _ => {
                let p = pos(rng, len, focus.clone());
                b.splice(p..p, (0..1 + rng.below(16)).map(|_| rng.u64() as u8));
            }
        }
    }
    b
}

/// Overwrite one of the little-endian integer fields `(offset, width)` of `input` with an
/// interesting value.
pub fn field(rng: &mut Rng, input: &[u8], fields: &[(usize, usize)]) -> Vec<u8> {
    let mut b = input.to_vec();
    if fields.is_empty() {
        return b;
    }
    let &(off, w) = rng.pick(fields);
    let v = interesting(rng, input.len() as u64).to_le_bytes();
    b[off..off + w].copy_from_slice(&v[..w]);
    b
}

/// A JSON value that tends to break consumers.
pub fn json_edge(rng: &mut Rng) -> serde_json::Value {
    use serde_json::json;
    match rng.below(12) {
        0 => json!(null),
        1 => json!(true),
        2 => json!(-1),
        3 => json!(0),
        4 => json!(interesting(rng, 0)),
        5 => json!(-(interesting(rng, 0) as i64).abs()),
        6 => json!(1e300),
        7 => json!(-0.5),
        8 => json!(""),
        9 => json!("default"),
        10 => json!([]),
        _ => json!({}),
    }
}

/// Replace, remove or retype one value somewhere inside a JSON document.
pub fn json(rng: &mut Rng, v: &mut serde_json::Value) {
    use serde_json::Value as J;
    // Walk down a random path; at each level stop with probability 1/3.
    let stop = rng.one_in(3);
    match v {
        J::Object(o) if !o.is_empty() && !stop => {
            let keys: Vec<String> = o.keys().cloned().collect();
            let k = rng.pick(&keys).clone();
            if rng.one_in(6) {
                o.remove(&k);
            } else {
                json(rng, o.get_mut(&k).expect("key present"));
            }
        }
        J::Array(a) if !a.is_empty() && !stop => {
            let i = rng.below(a.len());
            match rng.below(8) {
                0 => {
                    a.remove(i);
                }
                1 => {
                    let dup = a[i].clone();
                    a.insert(i, dup);
                }
                _ => json(rng, &mut a[i]),
            }
        }
        _ => *v = json_edge(rng),
    }
}

/// A TOML value that tends to break consumers.
pub fn toml_edge(rng: &mut Rng) -> toml::Value {
    use toml::Value as T;
    match rng.below(11) {
        0 => T::Integer(0),
        1 => T::Integer(-1),
        2 => T::Integer(i64::MAX),
        3 => T::Integer(i64::MIN),
        4 => T::Integer(interesting(rng, 0) as i64),
        5 => T::Float(f64::NAN),
        6 => T::Float(f64::INFINITY),
        7 => T::Float(-1e-300),
        8 => T::String(String::new()),
        9 => T::Boolean(true),
        _ => T::Array(vec![]),
    }
}

/// Replace, remove or retype one value somewhere inside a TOML document.
pub fn toml(rng: &mut Rng, v: &mut toml::Value) {
    use toml::Value as T;
    let stop = rng.one_in(3);
    match v {
        T::Table(t) if !t.is_empty() && !stop => {
            let keys: Vec<String> = t.keys().cloned().collect();
            let k = rng.pick(&keys).clone();
            if rng.one_in(6) {
                t.remove(&k);
            } else {
                toml(rng, t.get_mut(&k).expect("key present"));
            }
        }
        T::Array(a) if !a.is_empty() && !stop => {
            let i = rng.below(a.len());
            toml(rng, &mut a[i]);
        }
        _ => *v = toml_edge(rng),
    }
}

/// Text mutations: byte-level ones (kept only when still UTF-8, else lossily repaired), or
/// insert / replace with a token from `dict`.
pub fn text(rng: &mut Rng, input: &str, pool: &[Vec<u8>], dict: &[&str]) -> String {
    let mut s = input.to_string();
    for _ in 0..1 + rng.below(3) {
        if rng.below(3) == 0 || s.is_empty() {
            let b = bytes(rng, s.as_bytes(), pool, None);
            s = String::from_utf8_lossy(&b).into_owned();
            continue;
        }
        let boundaries: Vec<usize> = (0..=s.len()).filter(|&i| s.is_char_boundary(i)).collect();
        let a = *rng.pick(&boundaries);
        let tok = *rng.pick(dict);
        if rng.below(2) == 0 {
            s.insert_str(a, tok);
        } else {
            let ends: Vec<usize> = boundaries.iter().copied().filter(|&e| e >= a).collect();
            let e = ends[rng.below(ends.len().min(24))];
            s.replace_range(a..e, tok);
        }
    }
    s
}
