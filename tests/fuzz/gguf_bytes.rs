//! GGUF at the byte level for the fuzzer: the offsets of every integer field of a header
//! (counts, string and array lengths, value and tensor types, dims, offsets), a writer for
//! metadata and tensors, semantic mutations of parsed metadata, and a vocabulary shrinker that
//! turns a real tokenizer file into a small seed.
use super::harness::Rng;
use super::mutate::interesting;
use kvcredit::gguf::{GgufFile, Value};
use std::collections::BTreeMap;

/// `(offset, width)` of little-endian integer fields.
pub type Fields = Vec<(usize, usize)>;

/// Integer fields of a GGUF header, split into structural ones (counts, lengths, types, dims,
/// offsets) and array element values; parsing stops at the first inconsistency.
pub fn fields(b: &[u8]) -> (Fields, Fields) {
    let mut structural = Vec::new();
    let mut elements = Vec::new();
    let mut p = 8usize;
    let rd = |p: usize, w: usize| -> Option<u64> {
        let s = b.get(p..p + w)?;
        let mut a = [0u8; 8];
        a[..w].copy_from_slice(s);
        Some(u64::from_le_bytes(a))
    };
    if b.len() < 24 {
        return (structural, elements);
    }
    structural.push((4, 4));
    let (Some(nt), Some(nkv)) = (rd(8, 8), rd(16, 8)) else {
        return (structural, elements);
    };
    structural.push((8, 8));
    structural.push((16, 8));
    p += 16;
    let width = |t: u64| -> Option<usize> {
        Some(match t {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            _ => return None,
        })
    };
    // A string: length field then bytes.
    let string = |p: &mut usize, out: &mut Vec<(usize, usize)>| -> Option<()> {
        let n = rd(*p, 8)? as usize;
        out.push((*p, 8));
        *p = p.checked_add(8 + n).filter(|&e| e <= b.len())?;
        Some(())
    };
    for _ in 0..nkv.min(1 << 20) {
        if string(&mut p, &mut structural).is_none() {
            return (structural, elements);
        }
        let Some(ty) = rd(p, 4) else {
            return (structural, elements);
        };
        structural.push((p, 4));
        p += 4;
        let ok = match ty {
            8 => string(&mut p, &mut structural),
            9 => (|| {
                let et = rd(p, 4)?;
                structural.push((p, 4));
                let n = rd(p + 4, 8)?;
                structural.push((p + 4, 8));
                p += 12;
                for _ in 0..n.min(1 << 22) {
                    if et == 8 {
                        string(&mut p, &mut elements)?;
                    } else {
                        let w = width(et)?;
                        if p + w > b.len() {
                            return None;
                        }
                        elements.push((p, w));
                        p += w;
                    }
                }
                Some(())
            })(),
            t => width(t).map(|w| {
                if p + w <= b.len() {
                    structural.push((p, w));
                }
                p += w;
            }),
        };
        if ok.is_none() {
            return (structural, elements);
        }
    }
    for _ in 0..nt.min(1 << 20) {
        if string(&mut p, &mut structural).is_none() {
            return (structural, elements);
        }
        let Some(nd) = rd(p, 4) else {
            return (structural, elements);
        };
        structural.push((p, 4));
        p += 4;
        for _ in 0..nd.min(8) {
            if p + 8 > b.len() {
                return (structural, elements);
            }
            structural.push((p, 8));
            p += 8;
        }
        if p + 12 > b.len() {
            return (structural, elements);
        }
        structural.push((p, 4));
        structural.push((p + 4, 8));
        p += 12;
    }
    (structural, elements)
}

/// Mutate one integer field of a GGUF header (structural ones three times as often).
pub fn field_mutation(rng: &mut Rng, b: &[u8]) -> Vec<u8> {
    let (s, e) = fields(b);
    let pool = if e.is_empty() || rng.below(4) > 0 {
        &s
    } else {
        &e
    };
    super::mutate::field(rng, b, pool)
}

/// A parsed GGUF: metadata in order, tensors with their raw bytes.
#[derive(Clone)]
pub struct Parts {
    /// Metadata key/values.
    pub metadata: Vec<(String, Value)>,
    /// (name, dims, ggml type id, raw bytes).
    pub tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

/// Read a GGUF file into [`Parts`].
pub fn read(path: &std::path::Path) -> Parts {
    let g = GgufFile::open(path).expect("seed GGUF opens");
    let metadata = g
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let tensors = g
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dims.clone(),
                t.ggml_type.id(),
                g.read_raw(t).expect("seed tensor"),
            )
        })
        .collect();
    Parts { metadata, tensors }
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => {
            let et = a.first().map(type_id).unwrap_or(8);
            out.extend(et.to_le_bytes());
            out.extend((a.len() as u64).to_le_bytes());
            for x in a {
                put_value(out, x);
            }
        }
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
    }
}

