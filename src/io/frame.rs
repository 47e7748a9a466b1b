//! Columns of a Parquet file read by name, for the study analyses.
//!
//! Integer columns accept any Arrow integer width that holds the values, string columns any of
//! Utf8 / LargeUtf8 / Utf8View, list columns List or LargeList: files written by pyarrow or
//! polars read as well as those written by kvcredit. Every failure is one `Error::Output` line
//! naming the file and the column.
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type,
    UInt32Type, UInt64Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::{Error, Result};

/// Names of the top-level columns of a Parquet file.
pub(crate) fn column_names(path: &Path) -> Result<Vec<String>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| out_err(path, format_args!("not a readable Parquet file ({e})")))?;
    Ok(builder
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect())
}

/// Columns of one Parquet file, read by name.
pub(crate) struct Frame {
    path: PathBuf,
    batches: Vec<RecordBatch>,
    rows: usize,
    columns: Vec<String>,
}

pub(crate) fn out_err(path: &Path, msg: impl fmt::Display) -> Error {
    Error::Output(format!("{}: {msg}", path.display()))
}

impl Frame {
    /// Read `columns` (top-level names) of a Parquet file; a missing column is an error.
    pub(crate) fn read(path: &Path, columns: &[&str]) -> Result<Frame> {
        Frame::read_optional(path, columns, &[])
    }

    /// Read `columns` and those of `optional` that the file has ([`Frame::has`] tells which).
    pub(crate) fn read_optional(path: &Path, columns: &[&str], optional: &[&str]) -> Result<Frame> {
        crate::io::contain_panics(
            || Self::read_columns(path, columns, optional),
            |m| crate::io::parquet::corrupt(path, m),
        )
    }

