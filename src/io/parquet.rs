//! Column-oriented tables written to and read from Parquet (Arrow), atomically.
use crate::{Error, Result};
use arrow_array::builder::{Float64Builder, Int64Builder, ListBuilder};
use arrow_array::{
    Array, ArrayRef, BooleanArray, Float64Array, Int64Array, RecordBatch, StringArray, UInt32Array,
};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use std::path::Path;
use std::sync::Arc;

/// One typed column.
#[derive(Debug, Clone, PartialEq)]
pub enum Column {
    /// Unsigned 32-bit integers.
    U32(Vec<u32>),
    /// Signed 64-bit integers.
    I64(Vec<i64>),
    /// 64-bit floats.
    F64(Vec<f64>),
    /// Booleans.
    Bool(Vec<bool>),
    /// UTF-8 strings.
    Str(Vec<String>),
    /// Nullable UTF-8 strings.
    OptStr(Vec<Option<String>>),
    /// Nullable signed 64-bit integers.
    OptI64(Vec<Option<i64>>),
    /// Nullable 64-bit floats.
    OptF64(Vec<Option<f64>>),
    /// Lists of signed 64-bit integers (token ids).
    ListI64(Vec<Vec<i64>>),
    /// Lists of 64-bit floats.
    ListF64(Vec<Vec<f64>>),
}

impl Column {
    fn len(&self) -> usize {
        match self {
            Column::U32(v) => v.len(),
            Column::I64(v) => v.len(),
            Column::F64(v) => v.len(),
            Column::Bool(v) => v.len(),
            Column::Str(v) => v.len(),
            Column::OptStr(v) => v.len(),
            Column::OptI64(v) => v.len(),
            Column::OptF64(v) => v.len(),
            Column::ListI64(v) => v.len(),
            Column::ListF64(v) => v.len(),
        }
    }

    fn to_arrow(&self) -> (DataType, bool, ArrayRef) {
        match self {
            Column::U32(v) => (
                DataType::UInt32,
                false,
                Arc::new(UInt32Array::from(v.clone())),
            ),
            Column::I64(v) => (
                DataType::Int64,
                false,
                Arc::new(Int64Array::from(v.clone())),
            ),
            Column::F64(v) => (
                DataType::Float64,
                false,
                Arc::new(Float64Array::from(v.clone())),
            ),
            Column::Bool(v) => (
                DataType::Boolean,
                false,
                Arc::new(BooleanArray::from(v.clone())),
            ),
            Column::Str(v) => (
                DataType::Utf8,
                false,
                Arc::new(StringArray::from(v.clone())),
            ),
            Column::OptStr(v) => (DataType::Utf8, true, Arc::new(StringArray::from(v.clone()))),
            Column::OptI64(v) => (DataType::Int64, true, Arc::new(Int64Array::from(v.clone()))),
            Column::OptF64(v) => (
                DataType::Float64,
                true,
                Arc::new(Float64Array::from(v.clone())),
            ),
            Column::ListI64(v) => {
                let mut b = ListBuilder::new(Int64Builder::new()).with_field(Arc::new(Field::new(
                    "item",
                    DataType::Int64,
                    false,
                )));
                for row in v {
                    b.values().append_slice(row);
                    b.append(true);
                }
                let arr = b.finish();
                (arr.data_type().clone(), false, Arc::new(arr))
            }
            Column::ListF64(v) => {
                let mut b = ListBuilder::new(Float64Builder::new())
                    .with_field(Arc::new(Field::new("item", DataType::Float64, false)));
                for row in v {
                    b.values().append_slice(row);
                    b.append(true);
                }
                let arr = b.finish();
                (arr.data_type().clone(), false, Arc::new(arr))
            }
        }
    }
}

/// A table: named columns of equal length.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    columns: Vec<(String, Column)>,
}

impl Table {
    /// An empty table.
    pub fn new() -> Table {
        Table::default()
    }

    /// Append a column (builder style).
    pub fn with(mut self, name: &str, col: Column) -> Table {
        self.columns.push((name.to_string(), col));
        self
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.columns.first().map(|(_, c)| c.len()).unwrap_or(0)
    }

    /// As an Arrow record batch.
    pub fn to_record_batch(&self) -> Result<RecordBatch> {
        let n = self.rows();
        let mut fields = Vec::new();
        let mut arrays = Vec::new();
        for (name, col) in &self.columns {
            if col.len() != n {
                return Err(Error::Output(format!(
                    "column `{name}` has {} rows, expected {n}",
                    col.len()
                )));
            }
            let (dt, nullable, arr) = col.to_arrow();
            fields.push(Field::new(name, dt, nullable));
            arrays.push(arr);
        }
        RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)
            .map_err(|e| Error::Output(e.to_string()))
    }

    /// Write to `path` atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        write_batches(path, &[self.to_record_batch()?])
    }
}

/// Write record batches (all of one schema) to a Parquet file atomically.
pub fn write_batches(path: &Path, batches: &[RecordBatch]) -> Result<()> {
    let Some(first) = batches.first() else {
        return Err(Error::Output(format!(
            "{}: nothing to write",
            path.display()
        )));
    };
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let mut buf = Vec::new();
    {
        let mut w = ArrowWriter::try_new(&mut buf, first.schema(), Some(props))
            .map_err(|e| Error::Output(format!("{}: {e}", path.display())))?;
        for b in batches {
            w.write(b)
                .map_err(|e| Error::Output(format!("{}: {e}", path.display())))?;
        }
        w.close()
            .map_err(|e| Error::Output(format!("{}: {e}", path.display())))?;
    }
    super::write_atomic(path, &buf)
}

/// Read every record batch of a Parquet file.
pub fn read_batches(path: &Path) -> Result<Vec<RecordBatch>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    super::contain_panics(
        || {
            let reader = ParquetRecordBatchReaderBuilder::try_new(file)
                .and_then(|b| b.build())
                .map_err(|e| Error::Output(format!("{}: {e}", path.display())))?;
            reader
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| Error::Output(format!("{}: {e}", path.display())))
        },
        |m| corrupt(path, m),
    )
}

/// The error for a Parquet file whose decoder panicked.
pub fn corrupt(path: &Path, panic: &str) -> Error {
    Error::Output(format!(
        "{}: corrupt Parquet file (the decoder failed: {panic})",
        path.display()
    ))
}

/// Concatenate Parquet files (same schema) into one, in the given order. When every input
/// is empty, the output is an empty table with the first input's schema.
pub fn concat_files(inputs: &[std::path::PathBuf], out: &Path) -> Result<()> {
    let mut all = Vec::new();
    for p in inputs {
        all.extend(read_batches(p)?);
    }
    if all.is_empty()
        && let Some(first) = inputs.first()
    {
        let file = std::fs::File::open(first).map_err(|e| Error::io(first, e))?;
        let schema = ParquetRecordBatchReaderBuilder::try_new(file)
            .map_err(|e| Error::Output(format!("{}: {e}", first.display())))?
            .schema()
            .clone();
        all.push(RecordBatch::new_empty(schema));
    }
    write_batches(out, &all)
}
