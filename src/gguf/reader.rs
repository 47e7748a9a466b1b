//! GGUF container parsing: header, metadata key/values and tensor directory (versions 2 and 3,
//! little-endian), with every length and offset checked against the file size so a corrupt or
//! truncated file fails with one [`Error::Gguf`] line instead of a panic or a huge allocation.
//!
//! Format reference: ggml's `docs/gguf.md` and `gguf-py/gguf/gguf_reader.py`.
use super::dequant::{self, GgmlType};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MAGIC: [u8; 4] = *b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Upper bound on tensor rank; ggml's `GGML_MAX_DIMS` is 4.
const MAX_DIMS: u32 = 8;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(x) => Some(x as u64),
            Value::U16(x) => Some(x as u64),
            Value::U32(x) => Some(x as u64),
            Value::U64(x) => Some(x),
            Value::I8(x) => u64::try_from(x).ok(),
            Value::I16(x) => u64::try_from(x).ok(),
            Value::I32(x) => u64::try_from(x).ok(),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        }
    }

    /// The value as a float (integers are widened; `f32` is widened exactly).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(x) => Some(x as f64),
            Value::F64(x) => Some(x),
            _ => self.as_u64().map(|x| x as f64),
        }
    }

    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// GGUF tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGUF order: `dims[0]` is the contiguous (innermost) one, so a PyTorch
    /// shape is this list reversed.
    pub dims: Vec<u64>,
    /// Storage type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in PyTorch order (GGUF dims reversed).
    pub fn torch_shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }

    /// Bytes the tensor occupies in the file.
    pub fn n_bytes(&self) -> Result<u64> {
        let (block, bytes) = self.ggml_type.block();
        let n = self.n_elements();
        let row = self.dims.first().copied().unwrap_or(1);
        if !row.is_multiple_of(block as u64) {
            return Err(Error::Gguf(format!(
                "tensor `{}`: row length {row} is not a multiple of the {:?} block size {block}",
                self.name, self.ggml_type
            )));
        }
        (n / block as u64)
            .checked_mul(bytes as u64)
            .ok_or_else(|| Error::Gguf(format!("tensor `{}`: size overflows", self.name)))
    }
}