/// Serialize [`Parts`] as GGUF v3 (alignment 32, tensors packed in order).
pub fn write(p: &Parts) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(b"GGUF");
    out.extend(3u32.to_le_bytes());
    out.extend((p.tensors.len() as u64).to_le_bytes());
    out.extend((p.metadata.len() as u64).to_le_bytes());
    for (k, v) in &p.metadata {
        put_str(&mut out, k);
        out.extend(type_id(v).to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0u64;
    for (name, dims, ty, raw) in &p.tensors {
        put_str(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (raw.len() as u64).div_ceil(32) * 32;
    }
    while out.len() % 32 != 0 {
        out.push(0);
    }
    for (_, _, _, raw) in &p.tensors {
        out.extend(raw);
        while out.len() % 32 != 0 {
            out.push(0);
        }
    }
    out
}

/// Token texts that stress tokenizer construction.
const ODD_TOKENS: &[&str] = &[
    "",
    " ",
    "a b",
    "\u{0}",
    "<0xZZ>",
    "<0x41>",
    "\u{2581}",
    "<|im_end|>",
    "<s>",
    "\u{fffd}",
    "ab",
    "a",
];

/// A metadata value that tends to break consumers, of the same kind as `v` or another.
fn edge_value(rng: &mut Rng, v: &Value, n_tokens: u64) -> Value {
    match rng.below(10) {
        0 => Value::U32(interesting(rng, n_tokens) as u32),
        1 => Value::U64(interesting(rng, n_tokens)),
        2 => Value::I32(-1),
        3 => Value::F32(*rng.pick(&[f32::NAN, f32::INFINITY, -1.0, 0.0, 1e30])),
        4 => Value::F64(*rng.pick(&[f64::NAN, -1.0, 0.0, 1e300])),
        5 => Value::Bool(rng.below(2) == 0),
        6 => Value::String(rng.pick(ODD_TOKENS).to_string()),
        7 => Value::Array(vec![]),
        _ => match v {
            Value::String(_) => Value::String(
                rng.pick(&[
                    "llama",
                    "gpt2",
                    "bert",
                    "qwen2",
                    "smollm",
                    "llama-bpe",
                    "default",
                    "none",
                    "linear",
                    "yarn",
                    "gemma3",
                    "mistral",
                ])
                .to_string(),
            ),
            Value::Array(a) if !a.is_empty() => a[rng.below(a.len())].clone(),
            _ => Value::U32(n_tokens as u32),
        },
    }
}

/// Keys worth adding when absent.
const EXTRA_KEYS: &[&str] = &[
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.pre",
    "tokenizer.chat_template",
    "general.alignment",
    "llama.rope.scaling.type",
    "llama.attention.sliding_window",
    "llama.attention.key_length",
];

/// One semantic mutation: a metadata value replaced, retyped, removed or added, an array
/// truncated or given an odd element, or a tensor's dims/type/offset changed.
pub fn semantic(rng: &mut Rng, p: &mut Parts) {
    let n_tokens = p
        .metadata
        .iter()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .and_then(|(_, v)| v.as_array().map(|a| a.len() as u64))
        .unwrap_or(0);
    if !p.tensors.is_empty() && rng.one_in(4) {
        let i = rng.below(p.tensors.len());
        let t = &mut p.tensors[i];
        match rng.below(4) {
            0 if !t.1.is_empty() => {
                let d = rng.below(t.1.len());
                t.1[d] = interesting(rng, t.1[d]);
            }
            1 => t.2 = *rng.pick(&[0, 1, 2, 8, 10, 12, 14, 30, 4, 99]),
            2 => t.1.push(*rng.pick(&[0, 1, 2, 1 << 40])),
            _ => {
                let keep = rng.below(t.3.len() + 1);
                t.3.truncate(keep);
            }
        }
        return;
    }
    if p.metadata.is_empty() || rng.one_in(6) {
        let k = rng.pick(EXTRA_KEYS).to_string();
        let v = edge_value(rng, &Value::U32(0), n_tokens);
        p.metadata.retain(|(x, _)| *x != k);
        p.metadata.push((k, v));
        return;
    }
    let i = rng.below(p.metadata.len());
    if rng.one_in(8) {
        p.metadata.remove(i);
        return;
    }
    let v = &mut p.metadata[i].1;
    match v {
        Value::Array(a) if !a.is_empty() && rng.below(3) > 0 => {
            let j = rng.below(a.len());
            match rng.below(5) {
                0 => a.truncate(j),
                1 => {
                    let x = a[rng.below(a.len())].clone();
                    a[j] = x;
                }
                2 => {
                    a[j] = match &a[j] {
                        Value::String(_) => Value::String(rng.pick(ODD_TOKENS).to_string()),
                        other => edge_value(rng, other, n_tokens),
                    }
                }
                3 => {
                    a.remove(j);
                }
                _ => {
                    let x = a[j].clone();
                    a.push(x);
                }
            }
        }
        _ => {
            let nv = edge_value(rng, v, n_tokens);
            *v = nv;
        }
    }
}

/// Shrink a tokenizer GGUF to its first `keep` tokens (merges whose pieces all survive;
/// special ids past the cut removed) so a fuzz iteration builds a tokenizer in milliseconds.
pub fn shrink_vocab(p: &Parts, keep: usize) -> Parts {
    let mut md: BTreeMap<String, Value> = p.metadata.iter().cloned().collect();
    let tokens: Vec<String> = md["tokenizer.ggml.tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .take(keep)
        .map(|v| v.as_str().expect("string token").to_string())
        .collect();
    let n = tokens.len();
    let set: std::collections::HashSet<&str> = tokens.iter().map(String::as_str).collect();
    for k in ["tokenizer.ggml.scores", "tokenizer.ggml.token_type"] {
        if let Some(Value::Array(a)) = md.get_mut(k) {
            a.truncate(n);
        }
    }
    if let Some(Value::Array(m)) = md.get_mut("tokenizer.ggml.merges") {
        m.retain(|v| {
            let s = v.as_str().unwrap_or("");
            match s.split_once(' ') {
                Some((a, b)) => {
                    set.contains(a) && set.contains(b) && set.contains(format!("{a}{b}").as_str())
                }
                None => false,
            }
        });
    }
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(tokens.iter().cloned().map(Value::String).collect()),
    );
    for k in [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
    ] {
        if md
            .get(k)
            .and_then(Value::as_u64)
            .is_some_and(|i| i as usize >= n)
        {
            md.remove(k);
        }
    }
    Parts {
        metadata: md.into_iter().collect(),
        tensors: p.tensors.clone(),
    }
}