    fn read_columns(path: &Path, columns: &[&str], optional: &[&str]) -> Result<Frame> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file)
            .map_err(|e| out_err(path, format_args!("not a readable Parquet file ({e})")))?;
        let schema = builder.schema().clone();
        let position = |c: &str| schema.fields().iter().position(|f| f.name() == c);
        let mut roots = Vec::with_capacity(columns.len() + optional.len());
        for &c in columns {
            match position(c) {
                Some(i) => roots.push(i),
                None => return Err(out_err(path, format_args!("missing column `{c}`"))),
            }
        }
        roots.extend(optional.iter().filter_map(|&c| position(c)));
        let names = roots
            .iter()
            .map(|&i| schema.field(i).name().clone())
            .collect();
        let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
        let reader = builder
            .with_projection(mask)
            .build()
            .map_err(|e| out_err(path, e))?;
        let mut batches = Vec::new();
        let mut rows = 0;
        for b in reader {
            let b = b.map_err(|e| out_err(path, e))?;
            rows += b.num_rows();
            batches.push(b);
        }
        Ok(Frame {
            path: path.to_path_buf(),
            batches,
            rows,
            columns: names,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.rows
    }

    /// Whether the column was read (always true for a required one).
    pub(crate) fn has(&self, col: &str) -> bool {
        self.columns.iter().any(|c| c == col)
    }

    pub(crate) fn err(&self, col: &str, msg: impl fmt::Display) -> Error {
        out_err(&self.path, format_args!("column `{col}`: {msg}"))
    }

    fn arrays<'a>(&'a self, col: &'a str) -> impl Iterator<Item = Result<&'a dyn Array>> + 'a {
        self.batches.iter().map(move |b| {
            b.column_by_name(col)
                .map(|a| a.as_ref())
                .ok_or_else(|| self.err(col, "missing"))
        })
    }

    fn no_nulls(&self, col: &str, a: &dyn Array) -> Result<()> {
        if a.null_count() > 0 {
            Err(self.err(col, format_args!("{} null values", a.null_count())))
        } else {
            Ok(())
        }
    }

    /// Any integer column as `i64` (u64 values above `i64::MAX` are an error).
    pub(crate) fn i64s(&self, col: &str) -> Result<Vec<i64>> {
        let mut out = Vec::with_capacity(self.rows);
        for a in self.arrays(col) {
            let a = a?;
            self.no_nulls(col, a)?;
            push_ints(a, &mut out).map_err(|m| self.err(col, m))?;
        }
        Ok(out)
    }

    /// An integer column whose values must fit `u32`.
    pub(crate) fn u32s(&self, col: &str) -> Result<Vec<u32>> {
        self.i64s(col)?
            .into_iter()
            .map(|v| u32::try_from(v).map_err(|_| self.err(col, format_args!("{v} is not a u32"))))
            .collect()
    }

    /// A Float64 (or Float32) column.
    pub(crate) fn f64s(&self, col: &str) -> Result<Vec<f64>> {
        let mut out = Vec::with_capacity(self.rows);
        for a in self.arrays(col) {
            let a = a?;
            self.no_nulls(col, a)?;
            match a.data_type() {
                DataType::Float64 => out.extend(a.as_primitive::<Float64Type>().values()),
                DataType::Float32 => out.extend(
                    a.as_primitive::<Float32Type>()
                        .values()
                        .iter()
                        .map(|&x| f64::from(x)),
                ),
                t => return Err(self.err(col, format_args!("type {t}, expected Float64"))),
            }
        }
        Ok(out)
    }

    /// A Float64 column that may hold nulls.
    pub(crate) fn opt_f64s(&self, col: &str) -> Result<Vec<Option<f64>>> {
        let mut out = Vec::with_capacity(self.rows);
        for a in self.arrays(col) {
            let a = a?;
            match a.data_type() {
                DataType::Float64 => out.extend(a.as_primitive::<Float64Type>().iter()),
                t => return Err(self.err(col, format_args!("type {t}, expected Float64"))),
            }
        }
        Ok(out)
    }

    /// An Int64 column that may hold nulls.
    pub(crate) fn opt_i64s(&self, col: &str) -> Result<Vec<Option<i64>>> {
        let mut out = Vec::with_capacity(self.rows);
        for a in self.arrays(col) {
            let a = a?;
            match a.data_type() {
                DataType::Int64 => out.extend(a.as_primitive::<Int64Type>().iter()),
                t => return Err(self.err(col, format_args!("type {t}, expected Int64"))),
            }
        }
        Ok(out)
    }

    /// A Boolean column.
    pub(crate) fn bools(&self, col: &str) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(self.rows);
        for a in self.arrays(col) {
            let a = a?;
            self.no_nulls(col, a)?;
            match a.data_type() {
                DataType::Boolean => out.extend(a.as_boolean().values().iter()),
                t => return Err(self.err(col, format_args!("type {t}, expected Boolean"))),
            }
        }
        Ok(out)
    }

    /// A string column that may hold nulls.
    pub(crate) fn opt_strings(&self, col: &str) -> Result<Vec<Option<String>>> {
        let mut out = Vec::with_capacity(self.rows);
        for a in self.arrays(col) {
            let a = a?;
            let own = |s: Option<&str>| s.map(str::to_owned);
            match a.data_type() {
                DataType::Utf8 => out.extend(a.as_string::<i32>().iter().map(own)),
                DataType::LargeUtf8 => out.extend(a.as_string::<i64>().iter().map(own)),
                DataType::Utf8View => out.extend(a.as_string_view().iter().map(own)),
                t => return Err(self.err(col, format_args!("type {t}, expected Utf8"))),
            }
        }
        Ok(out)
    }

    /// A string column without nulls.
    pub(crate) fn strings(&self, col: &str) -> Result<Vec<String>> {
        self.opt_strings(col)?
            .into_iter()
            .map(|s| s.ok_or_else(|| self.err(col, "null values")))
            .collect()
    }

    /// A List/LargeList of integers.
    pub(crate) fn int_lists(&self, col: &str) -> Result<Vec<Vec<i64>>> {
        let mut out = Vec::with_capacity(self.rows);
        for a in self.arrays(col) {
            let a = a?;
            self.no_nulls(col, a)?;
            let mut push = |v: Option<std::sync::Arc<dyn Array>>| -> Result<()> {
                let v = v.ok_or_else(|| self.err(col, "null list"))?;
                self.no_nulls(col, v.as_ref())?;
                let mut row = Vec::with_capacity(v.len());
                push_ints(v.as_ref(), &mut row).map_err(|m| self.err(col, m))?;
                out.push(row);
                Ok(())
            };
            match a.data_type() {
                DataType::List(_) => a.as_list::<i32>().iter().try_for_each(&mut push)?,
                DataType::LargeList(_) => a.as_list::<i64>().iter().try_for_each(&mut push)?,
                t => return Err(self.err(col, format_args!("type {t}, expected List<Int64>"))),
            }
        }
        Ok(out)
    }
}

fn push_ints(a: &dyn Array, out: &mut Vec<i64>) -> std::result::Result<(), String> {
    macro_rules! widen {
        ($t:ty) => {
            out.extend(
                a.as_primitive::<$t>()
                    .values()
                    .iter()
                    .map(|&x| i64::from(x)),
            )
        };
    }
    match a.data_type() {
        DataType::Int8 => widen!(Int8Type),
        DataType::Int16 => widen!(Int16Type),
        DataType::Int32 => widen!(Int32Type),
        DataType::Int64 => widen!(Int64Type),
        DataType::UInt8 => widen!(UInt8Type),
        DataType::UInt16 => widen!(UInt16Type),
        DataType::UInt32 => widen!(UInt32Type),
        DataType::UInt64 => {
            for &x in a.as_primitive::<UInt64Type>().values() {
                out.push(i64::try_from(x).map_err(|_| format!("{x} does not fit i64"))?);
            }
        }
        t => return Err(format!("type {t}, expected an integer type")),
    }
    Ok(())
}