/// A parsed GGUF file: metadata and tensor directory, with the file kept open so tensor data
/// can be read on demand.
pub struct GgufFile {
    path: PathBuf,
    file: File,
    file_len: u64,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensor directory in file order.
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Bounded little-endian reader over the header.
struct Cursor<R> {
    inner: R,
    pos: u64,
    len: u64,
}

impl<R: Read> Cursor<R> {
    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if n > self.len.saturating_sub(self.pos) {
            return Err(Error::Gguf(format!(
                "truncated file: {what} needs {n} bytes at offset {} but the file has {}",
                self.pos, self.len
            )));
        }
        let mut buf = vec![0u8; n as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| Error::Gguf(format!("reading {what} at offset {}: {e}", self.pos)))?;
        self.pos += n;
        Ok(buf)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let v = self.bytes(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(&v);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let b = self.bytes(n, what)?;
        String::from_utf8(b).map_err(|_| Error::Gguf(format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.array(key)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(key)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(key)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(Error::Gguf(format!(
                        "metadata `{key}`: invalid bool byte {b}"
                    )));
                }
            },
            8 => Value::String(self.string(key)?),
            9 => {
                if depth > 0 {
                    return Err(Error::Gguf(format!(
                        "metadata `{key}`: nested arrays are not supported"
                    )));
                }
                let elem_ty = self.u32(key)?;
                let n = self.u64(key)?;
                // Every element takes at least one byte: reject counts the file cannot hold
                // before allocating.
                if n > self.len.saturating_sub(self.pos) {
                    return Err(Error::Gguf(format!(
                        "metadata `{key}`: array of {n} elements cannot fit in the rest of the file"
                    )));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(key)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            other => {
                return Err(Error::Gguf(format!(
                    "metadata `{key}`: unknown value type {other}"
                )));
            }
        })
    }
}

/// Keys and tensor names are ASCII identifiers (ggml's `docs/gguf.md`); ones with control
/// characters or of unreasonable length are corrupt and would garble error messages.
fn printable(s: &str, what: &str) -> Result<()> {
    const MAX_NAME: usize = 1 << 16;
    if s.len() > MAX_NAME || s.chars().any(char::is_control) {
        let shown: String = s
            .chars()
            .take(48)
            .collect::<String>()
            .escape_debug()
            .to_string();
        return Err(Error::Gguf(format!(
            "{what} (\"{shown}…\", {} bytes) is not a printable name",
            s.len()
        )));
    }
    Ok(())
}

impl GgufFile {
    /// Open and parse the header, metadata and tensor directory of a GGUF file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let ctx = |e: Error| match e {
            Error::Gguf(m) => Error::Gguf(format!("{}: {m}", path.display())),
            other => other,
        };
        let mut reader = BufReader::with_capacity(1 << 20, &file);
        reader
            .seek(SeekFrom::Start(0))
            .map_err(|e| Error::io(path, e))?;
        let mut c = Cursor {
            inner: reader,
            pos: 0,
            len: file_len,
        };
        let (version, metadata, tensors, data_offset) = Self::parse(&mut c).map_err(ctx)?;
        let g = GgufFile {
            path: path.to_path_buf(),
            file,
            file_len,
            version,
            metadata,
            tensors,
            data_offset,
        };
        g.check_extents().map_err(ctx)?;
        Ok(g)
    }

    #[allow(clippy::type_complexity)]
    fn parse<R: Read>(
        c: &mut Cursor<R>,
    ) -> Result<(u32, BTreeMap<String, Value>, Vec<TensorInfo>, u64)> {
        let magic: [u8; 4] = c
            .array("magic")
            .map_err(|_| Error::Gguf(format!("not a GGUF file: only {} bytes", c.len)))?;
        if magic != MAGIC {
            return Err(Error::Gguf(format!(
                "not a GGUF file: bad magic {:02x?} (expected \"GGUF\")",
                magic
            )));
        }
        let version = c.u32("version")?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(Error::Gguf(
                    "GGUF version 1 is obsolete and not supported".into(),
                ));
            }
            v if v.swap_bytes() <= 3 => {
                return Err(Error::Gguf(
                    "big-endian GGUF files are not supported".into(),
                ));
            }
            v => return Err(Error::Gguf(format!("unsupported GGUF version {v}"))),
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        // A tensor entry or a key/value needs at least 8 + 4 bytes.
        let room = c.len.saturating_sub(c.pos) / 12;
        if n_tensors > room || n_kv > room {
            return Err(Error::Gguf(format!(
                "truncated or corrupt header: it claims {n_tensors} tensors and {n_kv} metadata entries, more than the file can hold"
            )));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            printable(&key, &format!("metadata key #{i}"))?;
            let ty = c.u32(&key)?;
            let value = c.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(Error::Gguf(format!("duplicate metadata key `{key}`")));
            }
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}"))?;
            printable(&name, &format!("tensor name #{i}"))?;
            let n_dims = c.u32(&name)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(Error::Gguf(format!(
                    "tensor `{name}`: invalid rank {n_dims}"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&name)?);
            }
            let raw_type = c.u32(&name)?;
            let ggml_type = GgmlType::from_u32(raw_type).ok_or_else(|| {
                Error::Gguf(format!(
                    "tensor `{name}`: unknown or unsupported tensor type {raw_type}"
                ))
            })?;
            let offset = c.u64(&name)?;
            if dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .is_none()
            {
                return Err(Error::Gguf(format!(
                    "tensor `{name}`: element count overflows"
                )));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(Error::Gguf(format!(
                        "`general.alignment` must be a positive power of two, got {v:?}"
                    )));
                }
            },
        };
        let data_offset = c.pos.div_ceil(alignment) * alignment;
        Ok((version, metadata, tensors, data_offset))
    }

    /// Every tensor must lie inside the file.
    fn check_extents(&self) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for t in &self.tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(Error::Gguf(format!("duplicate tensor name `{}`", t.name)));
            }
            let n_bytes = t.n_bytes()?;
            let end = self
                .data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(n_bytes));
            match end {
                Some(end) if end <= self.file_len => {}
                _ => {
                    return Err(Error::Gguf(format!(
                        "truncated file: tensor `{}` ({:?}, dims {:?}) extends past the end of the file ({} bytes)",
                        t.name, t.ggml_type, t.dims, self.file_len
                    )));
                }
            }
        }
        Ok(())
    }

    /// The path this file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required unsigned integer.
    pub fn u64(&self, key: &str) -> Result<u64> {
        self.opt_u64(key)?
            .ok_or_else(|| Error::Gguf(format!("missing metadata `{key}`")))
    }

    /// An optional unsigned integer (wrong type is an error).
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, Value::as_u64, "a non-negative integer")
    }

    /// An optional float (integers accepted).
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, Value::as_f64, "a number")
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, Value::as_bool, "a bool")
    }

    /// An optional string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| {
                Error::Gguf(format!(
                    "metadata `{key}` must be a string, got {}",
                    v.type_name()
                ))
            }),
        }
    }

    /// An optional array of strings.
    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.opt_array(key, |v| v.as_str(), "strings")
    }

    /// An optional array whose elements all convert with `f`.
    pub fn opt_array<'a, T>(
        &'a self,
        key: &str,
        f: impl Fn(&'a Value) -> Option<T>,
        what: &str,
    ) -> Result<Option<Vec<T>>> {
        let Some(v) = self.metadata.get(key) else {
            return Ok(None);
        };
        let arr = v.as_array().ok_or_else(|| {
            Error::Gguf(format!(
                "metadata `{key}` must be an array of {what}, got {}",
                v.type_name()
            ))
        })?;
        arr.iter()
            .map(|x| {
                f(x).ok_or_else(|| {
                    Error::Gguf(format!(
                        "metadata `{key}` must be an array of {what}, found a {}",
                        x.type_name()
                    ))
                })
            })
            .collect::<Result<Vec<T>>>()
            .map(Some)
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        f: impl Fn(&'a Value) -> Option<T>,
        what: &str,
    ) -> Result<Option<T>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => f(v)
                .map(Some)
                .ok_or_else(|| Error::Gguf(format!("metadata `{key}` must be {what}, got {v:?}"))),
        }
    }

    /// A tensor's directory entry by GGUF name.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor as stored.
    pub fn read_raw(&self, info: &TensorInfo) -> Result<Vec<u8>> {
        let n = info.n_bytes()?;
        let start = self.data_offset + info.offset;
        let mut buf = vec![0u8; n as usize];
        self.file.read_exact_at(&mut buf, start).map_err(|e| {
            Error::Gguf(format!(
                "{}: reading tensor `{}`: {e}",
                self.path.display(),
                info.name
            ))
        })?;
        Ok(buf)
    }

    /// A tensor de-quantized to `f32`, flat in storage order (row-major over the reversed dims).
    pub fn read_f32(&self, info: &TensorInfo) -> Result<Vec<f32>> {
        let raw = self.read_raw(info)?;
        dequant::dequantize(info.ggml_type, &raw, info.n_elements() as usize).map_err(|e| match e {
            Error::Gguf(m) => Error::Gguf(format!("tensor `{}`: {m}", info.name)),
            other => other,
        })
    }

    /// A tensor de-quantized to a float32 CPU `tch::Tensor` in PyTorch shape (decoded straight
    /// into the tensor's storage).
    pub fn read_tensor(&self, info: &TensorInfo) -> Result<tch::Tensor> {
        let raw = self.read_raw(info)?;
        let n = info.n_elements() as usize;
        let t = tch::Tensor::f_empty([n as i64], (tch::Kind::Float, tch::Device::Cpu))?;
        if n > 0 {
            // SAFETY: `t` was just allocated as a contiguous CPU float32 tensor of `n` elements
            // and nothing else refers to its storage while this slice lives.
            let out = unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n) };
            dequant::dequantize_into(info.ggml_type, &raw, out).map_err(|e| match e {
                Error::Gguf(m) => Error::Gguf(format!("tensor `{}`: {m}", info.name)),
                other => other,
            })?;
        }
        Ok(t.f_reshape(info.torch_shape())?)
    }
}
